"""hpcsync.init(BACKEND); report the master address chosen or the error raised (and how long it took)."""
import sys
import time

import hpcsync
from hpcsync.core.topology import topology
from _report import report

topo = topology()
out = {"rank": topo.rank, "world_size": topo.world_size}
t0 = time.monotonic()
try:
    hpcsync.init(backend=sys.argv[1], timeout=30)
    out["master"] = hpcsync.start.bootstrap._state["master"].address
    out["reason"] = hpcsync.start.bootstrap._state["master"].reason
    hpcsync.shutdown()
except hpcsync.HpcsyncError as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
out["seconds"] = time.monotonic() - t0
report(topo.rank, out)
