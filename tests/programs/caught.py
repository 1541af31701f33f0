"""SyncedFile's block left with an exception on rank 1, which the program catches and goes on."""
import os
import sys
import time
import torch
import torch.distributed as dist
import hpcsync
from _report import report
topo = hpcsync.init()
r = topo.rank
t0 = time.monotonic()
try:
    with hpcsync.SyncedFile(os.path.join(sys.argv[1], "m.csv"), strip_header=True) as part:
        with part.open("w") as f:
            f.write("a\n1\n")
            if r == 1:
                raise ValueError("caught later")
    out = "merged"
except hpcsync.SyncError:
    out = "SyncError"
except ValueError:
    out = "ValueError"
t = torch.ones(1)
dist.all_reduce(t)
report(r, {"rank": r, "world_size": topo.world_size, "out": out, "s": time.monotonic() - t0, "sum": t.item()})
