"""The last rank dies of a segmentation fault (a NULL read, as a crash inside a C library would)
while the others wait in a collective."""
import ctypes
import time

import torch.distributed as dist

import hpcsync

topo = hpcsync.init(backend="hpcsync", timeout=600)
if topo.rank == topo.world_size - 1:
    time.sleep(0.5)
    ctypes.string_at(0)  # CRASH HERE
dist.barrier()
time.sleep(600)
