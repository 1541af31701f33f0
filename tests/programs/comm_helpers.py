"""Every detectron2-style helper, with or without torch.distributed (argv[1] == 'torch')."""
import sys

import numpy as np

import hpcsync
from hpcsync import comm
from _report import report

with_torch = len(sys.argv) > 1 and sys.argv[1] == "torch"
if with_torch:
    import torch

    hpcsync.init(backend="gloo", timeout=60)
rank, size = comm.get_rank(), comm.get_world_size()
comm.synchronize()
payload = {"rank": rank, "blob": "x" * (rank * 1000), "arr": np.arange(rank + 1)}
gathered_all = comm.all_gather(payload)
gathered = comm.gather(payload, dst=size - 1)
seed = comm.shared_random_seed()
seeds = comm.all_gather(seed)
obj = comm.broadcast_object({"from": rank, "big": list(range(10))} if rank == 0 else None)
values = {"loss": float(rank), "acc": np.array([rank, 2.0 * rank])}
if with_torch:
    values["t"] = torch.tensor(float(rank + 1))
reduced = comm.reduce_dict(values, average=True)
key_error = None
try:
    comm.reduce_dict({"only_on_%d" % (rank % 2): 1.0} if size > 1 else {})
except ValueError as exc:
    key_error = str(exc)
report(rank, {
    "rank": rank, "world_size": size, "local_rank": comm.get_local_rank(), "local_size": comm.get_local_size(),
    "main": comm.is_main_process(),
    "all_gather_ranks": [g["rank"] for g in gathered_all],
    "all_gather_ok": all(g["blob"] == "x" * (g["rank"] * 1000) and list(g["arr"]) == list(range(g["rank"] + 1))
                         for g in gathered_all),
    "gather_ranks": [g["rank"] for g in gathered],
    "seed_same": len(set(seeds)) == 1, "seed": seed,
    "bcast": obj,
    "reduced": {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in reduced.items()},
    "reduced_t_is_tensor": type(reduced.get("t")).__name__,
    "key_error": key_error,
})
