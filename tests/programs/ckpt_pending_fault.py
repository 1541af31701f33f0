"""An exception inside a ``with Checkpoints(...)`` block while a background save is in flight.

    ckpt_pending_fault.py ROOT BAD

Inside the block every rank loads the latest checkpoint (its contents checked: the step's own,
this rank's own), saves the next step in the background and waits for it (complete), then saves one more in the background whose write on rank 0 is held up for a minute (a
slow disk): that save is in flight when rank BAD raises, while the other ranks go on to the
training's next collective (an all_reduce), where they wait for it. BAD -1: no fault (the rerun);
every rank reports what it loaded and rank 0 the root's listing before anything new is written.
"""
import os
import sys
import time

import torch
import torch.distributed as dist

import hpcsync
import hpcsync.resilience.checkpoint_io as io_
from _report import report

root, bad = sys.argv[1], int(sys.argv[2])
topo = hpcsync.init()
rank, size = topo.rank, topo.world_size


def train_step(step: int) -> None:
    t = torch.full((4,), float(rank + step))
    dist.all_reduce(t)  # the program's own collective: the others wait here for a rank that failed


def state(step: int) -> dict:
    return {"shared": {"w": torch.full((8,), float(step))}, "local": {"rank": rank, "step": step}}


with hpcsync.Checkpoints(root) as ckpts:
    listing = sorted(os.listdir(root)) if rank == 0 and os.path.isdir(root) else None
    saved = ckpts.load()  # the previous complete one, or none: its contents are its step's, this rank's
    if saved is not None:
        assert saved.shared["w"].tolist() == [float(saved.step)] * 8, saved
        assert saved.local == {"rank": rank, "step": saved.step}, saved
    loaded = None if saved is None else saved.step
    if bad < 0:
        report(rank, {"rank": rank, "world_size": size, "loaded": loaded, "listing": listing})
        sys.exit(0)
    first = 0 if saved is None else saved.step + 1
    ckpts.save(first, background=True, **state(first))
    train_step(first)
    ckpts.wait()  # (collective) complete on disk before rank 0's disk stalls
    if rank == 0:
        real = io_.write_file

        def slow(path, data):  # rank 0's disk stalls: this save stays in flight
            time.sleep(60)
            real(path, data)

        io_.write_file = slow
    ckpts.save(first + 1, background=True, **state(first + 1))
    if rank == bad:
        raise RuntimeError(f"injected fault on rank {rank} while the background save of step {first + 1} is "
                           "in flight")
    train_step(first + 1)
report(rank, {"rank": rank, "world_size": size, "ended": "the block ended without the fault"})
