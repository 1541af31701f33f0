"""Training-like steps under hpcsync.monitor, one rank slowed from some step on.

    straggler.py BACKEND MODE SLOW_FROM STEPS [SLOW_RANK] [FACTOR] [SLEEP_MS]
    straggler.py settings        (ranks 1 and 2 ask for other settings: the same ValueError everywhere)
    straggler.py stuck           (rank 2 stops for 30 s: the others' close() ends at its timeout of 2 s)

Each step: a sleep of SLEEP_MS (2) times a random ±10 % (and rank 1 10 % longer throughout: ordinary
differences between ranks), timed as the section ``compute``, then MODE ``allreduce``: a 16-float
all_reduce, on gloo inside a ``comm`` section (the hpcsync backend counts its waiting itself);
MODE ``inside``: the all_reduce inside the ``compute`` section (hpcsync backend);
MODE ``ddp``: the sleep inside the forward pass of a small DDP model, whose gradients DDP
all-reduces during the backward pass, then a blocking all_reduce of the loss. From step
SLOW_FROM on, rank SLOW_RANK's sleep is FACTOR times longer. After the loop each rank runs 7 * rank more steps
alone (the ranks end at different windows), then the even ranks close() the monitor and the odd
ones leave it to the exit. Rank 0 reports its verdicts.
"""
import logging
import os
import random
import socket
import sys
import time

import hpcsync
from _report import report

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

if sys.argv[1] == "settings":
    from mpi4py import MPI

    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    try:
        hpcsync.monitor(steps=30 if rank == 1 else 20, windows="2/4" if rank == 2 else "3/5")
        error = None
    except ValueError as exc:
        error = str(exc)
    try:
        hpcsync.monitor(factor="fast" if rank == 2 else None)
        malformed = None
    except ValueError as exc:
        malformed = str(exc)
    report(rank, {"rank": rank, "world_size": size, "error": error, "malformed": malformed})
    sys.exit(0)

if sys.argv[1] == "stuck":
    from mpi4py import MPI

    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    mon = hpcsync.monitor(steps=5, timeout=2)
    for _ in range(5):  # every rank posts the first window
        mon.step()
    if rank == 2:  # then neither steps nor closes for a while
        time.sleep(30)
    for _ in range(7):
        mon.step()
    t0 = time.monotonic()
    try:
        mon.close()
        error = None
    except hpcsync.CollectiveTimeout as exc:
        error = str(exc)
    report(rank, {"rank": rank, "world_size": size, "error": error, "waited_s": time.monotonic() - t0})
    sys.exit(0)  # the exit ends the job: an operation is abandoned inside MPI

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

backend, mode, slow_from, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
slow_rank = int(sys.argv[5]) if len(sys.argv) > 5 else 3
factor = float(sys.argv[6]) if len(sys.argv) > 6 else 1.4
sleep_base = float(sys.argv[7]) / 1e3 if len(sys.argv) > 7 else 0.002
topo = hpcsync.init(backend=backend, timeout=60)
rank = topo.rank
rng = random.Random(rank)
t = torch.ones(16)
mon = hpcsync.monitor()
compute = mon.section("compute")
comm = mon.section("comm")
sleep_s = 0.0


class Slow(torch.nn.Module):
    """Linear layers, the sleep inside the forward pass (before any gradient exists)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with compute:
            time.sleep(sleep_s)
        return self.layers(x)


if mode == "ddp":
    model = torch.nn.parallel.DistributedDataParallel(Slow(), bucket_cap_mb=0.02)  # a few buckets
    x = torch.randn(8, 64)
t0 = time.monotonic()
for step in range(steps):
    sleep_s = sleep_base * rng.uniform(0.9, 1.1) * (1.1 if rank == 1 else 1.0)
    sleep_s *= factor if rank == slow_rank and step >= slow_from else 1.0
    if mode == "ddp":
        loss = model(x).square().mean()
        loss.backward()
        dist.all_reduce(loss.detach())
    elif mode == "inside":  # the program's collective inside the timed section
        with compute:
            time.sleep(sleep_s)
            dist.all_reduce(t)
    elif backend == "gloo":
        with compute:
            time.sleep(sleep_s)
        with comm:
            dist.all_reduce(t)
    else:
        with compute:
            time.sleep(sleep_s)
        dist.all_reduce(t)
    mon.step()
loop_s = time.monotonic() - t0
for _ in range(7 * rank):  # alone: no collective
    time.sleep(0.001)
    mon.step()
if rank % 2 == 0:
    mon.close()
report(rank, {"rank": rank, "world_size": topo.world_size, "host": socket.gethostname(), "steps": mon.steps,
              "loop_s": loop_s, "verdicts": mon.verdicts, "stragglers": {str(k): v for k, v in mon.stragglers.items()},
              "window": mon.window, "report_dir": os.environ.get("HPCSYNC_REPORT_DIR")})
