"""One job that exercises hpcsync across (namespace) nodes; every rank reports what it saw.

    multinode.py BACKEND WORKDIR NODE_LOCAL_DIR

Topology, the master address, init + all_reduce, a DDP run (final weights reported), sync_file
with gather, mpiio and a node-local parts_dir, and the HDF5 writer.
"""
import os
import socket
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import hpcsync
from hpcsync import comm, h5
from hpcsync.start.bootstrap import master_address
from _report import report

backend, work, node_local = sys.argv[1], sys.argv[2], sys.argv[3]
topo = hpcsync.topology()
out = {"rank": topo.rank, "world_size": topo.world_size, "topology": topo.as_dict(),
       "hostname": socket.gethostname(), "node_local_listing": sorted(os.listdir(node_local))}
choice = master_address(topo)
out["master"] = {"address": choice.address, "ifname": choice.ifname, "reason": choice.reason}

hpcsync.init(backend=backend, timeout=60)
t = torch.tensor([float(topo.rank + 1)])
dist.all_reduce(t)
out.update(backend=dist.get_backend(), allreduce=t.item(), env_master=os.environ.get("MASTER_ADDR"))

# DDP: the same seeds and per-rank data as a one-node run of the same program
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
ddp = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
g = torch.Generator().manual_seed(100 + topo.rank)
for _ in range(5):
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    opt.zero_grad()
    nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
out["weights"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()

# file sync: parts beside the target (shared filesystem) with both methods, then node-local parts
rows = "".join(f"{topo.rank},{i},{topo.hostname}\n" for i in range(topo.rank + 1))
for method in ("copy", "gather", "mpiio", "auto"):
    target = os.path.join(work, f"metrics-{method}.csv")
    with hpcsync.SyncedFile(target, strip_header=True, method=method) as part:
        with open(part.path, "w") as f:
            f.write("rank,i,host\n" + rows)
    out[f"sync_{method}"] = part.result.method
target = os.path.join(work, "metrics-nodelocal.csv")
with hpcsync.SyncedFile(target, strip_header=True, parts_dir=node_local) as part:  # auto must not copy
    out["nodelocal_part"] = part.path
    with open(part.path, "w") as f:
        f.write("rank,i,host\n" + rows)
    comm.synchronize()  # every rank has created its part
    out["nodelocal_visible_here"] = sorted(os.listdir(os.path.dirname(part.path)))
out["sync_nodelocal"] = part.result.method

# HDF5: ragged rows per rank
with h5.CollectiveWriter(os.path.join(work, "rows.h5")) as w:
    w.write("x", np.full((topo.rank + 1, 2), topo.rank, dtype=np.int32))
    out["h5_parallel"] = w.parallel

out["gathered_hosts"] = comm.all_gather(topo.hostname)
comm.create_local_process_group()  # detectron2's per-machine group, from MPI's real nodes
out["local_group_ranks"] = comm.all_gather(topo.rank, group=comm.get_local_process_group())
hpcsync.shutdown()
report(topo.rank, out)
