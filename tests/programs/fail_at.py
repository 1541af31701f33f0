"""A training-like loop that fails on one rank at a fixed step, the same on every start.

    fail_at.py raise|kill|segv RANK STEP [STEPS]

``raise``: RANK raises ValueError at STEP (the program's own bug: not to be retried).
``kill``: RANK SIGKILLs itself at STEP (as a crashing node would).
``segv``: RANK dies of SIGSEGV at STEP (the program's own crash: not to be retried).
Every rank reports its node and what it did; a run that reaches STEPS writes done.
"""
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist

import hpcsync
from _report import report

mode, victim, at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
steps = int(sys.argv[4]) if len(sys.argv) > 4 else 10 ** 6
topo = hpcsync.init(backend="hpcsync")
t = torch.ones(1024)
for step in range(steps):
    dist.all_reduce(t)
    if step == at and topo.rank == victim:
        if mode == "raise":
            raise ValueError(f"bad sample at step {step}")
        if mode == "segv":
            signal.signal(signal.SIGSEGV, signal.SIG_DFL)  # no traceback dump: a plain crash
            os.kill(os.getpid(), signal.SIGSEGV)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.01)
report(topo.rank, {"world_size": topo.world_size, "node": socket.gethostname(), "done": True})
hpcsync.shutdown()
