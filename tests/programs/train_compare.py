"""Train with DDP variants, FSDP and save/load a distributed checkpoint on one backend.

    train_compare.py BACKEND CHECKPOINT_DIR

The test runs it on gloo and on hpcsync and compares the final weights.
"""
import sys

import torch
import torch.distributed as dist
from torch import nn

import hpcsync
from _report import report

backend, ckpt_dir = sys.argv[1], sys.argv[2]
topo = hpcsync.init(backend=backend, timeout=120)
R, W = topo.rank, topo.world_size
torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)
        self.unused = nn.Linear(4, 4)  # never used in forward: find_unused_parameters matters

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def batches(steps, seed):
    g = torch.Generator().manual_seed(seed * 1000 + R)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)) for _ in range(steps)]


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def train_ddp(**ddp_kwargs):
    torch.manual_seed(1)
    net = Net()
    model = nn.parallel.DistributedDataParallel(net, **ddp_kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in batches(6, 1):
        opt.zero_grad(set_to_none=False)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return flat(net)


def train_no_sync():
    torch.manual_seed(1)
    net = Net()
    model = nn.parallel.DistributedDataParallel(net, find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = batches(6, 2)
    for i in range(0, len(data), 2):
        opt.zero_grad()
        with model.no_sync():  # accumulate locally, then one synchronised step
            x, y = data[i]
            nn.functional.mse_loss(model(x), y).backward()
        x, y = data[i + 1]
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return flat(net)


out = {"rank": R, "world_size": W, "backend": dist.get_backend()}
out["ddp_default"] = train_ddp(find_unused_parameters=True)
out["ddp_bucket_view"] = train_ddp(gradient_as_bucket_view=True, find_unused_parameters=True)
out["ddp_static_graph"] = train_ddp(static_graph=True)
out["ddp_small_buckets"] = train_ddp(bucket_cap_mb=0.0001, find_unused_parameters=True)  # many async buckets
out["ddp_no_sync"] = train_no_sync()

# FSDP2 (fully_shard) on CPU
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

torch.manual_seed(1)
fnet = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
mesh = init_device_mesh("cpu", (W,))
for layer in fnet:
    if isinstance(layer, nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(fnet, mesh=mesh)
fopt = torch.optim.Adam(fnet.parameters(), lr=0.01)
for x, y in batches(5, 3):
    fopt.zero_grad()
    nn.functional.mse_loss(fnet(x), y).backward()
    fopt.step()
full = {k: v.full_tensor() for k, v in fnet.state_dict().items()}
out["fsdp"] = torch.cat([full[k].reshape(-1) for k in sorted(full)]).tolist()

# Distributed checkpoint of the sharded model: save, perturb, load back
import torch.distributed.checkpoint as dcp  # noqa: E402

sd = {"model": fnet.state_dict()}
dcp.save(sd, checkpoint_id=ckpt_dir)
with torch.no_grad():
    for p in fnet.parameters():
        p.add_(1.0)
sd2 = {"model": fnet.state_dict()}
dcp.load(sd2, checkpoint_id=ckpt_dir)
fnet.load_state_dict(sd2["model"])
reloaded = {k: v.full_tensor() for k, v in fnet.state_dict().items()}
out["dcp_roundtrip"] = all(torch.equal(reloaded[k], full[k]) for k in full)

# async_save, thread mode: on the default group (the main thread waits), then on a group of its
# own while the main thread keeps training on the default group
fut = dcp.async_save({"model": fnet.state_dict()}, checkpoint_id=ckpt_dir + "-async")
fut.result()
ckpt_group = dist.new_group()
saved = {k: v.full_tensor().clone() for k, v in fnet.state_dict().items()}
fut = dcp.async_save({"model": fnet.state_dict()}, checkpoint_id=ckpt_dir + "-async2", process_group=ckpt_group)
for x, y in batches(3, 5):
    fopt.zero_grad()
    nn.functional.mse_loss(fnet(x), y).backward()
    fopt.step()
fut.result()
sd3 = {"model": fnet.state_dict()}
dcp.load(sd3, checkpoint_id=ckpt_dir + "-async2")
fnet.load_state_dict(sd3["model"])
back = {k: v.full_tensor() for k, v in fnet.state_dict().items()}
out["dcp_async"] = all(torch.equal(back[k], saved[k]) for k in saved)
report(R, out)
hpcsync.shutdown()
