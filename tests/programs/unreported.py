"""Rank 1 times out inside an operation that rank 0 is inside too (it answers, alive), so rank 1
leaves the hang report to rank 0, whose report never comes (rank 0 never times out here): rank 1
must not end without a failure record of its own. The report's bound is cut to 8 s."""
import os
import time

import hpcsync
from hpcsync.core import mpi
from hpcsync.observe import failure, responder, watchdog
from _report import report

topo = hpcsync.topology()
responder.start()
world = mpi.MPI().COMM_WORLD
log = watchdog.group_log(998, "unreported", [0, 1])
rec = log.start("all_reduce", "float32", (4,), -1)
watchdog.report_bound = lambda: 8.0
world.Barrier()
out = {"rank": topo.rank, "world_size": topo.world_size}
if topo.rank == 1:
    t0 = time.monotonic()
    out["printed"] = watchdog.report_timeout(log, rec, 1.0)
    out["took"] = time.monotonic() - t0
    out["records"] = [r.to_dict() for r in failure.read(os.environ["HPCSYNC_REPORT_DIR"])]
world.Barrier()
report(topo.rank, out)
