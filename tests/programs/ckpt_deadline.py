"""A rank-0 save on 2 ranks whose writing takes 4 s (rank 0's disk made slow), under a 2 s timeout,
with a 40 MB state: the others' wait allows for its bytes at HPCSYNC_CHECKPOINT_MBPS.

    ckpt_deadline.py ROOT

Each rank reports the save's outcome (``saved``: the path, or ``error``: the exception's type and
text) and how long it took.
"""
import os
import sys
import time

import torch

import hpcsync
from hpcsync.core.topology import topology
from _report import report

topo = topology()
rank = topo.rank
import hpcsync.resilience.checkpoint_io as io_  # noqa: E402

real = io_.write_file


def slow(path, data):  # a slow disk under rank 0: the whole save takes about 4 s
    time.sleep(4.0 / 4)
    real(path, data)


if rank == 0:
    io_.write_file = slow
ckpts = hpcsync.Checkpoints(sys.argv[1], timeout=2.0)
out = {"rank": rank, "world_size": topo.world_size}
t0 = time.monotonic()
try:
    out["saved"] = os.path.basename(ckpts.save(1, shared={"w": torch.zeros(10_000_000)}, local={"r": rank}))
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
out["seconds"] = time.monotonic() - t0
report(rank, out)
