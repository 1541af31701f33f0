"""An FSDP2 model trained with sharded hpcsync.Checkpoints.

    sharded_ckpt.py BACKEND ROOT STEPS SAVE_EVERY MODE

MODE: ``sync`` or ``background`` (how each save is written), ``resume`` (load the latest first,
then train on to STEPS, saving as before), ``full`` (load the latest into a fresh model and report
its full parameters, at whatever world size this job has); bad input, each reported as the error
every rank got: ``perrank`` (a plain tensor that differs between ranks), ``partial`` (a template
without the optimizer's state), ``stateful`` (a Stateful whose state_dict() raises on rank 1);
``bgfail`` (rank 1's thread fails in the first of three background saves). Each rank reports the full parameters at
the end (``params``), the steps it trained, and what load() gave it. ``HPCSYNC_TEST_OWN_CWD=1``:
each rank works in a folder of its own (a relative ROOT differs per rank).
"""
import os
import sys
import time

import torch
from torch import nn

import hpcsync
from _report import report

backend, root, steps, every, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
topo = hpcsync.init(backend=backend, timeout=120)
R, W = topo.rank, topo.world_size
if os.environ.get("HPCSYNC_TEST_OWN_CWD"):  # a relative ROOT is then a different folder on every rank
    own = os.path.join(os.environ["HPCSYNC_TEST_OUT"], f"cwd{R}")
    os.makedirs(own, exist_ok=True)
    os.chdir(own)

from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

torch.manual_seed(1)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
mesh = init_device_mesh("cpu", (W,))
for layer in model:
    if isinstance(layer, nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.Adam(model.parameters(), lr=0.01)


def full_params():
    sd = model.state_dict()
    return {k: v.full_tensor().reshape(-1).tolist() for k, v in sorted(sd.items())}


def state():
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


out = {"rank": R, "world_size": W, "mode": mode}
options = {}
if os.environ.get("HPCSYNC_TEST_LOCAL_DIR"):  # node-local copies; FAKE_NODES=k: k ranks a "node" on this host
    local_dir, per = os.environ["HPCSYNC_TEST_LOCAL_DIR"], int(os.environ.get("HPCSYNC_TEST_FAKE_NODES", "0"))
    if per:
        import socket

        socket.gethostname = lambda: f"fake{R // per}"
        local_dir = os.path.join(local_dir, f"fake{R // per}")
    options = {"local_dir": local_dir, "replicas": int(os.environ.get("HPCSYNC_TEST_REPLICAS", "1")),
               "shared_every": int(os.environ.get("HPCSYNC_TEST_SHARED_EVERY", "0"))}
ckpts = hpcsync.Checkpoints(root, keep=2, **options)
start = 0
if mode in ("perrank", "partial", "stateful"):  # bad input: the same error on every rank, no hang
    from torch.distributed.checkpoint.stateful import Stateful

    class Failing(Stateful):
        def state_dict(self):
            if R == 1:
                raise RuntimeError("injected on rank 1")
            return {"x": torch.zeros(1)}

        def load_state_dict(self, sd):
            pass

    t0 = time.monotonic()
    try:
        if mode == "partial":  # a template without the optimizer's state
            ckpts.save(1, sharded=state())
            ckpts.load(sharded={"model": state()["model"]})
        else:
            ckpts.save(1, sharded={**state(), **({"mine": torch.tensor([R])} if mode == "perrank" else
                                                 {"extra": Failing()})})
    except hpcsync.CheckpointError as exc:
        out["error"] = str(exc)
    out["seconds"] = time.monotonic() - t0
    report(R, out)
    hpcsync.shutdown()
    sys.exit(0)
if mode == "bgfail":  # rank 1's thread fails in the first background save only
    import threading

    import torch.distributed.checkpoint as dcp

    real_save, failed = dcp.save, []

    def save_once_failing(*args, **kwargs):
        if R == 1 and not failed and threading.current_thread().name.startswith("hpcsync-checkpoint"):
            failed.append(1)
            raise OSError("No space left on device (injected on rank 1)")
        return real_save(*args, **kwargs)

    dcp.save = save_once_failing
    ckpts = hpcsync.Checkpoints(root, keep=2, timeout=8)  # rank 0's DCP exchange waits this long for rank 1
    errors = []
    for step in (1, 2, 3):
        try:
            ckpts.save(step, sharded=state(), background=True)
            ckpts.wait()
        except hpcsync.CheckpointError as exc:
            errors.append([step, str(exc)])
    out["errors"], out["latest"] = errors, ckpts.latest()
    report(R, out)
    hpcsync.shutdown()
    sys.exit(0)
if mode in ("resume", "full"):
    template = state()
    try:
        got = ckpts.load(sharded=template)
    except hpcsync.CheckpointError as exc:
        out["error"] = str(exc)
        report(R, out)
        hpcsync.shutdown()
        sys.exit(0)
    set_state_dict(model, opt, model_state_dict=template["model"], optim_state_dict=template["optim"])
    out["loaded"] = {"step": got.step, "shared": got.shared, "local": got.local is not None and {
        "rank": got.local["rank"], "step": got.local["step"]}, **({"read": got.read} if got.read else {})}
    if mode == "full":
        out["params"] = full_params()
        report(R, out)
        hpcsync.shutdown()
        sys.exit(0)
    start = got.step
    torch.set_rng_state(got.local["rng"])

for step in range(start + 1, steps + 1):
    g = torch.Generator().manual_seed(step * 100 + R)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    x = x + 0.01 * torch.rand(16, 8)  # this rank's RNG stream: resumed exactly only from its local state
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    if step % every == 0:
        try:
            ckpts.save(step, shared={"every": every}, local={"rank": R, "step": step, "rng": torch.get_rng_state()},
                       sharded=state(), background=mode == "background")
        except hpcsync.CheckpointError as exc:  # the same on every rank
            out["error"] = str(exc)
            break
ckpts.close()
out["params"] = full_params()
out["trained"] = [start + 1, steps]
out["listing"] = sorted(os.listdir(root)) if R == 0 and os.path.isdir(root) else None
report(R, out)
hpcsync.shutdown()
