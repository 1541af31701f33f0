"""Warnings logged to the end reach rank 0's console. ``late_warning.py``: console logging on
(no folder); every rank logs one warning three times; rank 0 is then done, and rank 1 warns once
more 1.5 s later, just before it exits."""
import logging
import time

from _report import report

import hpcsync

hpcsync.setup_logging()
rank, size = hpcsync.get_rank(), hpcsync.get_world_size()
log = logging.getLogger("app")
for _ in range(3):
    log.warning("the same warning, three times on every rank")
report(rank, {"rank": rank, "world_size": size})
if rank == 1:
    time.sleep(1.5)
    log.warning("a late warning from rank 1")
