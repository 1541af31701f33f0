"""A pattern the README and the docs show, run for a few steps, with one fault on one rank.

argv[1]: JSON ``{"pattern": ..., "fault": ..., "rank": r, "step": k, "where": "before"|"after",
"dir": folder}``; ``fault`` is ``none`` (the rerun), ``raise`` (an exception out of the
program's own code), ``kill`` (SIGKILL), ``exit`` (``sys.exit(0)`` mid-run: the process ends
early, cleanly) or ``skip`` (the rank leaves out that step's call -- the join for ``sync_file``, the whole block
for ``synced_file`` -- and goes on).

Every rank reports the steps it finished; what the pattern wrote is checked by the test.
"""
import json
import os
import signal
import sys

import torch
import torch.distributed as dist

import hpcsync
from hpcsync import comm
from _report import report

cfg = json.loads(sys.argv[1])
pattern, fault, bad, at, where, folder = (cfg["pattern"], cfg["fault"], cfg["rank"], cfg["step"], cfg["where"],
                                          cfg["dir"])
STEPS = 3
topo = hpcsync.init(log_dir=cfg.get("log_dir"))  # (a log folder only where a test asks)
rank, size = topo.rank, topo.world_size
with open(os.path.join(folder, f".started.{rank}"), "w") as f:  # (the test checks the launch: n ranks, one world)
    f.write(str(size))
done = []


def hit(step: int, when: str) -> bool:
    return fault != "none" and rank == bad and step == at and when == where


def strike(step: int, when: str) -> bool:
    """The fault, if it is due here; True: leave out this step's call."""
    if not hit(step, when):
        return False
    if fault == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "exit":
        report(rank, {"rank": rank, "world_size": size, "done": done, "exited": True})
        sys.exit(0)
    return fault == "skip"


def train_step(step: int) -> None:
    t = torch.full((4,), float(rank + step))
    dist.all_reduce(t)  # the program's own collective: the others wait here for a rank that failed


def steps(op) -> None:
    for step in range(STEPS):
        skip = strike(step, "before")
        train_step(step)
        if not skip:
            op(step)
        strike(step, "after")
        done.append(step)


if pattern == "synced_file":  # the README's pattern: the training loop inside the block
    if fault == "skip" and rank == bad:  # this rank leaves out the block (and its join)
        steps(lambda step: None)
    else:
        with hpcsync.SyncedFile(os.path.join(folder, "metrics.csv"), strip_header=True) as part:
            with part.open("w", newline="") as f:
                f.write("rank,step\n")
                steps(lambda step: f.write(f"{rank},{step}\n"))
elif pattern == "sync_file":  # each rank writes its part, then one call joins them
    target = os.path.join(folder, "metrics.csv")
    with open(os.path.join(folder, f"metrics.rank{rank}.csv"), "w") as f:
        f.write("rank,step\n")
        steps(lambda step: f.write(f"{rank},{step}\n"))
    if not strike(STEPS, "before"):
        hpcsync.sync_file(target, part=os.path.join(folder, "metrics.rank{rank}.csv"), strip_header=True)
elif pattern == "stage":
    steps(lambda step: hpcsync.stage(os.path.join(folder, "src"), os.path.join(folder, "dst")))
elif pattern in ("checkpoints", "checkpoints_background"):  # background: a save pending after each step's
    background = pattern == "checkpoints_background"
    with hpcsync.Checkpoints(os.path.join(folder, "ckpt")) as ckpts:
        saved = ckpts.load()  # complete or absent: its contents are the step's own, this rank's own
        if saved is not None:
            assert saved.shared["w"].tolist() == [float(saved.step)] * 8 and saved.local == {"rank": rank}, saved
        first = 0 if saved is None else saved.step + 1
        steps(lambda step: ckpts.save(first + step, shared={"w": torch.full((8,), float(first + step))},
                                      local={"rank": rank}, background=background))
elif pattern == "h5":  # collective rows, one dataset, each step's rows appended
    import numpy as np
    from hpcsync import h5

    with h5.CollectiveWriter(os.path.join(folder, "rows.h5")) as w:
        steps(lambda step: w.write("x", np.full((rank + 1, 2), rank * 100 + step, dtype=np.int64)))
elif pattern == "preemption":
    with hpcsync.preemption() as guard:
        steps(lambda step: guard.should_stop())
elif pattern == "monitor":
    with hpcsync.monitor() as mon:
        steps(lambda step: mon.step())
elif pattern == "comm":  # each step one helper after the other
    helpers = [lambda s: comm.all_gather(rank), lambda s: comm.gather(rank), lambda s: comm.broadcast_object(s),
               lambda s: comm.synchronize(), lambda s: comm.reduce_dict({"x": torch.tensor(float(rank))})]

    def each(step: int) -> None:
        for h in helpers:
            h(step)
    steps(each)
else:
    raise SystemExit(f"unknown pattern {pattern!r}")
report(rank, {"rank": rank, "world_size": size, "done": done})
