"""A rank that stops calling should_stop(): the others get a TimeoutError at the guard's timeout,
under MPI and (torchrun) over torch.distributed, and close() after it returns at once.

    guard_timeout.py [group | never]

Rank 1 calls ``should_stop()`` three times, then sleeps; rank 0 calls it every 10 ms until it
raises, then closes the guard. ``group``: the guard gets a torch process group (``group=``), made with ``dist.new_group`` after ``hpcsync.init``. ``never``: rank 1
never makes a guard and exits after 4 s; rank 0's guard times out while it is being made, and
rank 0 then exits too.
"""
import sys
import time

import torch.distributed as dist

import hpcsync
from _report import report

topo = hpcsync.init(backend="gloo" if not hpcsync.topology().uses_mpi else "hpcsync", timeout=60)
out = {"rank": topo.rank, "world_size": topo.world_size}
if "never" in sys.argv:
    if topo.rank == 1:
        report(topo.rank, out)
        time.sleep(4)
        sys.exit(0)
    t0 = time.monotonic()
    try:
        hpcsync.preemption(timeout=2)
    except TimeoutError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["after_s"] = time.monotonic() - t0
    report(topo.rank, out)
    sys.exit(0)
if "group" in sys.argv:
    pg = dist.new_group(list(range(topo.world_size)))
    guard = hpcsync.PreemptionGuard(group=pg, timeout=2)
else:
    guard = hpcsync.preemption(timeout=2)
calls = 0
if topo.rank == 1:
    for _ in range(3):
        guard.should_stop()
        calls += 1
    out["calls"] = calls
    report(topo.rank, out)
    time.sleep(8)
    sys.exit(0)
t0 = None
try:
    while True:
        guard.should_stop()
        calls += 1
        if calls == 3:
            t0 = time.monotonic()  # the last call rank 1 matches
        time.sleep(0.01)
except TimeoutError as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
    out["after_s"] = time.monotonic() - t0
t1 = time.monotonic()
guard.close()
out["close_s"] = time.monotonic() - t1
out["calls"] = calls
report(topo.rank, out)
