"""hpcsync.stage(SRC, DST, **options) on every rank; report the result or the error.

Options: JSON in argv[3] or in $HPCSYNC_TEST_STAGE_OPTS (what crosses a namespace node's shell).
``_fault``: a list of faults, each ``{"rank": R, "patch": "module:Name.attr", "call": N, "do": D}``:
on rank R, call N (from 1) of that function raises (``"raise"``: ``OSError(EIO)`` with
``"error": "EIO"``, else ``RuntimeError``), ends the process as a kill would (``"exit"``),
returns ``"value"`` without running it (``"return"``), never returns, as a read or write on a
stuck disk or filesystem (``"block"``), or freezes the whole process as SIGSTOP does
(``"stop"``). ``_init``: ``hpcsync.init()`` first; ``_again``: after a stage that failed, stage
once more (the faults were one call each) and report that too (``again``); ``_uncaught``: let
the error escape (the abort hook's failure report).
"""
import errno
import importlib
import itertools
import json
import os
import signal
import socket
import sys
import threading
from dataclasses import asdict

import hpcsync
from hpcsync import comm
from _report import report

src, dst = sys.argv[1], sys.argv[2]
opts = json.loads(sys.argv[3] if len(sys.argv) > 3 else os.environ.get("HPCSYNC_TEST_STAGE_OPTS", "{}"))
rank, size = comm.get_rank(), comm.get_world_size()
if rank == 1 and "_rank1" in opts:  # a rank that diverges
    opts.update(opts["_rank1"])
opts.pop("_rank1", None)
src, dst = opts.pop("src", src), opts.pop("dst", dst)


def inject(fault: dict) -> None:
    module, _, qualname = fault["patch"].partition(":")
    owner = importlib.import_module(module)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    real, calls = getattr(owner, name), itertools.count(1)

    def patched(*args, **kwargs):
        if next(calls) != fault.get("call", 1):
            return real(*args, **kwargs)
        do = fault.get("do", "raise")
        if do == "exit":
            os._exit(9)
        if do == "return":
            return fault.get("value")
        if do == "block":
            threading.Event().wait()
        if do == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
            return real(*args, **kwargs)
        if fault.get("error") == "EIO":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        raise RuntimeError(f"fault injected into {qualname}")

    setattr(owner, name, patched)


for fault in opts.pop("_fault", []):
    if fault["rank"] == rank:
        inject(fault)
again, uncaught = opts.pop("_again", False), opts.pop("_uncaught", False)
opts.setdefault("names", True)  # the tests compare names; "names": false checks the summary
if opts.pop("_init", False):
    hpcsync.init()

out = {"rank": rank, "world_size": size, "hostname": socket.gethostname(),
       "local_rank": comm.get_local_rank(), "node_rank": hpcsync.topology().node_rank}
try:
    out.update(ok=True, result=asdict(hpcsync.stage(src, dst, **opts)))
except Exception as exc:  # what a program that catches the error sees (a StageError, nothing else)
    out.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    if uncaught:
        report(rank, out)
        raise
    if again:
        try:
            out["again"] = {"ok": True, "result": asdict(hpcsync.stage(src, dst, **opts))}
        except Exception as exc2:
            out["again"] = {"ok": False, "error": f"{type(exc2).__name__}: {exc2}"}
report(rank, out)
sys.exit(0 if out["ok"] else 3)
