"""Collective HDF5: ragged rows, a zero-row rank, two datasets, append twice, attributes."""
import sys

import numpy as np

from hpcsync import comm, h5
from _report import report

path, parallel = sys.argv[1], {"parallel": True, "fallback": False, "fallback-small-rounds": False, "auto": None}[sys.argv[2]]
# 40-byte gather rounds: 12- and 8-byte rows split between rounds on the fallback path
round_bytes = 40 if sys.argv[2] == "fallback-small-rounds" else 256 << 20
bad = len(sys.argv) > 3 and sys.argv[3] == "bad"
rank, size = comm.get_rank(), comm.get_world_size()
n = 0 if rank == 1 else rank + 2  # ragged, rank 1 has no rows
out = {"rank": rank, "world_size": size}
try:
    with h5.CollectiveWriter(path, parallel=parallel, round_bytes=round_bytes) as w:
        out["parallel"] = w.parallel
        feats = np.full((n, 3), rank, dtype=np.float32) + np.arange(n, dtype=np.float32)[:, None] / 100
        if bad and rank == size - 1:
            feats = np.zeros((n, 4), dtype=np.float32)
        out["block"] = w.write("feats", feats)
        w.write("ids", np.arange(n, dtype=np.int64) + 1000 * rank)
        out["block2"] = w.write("feats", feats[: max(0, n - 1)] * -1)  # append a second round
        w.attrs({"world_size": size, "note": "hpcsync"})
        w.attrs({"units": "m"}, dataset="feats")
except ValueError as exc:
    out["error"] = str(exc)
report(rank, out)
