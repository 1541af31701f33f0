"""DDP with torch's PowerSGD communication hook on the hpcsync backend.

    powersgd.py STEPS

The hook's future callbacks issue and wait on further all_reduces: on the backend's worker
thread they must run at once (queued, they would wait for the worker they block), at the same
point on every rank. Reports a checksum of the weights (equal on every rank) and the loss.
"""
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP

import hpcsync
from _report import report

steps = int(sys.argv[1])
topo = hpcsync.init(backend="hpcsync", timeout=60)
R, W = topo.rank, topo.world_size
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                            torch.nn.Linear(64, 1))
ddp = DDP(model, bucket_cap_mb=0.004)  # several buckets: callbacks of one overlap the next bucket's issue
state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=3,
                           min_compression_rate=0.5, use_error_feedback=True, warm_start=True)
ddp.register_comm_hook(state, psgd.powerSGD_hook)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
g = torch.Generator().manual_seed(100 + R)
losses = []
for _ in range(steps):
    x = torch.randn(16, 32, generator=g)
    y = x.sum(dim=1, keepdim=True) * 0.1
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(ddp(x), y)
    loss.backward()
    opt.step()
    losses.append(loss.item())
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
every = [torch.zeros_like(flat) for _ in range(W)]
dist.all_gather(every, flat)
report(R, {"rank": R, "world_size": W, "same_weights": all(torch.equal(every[0], e) for e in every),
           "finite": bool(torch.isfinite(flat).all()), "first_loss": losses[0], "last_loss": losses[-1]})
