"""The last rank alone (or every rank) sets an environment variable before hpcsync.init.

    odd_setting.py NAME VALUE last|all [catch]

With ``catch`` every rank reports what init raised; without it the exception escapes init, and
the job must end as it would for one from training (the other ranks would otherwise wait in
init's collectives for as long as the launcher lets them).
"""
import os
import sys
import time

from mpi4py import MPI

import hpcsync
from _report import report

name, value, who = sys.argv[1:4]
R, W = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
if who == "all" or R == W - 1:
    os.environ[name] = value
out = {"rank": R, "world_size": W, "error": None}
t0 = time.monotonic()
if sys.argv[4:] == ["catch"]:
    try:
        hpcsync.init(backend="hpcsync", timeout=20)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["seconds"] = time.monotonic() - t0
    report(R, out)
else:
    hpcsync.init(backend="hpcsync", timeout=20)
    report(R, out)
