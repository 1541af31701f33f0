"""Faults injected into a test program: ``{"rank": R, "patch": "module:Name.attr", "call": N, "do": D}``.

On rank R, call N (from 1; a list: each of those calls) of that function raises (``"raise"``: ``OSError(EIO)`` with
``"error": "EIO"``, else ``RuntimeError``), ends the process as a kill would (``"exit"``),
returns ``"value"`` without running it (``"return"``), never returns, as a read or write on a
stuck disk or filesystem (``"block"``), runs it ``"seconds"`` late, as a slow disk would
(``"sleep"``), or freezes the whole process as SIGSTOP does
(``"stop"``, then runs the call once the process goes on).
"""
import errno
import importlib
import itertools
import os
import signal
import threading
import time


def inject(fault: dict) -> None:
    module, _, qualname = fault["patch"].partition(":")
    owner = importlib.import_module(module)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    real, calls = getattr(owner, name), itertools.count(1)

    def patched(*args, **kwargs):
        which = fault.get("call", 1)
        if next(calls) not in (which if isinstance(which, list) else [which]):
            return real(*args, **kwargs)
        do = fault.get("do", "raise")
        if do == "sleep":
            time.sleep(fault["seconds"])
            return real(*args, **kwargs)
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


def inject_faults(faults: list, rank: int) -> None:
    """Inject this rank's faults."""
    for fault in faults:
        if fault["rank"] == rank:
            inject(fault)
