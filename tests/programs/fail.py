"""Rank 1 raises after init while the others wait in a collective: the job must end, not hang."""
import time

import torch.distributed as dist

import hpcsync

topo = hpcsync.init(backend="gloo", timeout=600)
if topo.rank == 1:
    time.sleep(0.5)
    raise RuntimeError("deliberate failure on rank 1")
dist.barrier()  # would wait forever without the abort
time.sleep(600)
