"""A job in which rank 1 gets SIGKILLed by the test: inside collectives, or during a file sync.

    victim.py collective|sync WORKDIR

Rank 1 writes WORKDIR/victim.pid when the others are (about to be) inside the operation.
"""
import os
import sys
import time

import torch
import torch.distributed as dist

import hpcsync

mode, work = sys.argv[1], sys.argv[2]
topo = hpcsync.init(backend="hpcsync", timeout=600)
pid_file = os.path.join(work, "victim.pid")


def ready():
    with open(pid_file + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(pid_file + ".tmp", pid_file)


if mode == "collective":
    t = torch.ones(1 << 16)
    for i in range(10 ** 9):
        dist.all_reduce(t)
        if i == 50 and topo.rank == 1:
            ready()
else:
    target = os.path.join(work, "merged.bin")
    with hpcsync.SyncedFile(target, text=False) as part:
        with open(part.path, "wb") as f:
            f.write(bytes([topo.rank]) * (8 << 20))
        if topo.rank == 1:
            ready()
            time.sleep(600)  # killed here while the others wait inside the sync
time.sleep(600)
