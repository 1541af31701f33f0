"""GPU checks (not run in CI: no GPU there). One program, run by tests/gpu/run.sh under mpirun.

mode "auto": hpcsync.init(backend="auto") must pick nccl when every local rank has a GPU, set the
device from the local rank, and move CUDA tensors (collectives, a DDP step, sync_file) correctly.
mode "hpcsync": the socket-free backend with CUDA tensors (staged through host memory): every
collective's result must be right and stay on the GPU; ranks may share one GPU here.
mode "cpu": the same program on CPU tensors with the hpcsync backend, so CI (tests/test_gpu_script.py)
keeps the script itself working on machines without a GPU.
Each rank prints one line "GPU-OK rank=.. backend=.. device=.." on success; any mismatch raises.
"""
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn

import hpcsync
from hpcsync import comm

mode = sys.argv[1]
store = sys.argv[2] if len(sys.argv) > 2 else "tcp"
topo = hpcsync.init(backend="hpcsync" if mode == "cpu" else mode, store=store, timeout=120)
rank, world = topo.rank, topo.world_size
if mode == "auto":
    assert dist.get_backend() == "nccl", f"auto picked {dist.get_backend()} with {torch.cuda.device_count()} GPUs"
    assert torch.cuda.current_device() == topo.local_rank % torch.cuda.device_count()
    dev = torch.device("cuda", torch.cuda.current_device())
elif mode == "cpu":
    dev = torch.device("cpu")
else:
    assert dist.get_backend() == "hpcsync"
    dev = torch.device("cuda", topo.local_rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)


def check(name, got, want):
    assert got.device == dev, f"{name}: result on {got.device}, expected {dev}"
    assert torch.equal(got.cpu(), want.cpu()), f"{name}: {got.cpu()} != {want.cpu()}"


for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64):
    for n in (3, 1 << 20):  # small (inline path) and 1 Mi elements (worker path)
        t = torch.full((n,), rank + 1, dtype=dtype, device=dev)
        dist.all_reduce(t)
        check(f"all_reduce {dtype} {n}", t, torch.full((n,), world * (world + 1) // 2, dtype=dtype))
        b = torch.full((n,), rank, dtype=dtype, device=dev)
        dist.broadcast(b, src=world - 1)
        check(f"broadcast {dtype} {n}", b, torch.full((n,), world - 1, dtype=dtype))
        out = torch.empty(world * n, dtype=dtype, device=dev)
        dist.all_gather_into_tensor(out, torch.full((n,), rank, dtype=dtype, device=dev))
        check(f"all_gather {dtype} {n}", out, torch.arange(world, dtype=dtype).repeat_interleave(n))
        rs = torch.empty(n, dtype=dtype, device=dev)
        dist.reduce_scatter_tensor(rs, torch.ones(world * n, dtype=dtype, device=dev))
        check(f"reduce_scatter {dtype} {n}", rs, torch.full((n,), world, dtype=dtype))

# DDP: the gradient DDP averages on the GPU equals the mean of the ranks' local gradients
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).to(dev)
local = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).to(dev)
local.load_state_dict(model.state_dict())
ddp = nn.parallel.DistributedDataParallel(model, device_ids=None if dev.type == "cpu" else [dev.index])
x = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank)).to(dev)
ddp(x).square().mean().backward()
local(x).square().mean().backward()
want = torch.stack(comm.all_gather(local[0].weight.grad.cpu())).mean(0)
got = model[0].weight.grad
assert got.device == dev and torch.allclose(got.cpu(), want, atol=1e-5), "DDP gradient is not the ranks' mean"

# the comm helpers and file sync keep working beside the GPU group
assert comm.all_gather(rank) == list(range(world))
out_dir = comm.all_gather(os.environ.get("HPCSYNC_GPU_OUT") or tempfile.mkdtemp())[0]
path = os.path.join(out_dir, f"gpu-{mode}-{store}.csv")
with hpcsync.SyncedFile(path, strip_header=True) as part, part.open() as f:
    f.write(f"rank,value\n{rank},{world * (world + 1) // 2}\n")
if rank == 0:
    lines = open(path).read().splitlines()
    assert lines == ["rank,value"] + [f"{r},{world * (world + 1) // 2}" for r in range(world)], lines
print(f"GPU-OK rank={rank} world={world} backend={dist.get_backend()} device={dev} "
      f"gpus={torch.cuda.device_count()} name={torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}", flush=True)
hpcsync.shutdown()
