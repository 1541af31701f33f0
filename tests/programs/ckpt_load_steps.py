"""Checkpoints.load(step=...) with steps drawn per case, some different on each rank:

    ckpt_load_steps.py ROOT CASES_JSON

CASES_JSON: a list of ``[step of rank 0, step of rank 1, ...]`` (JSON values; ``{"np": 8}``: a
numpy integer). Step 8 is saved first. Each rank reports, per case, the step loaded or the
error's type and words."""
import json
import sys

import numpy as np

import hpcsync
from _report import report

root, cases = sys.argv[1], json.loads(sys.argv[2])
topo = hpcsync.init(backend="gloo", timeout=60)
ckpts = hpcsync.Checkpoints(root, timeout=20)
ckpts.save(8, shared={"s": 8}, local={"r": topo.rank})
out = []
for case in cases:
    step = case[topo.rank]
    step = np.int64(step["np"]) if isinstance(step, dict) else step
    try:
        got = ckpts.load(step=step)
        out.append(["loaded", got.step, got.shared, got.local])
    except Exception as exc:
        out.append([type(exc).__name__, str(exc)])
report(topo.rank, {"rank": topo.rank, "world_size": topo.world_size, "out": out})
hpcsync.shutdown()
