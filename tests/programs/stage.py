"""hpcsync.stage(SRC, DST, **options) on every rank; report the result or the error.

Options: JSON in argv[3] or in $HPCSYNC_TEST_STAGE_OPTS (what crosses a namespace node's shell).
``_fault``: a list of faults (see ``_fault.py``). ``_round_entries``: entries per round of the
listing across nodes. ``_init``: ``hpcsync.init()`` first; ``_again``: after a stage that failed, stage
once more (the faults were one call each) and report that too (``again``); ``_uncaught``: let
the error escape (the abort hook's failure report).
"""
import json
import os
import socket
import sys
from dataclasses import asdict

import hpcsync
from hpcsync import comm
from _fault import inject_faults
from _report import report

src, dst = sys.argv[1], sys.argv[2]
opts = json.loads(sys.argv[3] if len(sys.argv) > 3 else os.environ.get("HPCSYNC_TEST_STAGE_OPTS", "{}"))
rank, size = comm.get_rank(), comm.get_world_size()
if rank == 1 and "_rank1" in opts:  # a rank that diverges
    opts.update(opts["_rank1"])
opts.pop("_rank1", None)
src, dst = opts.pop("src", src), opts.pop("dst", dst)


inject_faults(opts.pop("_fault", []), rank)
if "_round_entries" in opts:  # rounds of the listing across nodes, small enough to see several
    import hpcsync.data.staging.rounds

    hpcsync.data.staging.rounds.ROUND_ENTRIES = opts.pop("_round_entries")
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
