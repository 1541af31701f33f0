"""hpcsync.Checkpoints on 3 ranks, each rank in its own working directory (so a relative ROOT is a
different folder on every rank, as with node-local disks): only rank 0's view may count.

    checkpoints.py

Reports per rank: what load() returned after each save, what it returned past leftovers of
interrupted saves, and the errors of a bad local state on one rank and of a 2-rank load of a
3-rank checkpoint.
"""
import logging
import os

import numpy as np
import torch

import hpcsync
from hpcsync.core.topology import topology
from _report import report

logging.basicConfig(level=logging.WARNING)
topo = topology()
from mpi4py import MPI  # noqa: E402  (after hpcsync chose the MPI library)

rank = topo.rank
out = os.environ["HPCSYNC_TEST_OUT"]
own = os.path.join(out, f"cwd{rank}")
os.makedirs(own, exist_ok=True)
os.chdir(own)  # "ckpt" is a different folder on every rank

ckpts = hpcsync.Checkpoints("ckpt", keep=2)
result = {"rank": rank, "world_size": topo.world_size, "empty": ckpts.load() is None, "latest_empty": ckpts.latest()}
shared = {"w": torch.arange(6.0) * (rank + 1), "note": f"from rank {rank}"}  # only rank 0's is kept
for step in (3, 7, 12):
    ckpts.save(step, shared=shared, local={"rank": rank, "step": step, "rng": np.random.default_rng(rank).random(3)})
got = ckpts.load()
result["latest"] = ckpts.latest()
result["loaded"] = {"step": got.step, "shared_w": got.shared["w"].tolist(), "note": got.shared["note"],
                    "local_rank": got.local["rank"], "local_step": got.local["step"],
                    "rng_equal": bool(np.array_equal(got.local["rng"], np.random.default_rng(rank).random(3)))}
result["kept"] = sorted(os.listdir("ckpt")) if rank == 0 else os.path.exists("ckpt")
result["older"] = ckpts.load(7).local["step"]

# leftovers of interrupted saves, on rank 0's disk: a temporary folder, a step without its
# marker, a step whose file was cut short. None of them may be chosen.
if rank == 0:
    os.makedirs("ckpt/.step-00000099.tmp")
    os.makedirs("ckpt/step-00000050")
    with open("ckpt/step-00000050/shared.pt", "wb") as f:
        f.write(b"half")
    os.system("cp -r ckpt/step-00000012 ckpt/step-00000060")
    with open("ckpt/step-00000060/rank-00001.pt", "r+b") as f:
        f.truncate(10)
MPI.COMM_WORLD.Barrier()
result["past_leftovers"] = ckpts.latest()

# one rank's local state cannot be saved: the same error on every rank, nothing new written
try:
    ckpts.save(13, local=(lambda: None) if rank == 2 else {"ok": True})
    result["bad_local"] = None
except hpcsync.CheckpointError as exc:
    result["bad_local"] = str(exc)
result["after_bad_local"] = ckpts.latest()

# a save in the background: the states as they were at save(), written while the program goes on
w = torch.zeros(4)
path = ckpts.save(20, shared={"w": w}, local={"rank": rank}, background=True)
w += 1  # training goes on
result["bg_returned"] = os.path.basename(path)
result["bg_waited"] = os.path.basename(ckpts.wait() or "")
result["bg_wait_again"] = ckpts.wait()  # nothing pending any more
got = ckpts.load()
result["bg_loaded"] = {"step": got.step, "w": got.shared["w"].tolist(), "rank": got.local["rank"]}

# rank 0's background write fails: save() returned, the next call raises it on every rank
import hpcsync.resilience.checkpoint_io as _ck  # noqa: E402

real_write = _ck.write_file
if rank == 0:
    def failing(path, data):
        raise OSError("No space left on device (injected)")
    _ck.write_file = failing
ckpts.save(21, shared={"w": w}, local={"rank": rank}, background=True)
try:
    ckpts.latest()
    result["bg_error"] = None
except hpcsync.CheckpointError as exc:
    result["bg_error"] = str(exc)
_ck.write_file = real_write
result["after_bg_error"] = ckpts.latest()
ckpts.close()

# 2 of the 3 ranks load a 3-rank checkpoint: the same error on both
sub = MPI.COMM_WORLD.Split(0 if rank < 2 else MPI.UNDEFINED, rank)
if sub != MPI.COMM_NULL:
    try:
        hpcsync.Checkpoints("ckpt", group=sub).load()
        result["wrong_world"] = None
    except hpcsync.CheckpointError as exc:
        result["wrong_world"] = str(exc)
    sub.Free()
report(rank, result)
