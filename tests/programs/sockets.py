"""Count the TCP sockets this rank listens on, from /proc, around a short DDP run."""
import os
import sys

from _report import report


def listening_ports():
    """Ports of LISTEN-state TCP sockets whose inode is one of this process's fds."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A = TCP_LISTEN
                    ports.append(int(cols[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


from mpi4py import MPI  # noqa: E402, F401  the MPI runtime's own sockets, counted separately

after_mpi = listening_ports()
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import hpcsync  # noqa: E402

import time  # noqa: E402

t0 = time.perf_counter()
topo = hpcsync.init(backend=sys.argv[1], timeout=60, store=sys.argv[2] if len(sys.argv) > 2 else None)
init_s = time.perf_counter() - t0
model = nn.parallel.DistributedDataParallel(nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
during = []
for _ in range(5):
    opt.zero_grad()
    model(torch.randn(8, 32)).sum().backward()
    opt.step()
    during.extend(listening_ports())
report(topo.rank, {"rank": topo.rank, "world_size": topo.world_size, "backend": dist.get_backend(), "init_s": init_s,
                   "mpi_runtime": after_mpi, "during_training": sorted(set(during)),
                   "master_port": os.environ.get("MASTER_PORT")})
hpcsync.shutdown()
