"""hpcsync.init(BACKEND) on nodes whose interfaces are named differently; every pair of ranks talks.

    interfaces.py BACKEND [HOST=IFACE]

``HOST=IFACE``: the ranks on node HOST export ``GLOO_SOCKET_IFNAME=IFACE`` themselves before
init (a user's per-node setting). Each rank reports the interface its backend was given, the
master address, an all_reduce and an all_to_all across every pair, or the error and how long it took.
"""
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

import hpcsync
from hpcsync.topology import topology
from _report import report

backend = sys.argv[1]
for spec in sys.argv[2:]:
    host, iface = spec.split("=", 1)
    if socket.gethostname() == host:
        os.environ["GLOO_SOCKET_IFNAME"] = iface
topo = topology()
out = {"rank": topo.rank, "world_size": topo.world_size, "hostname": socket.gethostname()}
t0 = time.monotonic()
try:
    hpcsync.init(backend=backend, timeout=40)
    out["gloo_ifname"] = os.environ.get("GLOO_SOCKET_IFNAME")
    out["nccl_ifname"] = os.environ.get("NCCL_SOCKET_IFNAME")
    out["master"] = hpcsync.bootstrap._state["master"].address if hpcsync.bootstrap._state.get("master") else None
    x = torch.tensor([float(topo.rank + 1)])
    dist.all_reduce(x)
    out["allreduce"] = x.item()
    send = torch.arange(topo.world_size, dtype=torch.float32) + 100 * topo.rank
    recv = torch.empty(topo.world_size)
    dist.all_to_all_single(recv, send)
    out["all_to_all"] = recv.tolist()
    hpcsync.shutdown()
except hpcsync.HpcsyncError as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
out["seconds"] = time.monotonic() - t0
report(topo.rank, out)
