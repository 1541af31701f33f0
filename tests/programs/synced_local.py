"""``SyncedFile(path)`` made on one rank only (a lazily built writer) is local: the job goes on.

    synced_local.py FOLDER
"""
import os
import sys

import hpcsync
from _report import report

topo = hpcsync.init()
if topo.rank == 0:
    sf = hpcsync.SyncedFile(os.path.join(sys.argv[1], "only0.csv"))
    with sf.open("w") as f:
        f.write("x\n")
hpcsync.comm.synchronize()
report(topo.rank, {"rank": topo.rank, "world_size": topo.world_size})
