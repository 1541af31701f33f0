"""Checkpoints.save() given steps that are no step, or that differ between the ranks.

    ckpt_steps.py ROOT

After one good save (step 1), each case below calls save() on every rank and records, per case,
what it returned or the error it raised (``[type, text]``), and the root's listing after it (rank
0; a bad step must write nothing). Then two integer scalars (numpy's, torch's) that must save as
their int, and what load() and latest() give at the end.
"""
import os
import sys

import numpy as np
import torch

import hpcsync
from _report import report

root = sys.argv[1]
topo = hpcsync.init()
rank, size = topo.rank, topo.world_size
ckpts = hpcsync.Checkpoints(root, keep=10)
ckpts.save(1, shared={"w": 1}, local={"rank": rank})

# name: (this rank's step, save's keyword arguments)
CASES = {
    "negative": (-3, {}),
    "text": ("five", {}),
    "bool": (True, {}),
    "float": (2.0, {}),
    "numpy_bool": (np.bool_(True), {}),
    "differ": (5 + rank, {}),  # rank 0 says 5, rank 1 says 6, ...
    "one_text": ("x" if rank == size - 1 else 7, {}),  # only the last rank's is bad
    "one_negative_rank0": (-1 if rank == 0 else 7, {}),
    "differ_background": (9 + rank, {"background": True}),
    "differ_sharded": (11 + rank, {"sharded": {"v": torch.zeros(4)}}),
    "negative_sharded": (-2, {"sharded": {"v": torch.zeros(4)}}),
    "sharded_on_rank0": (13, {"sharded": {"v": torch.zeros(4)}} if rank == 0 else {}),  # (one form each)
}
out = {"rank": rank, "world_size": size, "cases": {}}
for name, (step, kwargs) in CASES.items():
    try:
        got = ckpts.save(step, shared={"w": name}, local={"rank": rank}, **kwargs)
        ckpts.wait()
        said = ["ok", os.path.basename(got)]
    except Exception as exc:
        said = [type(exc).__name__, str(exc)]
    out["cases"][name] = {"said": said, "listing": sorted(os.listdir(root)) if rank == 0 else None}

# integer scalars are steps: saved under their int
for name, step in (("numpy", np.int64(4)), ("torch", torch.tensor(6))):
    try:
        said = ["ok", os.path.basename(ckpts.save(step, shared={"w": name}, local={"rank": rank}))]
    except Exception as exc:
        said = [type(exc).__name__, str(exc)]
    out["cases"][name] = {"said": said}
try:
    got = ckpts.load()
    out["loaded"] = [got.step, type(got.step).__name__, got.shared["w"], got.local["rank"]]
    out["latest"] = ckpts.latest()
except Exception as exc:
    out["loaded"] = out["latest"] = [type(exc).__name__, str(exc)]
out["final_listing"] = sorted(os.listdir(root)) if rank == 0 else None
ckpts.close()
report(rank, out)
