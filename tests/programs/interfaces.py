"""hpcsync.init(BACKEND) on nodes whose interfaces are named differently; every pair of ranks talks.

    interfaces.py BACKEND [HOST=IFACE] [fault=raise|emfile] [timeout=SECONDS]

``HOST=IFACE``: the ranks on node HOST export ``GLOO_SOCKET_IFNAME=IFACE`` themselves before
init (a user's per-node setting). ``fault``: rank 0 alone fails in the proof of every pair of
nodes -- ``raise``: an exception before its first exchange; ``emfile``: its open-files limit is set a
little above the descriptors it holds and every free one but one is taken, so the connection
test's sockets fail with EMFILE.
``timeout``: init's (default 40 s). Each rank reports the interface its backend was given, the
master address, an all_reduce and an all_to_all across every pair, or the error and how long it took.
"""
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

import hpcsync
from hpcsync.core.topology import topology
from _report import report

backend, options = sys.argv[1], {}
for spec in sys.argv[2:]:
    host, iface = spec.split("=", 1)
    if host in ("fault", "timeout"):
        options[host] = iface
    elif socket.gethostname() == host:
        os.environ["GLOO_SOCKET_IFNAME"] = iface
topo = topology()
if topo.rank == 0 and options.get("fault"):
    import errno
    import resource

    import hpcsync.start.interfaces as ifs

    real_listener, real_reach = ifs.open_listener, ifs.reach_all

    def failing_listener(*args, **kwargs):
        raise RuntimeError("injected on rank 0")

    def reach_without_files(*args, **kwargs):
        # Every descriptor below the limit is taken, then one is given back (for the selector): a
        # count of /proc/self/fd is not enough: a descriptor numbered above the count, or one that
        # another thread (the acceptor) holds for a moment while counting, leaves room for more sockets.
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        fillers = []
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(int(fd) for fd in os.listdir("/proc/self/fd")) + 8, hard))
            try:
                while True:
                    fillers.append(os.open(os.devnull, os.O_RDONLY))
            except OSError as exc:
                if exc.errno != errno.EMFILE:
                    raise
            os.close(fillers.pop())
            return real_reach(*args, **kwargs)
        finally:
            for fd in fillers:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    if options["fault"] == "raise":
        ifs.open_listener = failing_listener
    else:
        ifs.reach_all = reach_without_files
out = {"rank": topo.rank, "world_size": topo.world_size, "hostname": socket.gethostname()}
t0 = time.monotonic()
try:
    hpcsync.init(backend=backend, timeout=float(options.get("timeout", 40)))
    out["gloo_ifname"] = os.environ.get("GLOO_SOCKET_IFNAME")
    out["nccl_ifname"] = os.environ.get("NCCL_SOCKET_IFNAME")
    out["master"] = hpcsync.start.bootstrap._state["master"].address if hpcsync.start.bootstrap._state.get("master") else None
    x = torch.tensor([float(topo.rank + 1)])
    dist.all_reduce(x)
    out["allreduce"] = x.item()
    send = torch.arange(topo.world_size, dtype=torch.float32) + 100 * topo.rank
    recv = torch.empty(topo.world_size)
    dist.all_to_all_single(recv, send)
    out["all_to_all"] = recv.tolist()
    hpcsync.shutdown()
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
    if not isinstance(exc, hpcsync.HpcsyncError) or options.get("fault"):
        out["seconds"] = time.monotonic() - t0
        report(topo.rank, out)
        raise
out["seconds"] = time.monotonic() - t0
report(topo.rank, out)
