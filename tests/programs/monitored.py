"""hpcsync.monitored_barrier: ranks 2.. (listed in argv[2]) arrive late; report what each rank saw."""
import sys
import time

import hpcsync
from hpcsync import comm
from _report import report

wait_all, late = sys.argv[1] == "all", [int(r) for r in sys.argv[2].split(",") if r]
rank = comm.get_rank()
out = {"rank": rank, "world_size": comm.get_world_size()}
hpcsync.monitored_barrier(timeout=5)  # everyone on time: passes
if rank in late:
    time.sleep(3)
t0 = time.monotonic()
try:
    hpcsync.monitored_barrier(timeout=1.5, wait_all_ranks=wait_all)
    out["error"] = None
except RuntimeError as exc:
    out["error"] = str(exc)
out["seconds"] = time.monotonic() - t0
report(rank, out)
