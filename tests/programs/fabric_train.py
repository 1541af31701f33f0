"""lightning.Fabric on hpcsync under mpirun: setup, a DistributedSampler, backward, all_reduce."""
import sys

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hpcsync
import hpcsync.resilience.lightning as hl
from _report import report

fabric = L.Fabric(**hl.fabric_kwargs(backend=sys.argv[1]))
fabric.launch()
torch.manual_seed(0)
x = torch.randn(512, 4)
y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
loader = fabric.setup_dataloaders(DataLoader(TensorDataset(x, y), batch_size=32))
losses = []
for _ in range(4):
    for xb, yb in loader:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(xb), yb)
        fabric.backward(loss)
        opt.step()
        losses.append(loss.item())
total = fabric.all_reduce(torch.tensor(float(len(losses))), reduce_op="sum")
weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
report(fabric.global_rank, {"rank": fabric.global_rank, "world_size": fabric.world_size,
                            "backend": dist.get_backend(), "first": sum(losses[:8]) / 8, "last": sum(losses[-8:]) / 8,
                            "weights": weights, "steps": len(losses), "steps_all_ranks": total.item()})
del model, opt, loader, fabric
hpcsync.shutdown()  # what a user's script should end with (atexit does it too)
