"""hpcsync.init() + an allreduce; report what torch and the environment say."""
import os
import sys

import torch
import torch.distributed as dist

import hpcsync
from _report import report

backend = sys.argv[1] if len(sys.argv) > 1 else "auto"
init_method = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "-" else None
topo = hpcsync.init(backend=backend, init_method=init_method, timeout=60)
again = hpcsync.init(backend=backend)  # idempotent
t = torch.tensor([float(topo.rank + 1)])
dist.all_reduce(t)
data = {
    "rank": dist.get_rank(), "world_size": dist.get_world_size(), "backend": dist.get_backend(),
    "allreduce": t.item(), "same_topology": again is topo,
    "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                            "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")},
    "topology": topo.as_dict(),
}
hpcsync.shutdown()
data["after_shutdown"] = dist.is_initialized()
report(topo.rank, data)
