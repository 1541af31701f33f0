"""Rank 0 alone raises inside a collective hpcsync call, with the abort hook off: every other rank
must end within the timeout with one error, not wait forever.

    bounded_fail.py save|requeue

``save``: rank 0 raises inside ``Checkpoints.save`` (before it joins the gather of the local
states); ``requeue``: inside ``requeue()`` (in its decision, before the broadcast). Each rank
reports the error it got and when, waits (15 s at most) for the others' reports, then lets the
error end the process.
"""
import os
import sys
import time

import hpcsync
import hpcsync.resilience.checkpoint
import hpcsync.resilience.requeue
from hpcsync.core.topology import topology
from _report import report

mode = sys.argv[1]
topo = topology()
out = {"rank": topo.rank, "world_size": topo.world_size}


def injected(*args, **kwargs):
    raise RuntimeError("injected on rank 0")


ckpts = hpcsync.Checkpoints(os.path.join(os.environ["HPCSYNC_TEST_OUT"], "ckpt"), timeout=4)
ckpts.save(1, shared={"w": 1})  # a first save that works: the private communicator exists
if topo.rank == 0:
    if mode == "save":
        hpcsync.resilience.checkpoint.comm.gather = injected
    else:
        hpcsync.resilience.requeue._decide = injected
t0 = time.monotonic()
try:
    if mode == "save":
        ckpts.save(2, shared={"w": 2})
    else:
        hpcsync.requeue(timeout=4)
    out["error"] = None
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
    out["seconds"] = time.monotonic() - t0
    report(topo.rank, out)
    # the first rank to exit ends the job (MPI_Abort at exit, for the abandoned collective): wait
    # a bounded while for every rank's report first, so a rank slowed by a loaded machine reports too
    reports = [os.path.join(os.environ["HPCSYNC_TEST_OUT"], f"rank{r}.json") for r in range(topo.world_size)]
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not all(os.path.exists(f) for f in reports):
        time.sleep(0.05)
    raise
report(topo.rank, out)
