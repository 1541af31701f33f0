"""Plain init_process_group after `import hpcsync`, real asynchrony, errors surfacing as exceptions."""
import time

import torch
import torch.distributed as dist

import hpcsync  # noqa: F401  registers the "hpcsync" backend and the hpcsync:// rendezvous
from _report import report

dist.init_process_group("hpcsync", init_method="hpcsync://")
R, W = dist.get_rank(), dist.get_world_size()
out = {"rank": R, "world_size": W, "backend": dist.get_backend()}

# async: rank 0 issues the all-reduce while the others arrive 1.5 s later
x = torch.ones(1 << 20)
if R != 0:
    time.sleep(1.5)
t0 = time.perf_counter()
work = dist.all_reduce(x, async_op=True)
out["issue_seconds"] = time.perf_counter() - t0
out["completed_right_after_issue"] = work.is_completed()
y = torch.full((4,), 2.0)
torch.mm(torch.randn(200, 200), torch.randn(200, 200))  # compute while the all-reduce is in flight
work.wait()
out["async_result_ok"] = bool(torch.all(x == W))
fut = dist.all_reduce(y, async_op=True).get_future().then(lambda f: f.value()[0] * 10)
out["future_chain"] = fut.wait().tolist()

# a local error surfaces as an exception on every rank, and the group keeps working afterwards
try:
    dist.all_gather_into_tensor(torch.zeros(W * 3 + 1), torch.zeros(3))
    out["error"] = None
except Exception as exc:  # noqa: BLE001
    out["error"] = f"{type(exc).__name__}: {exc}"
z = torch.tensor([float(R)])
dist.all_reduce(z)
out["after_error"] = z.item()
dist.destroy_process_group()
report(R, out)
