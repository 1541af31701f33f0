"""The last rank never reaches a comm helper (it sleeps); the others must get a CollectiveTimeout
naming the helper within HPCSYNC_TIMEOUT, not wait for good.

    helper_stall.py HELPER
"""
import sys
import time

import hpcsync
from hpcsync import comm
from _report import report

helper = sys.argv[1]
topo = hpcsync.topology()
calls = {"all_gather": lambda: comm.all_gather(topo.rank), "gather": lambda: comm.gather(topo.rank),
         "broadcast_object": lambda: comm.broadcast_object(topo.rank), "synchronize": comm.synchronize,
         "reduce_dict": lambda: comm.reduce_dict({"x": float(topo.rank)})}
comm.synchronize()  # every rank is up
out = {"rank": topo.rank, "world_size": topo.world_size}
if topo.rank == topo.world_size - 1:
    report(topo.rank, out)
    time.sleep(120)  # STUCK HERE
t0 = time.monotonic()
try:
    calls[helper]()
    out["error"] = None
except Exception as exc:  # noqa: BLE001 - what the rank saw is the result
    out["error"], out["message"] = type(exc).__name__, str(exc)
out["took"] = time.monotonic() - t0
report(topo.rank, out)
