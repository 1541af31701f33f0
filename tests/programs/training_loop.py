"""Ranks in a training-like loop of all_reduce, until told to stop: the victim of node failures.

    training_loop.py BACKEND TIMEOUT SECONDS

Each rank writes ``ready<R>`` (its pid and hostname) into ``$HPCSYNC_TEST_OUT`` once it has done
a few all_reduce, then keeps going for SECONDS. A test then breaks a node (link down, SIGKILL,
SIGSTOP) and measures how the job ends. A rank that finishes reports as usual.
"""
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

import hpcsync
from _report import report

backend, timeout, seconds = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
topo = hpcsync.init(backend=backend, timeout=timeout)
out = os.environ["HPCSYNC_TEST_OUT"]
t = torch.ones(16)
for _ in range(3):
    dist.all_reduce(t)
with open(os.path.join(out, f"ready{topo.rank}.tmp"), "w") as f:  # renamed whole: a test reads it at once
    f.write(f"{os.getpid()} {socket.gethostname()}\n")
os.replace(os.path.join(out, f"ready{topo.rank}.tmp"), os.path.join(out, f"ready{topo.rank}"))
end = time.monotonic() + seconds
steps = 0
while time.monotonic() < end:
    dist.all_reduce(t)  # TRAINING STEP
    steps += 1
    time.sleep(0.01)
report(topo.rank, {"rank": topo.rank, "world_size": topo.world_size, "steps": steps})
