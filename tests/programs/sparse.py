"""all_reduce of sparse COO tensors on the hpcsync backend: compared with the dense sum."""
import torch
import torch.distributed as dist

import hpcsync
from _report import report

topo = hpcsync.init(backend="hpcsync", timeout=60)
R, W = topo.rank, topo.world_size
out = {"rank": R, "world_size": W, "ok": []}
for dense_dims, dtype in (((), torch.float32), ((3,), torch.float64), ((), torch.int64)):
    g = torch.Generator().manual_seed(R)
    # rank r holds entries at rows r, r+1 (overlapping between neighbours) and none on the last rank
    idx = torch.tensor([[R, R + 1], [0, 2]]) if R < W - 1 else torch.zeros((2, 0), dtype=torch.int64)
    vals = (torch.rand((idx.shape[1], *dense_dims), generator=g) * 10).to(dtype)
    s = torch.sparse_coo_tensor(idx, vals, (W + 1, 4, *dense_dims))
    dense = s.to_dense()
    dist.all_reduce(dense)
    dist.all_reduce(s)
    out["ok"].append(bool(torch.equal(s.to_dense(), dense)) and s.is_sparse)
try:
    dist.all_reduce(torch.sparse_coo_tensor([[0]], [1.0], (2,)), op=dist.ReduceOp.MAX)
    out["max"] = "no error"
except Exception as exc:  # noqa: BLE001
    out["max"] = str(exc)
hpcsync.shutdown()
report(R, out)
