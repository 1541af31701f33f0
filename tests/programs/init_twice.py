"""A second hpcsync.init(): the same topology when it asks for nothing else (the defaults, or the
backend the first one started), a ValueError naming what differs when it does.

    init_twice.py [uncaught]

``uncaught``: the second init asks for another backend and its error escapes.
"""
import datetime
import sys

import torch.distributed as dist

import hpcsync
from _report import report

topo = hpcsync.init(timeout=60)
started = dist.get_backend()
if sys.argv[1:] == ["uncaught"]:
    hpcsync.init(backend="gloo" if started != "gloo" else "hpcsync")
out = {"rank": topo.rank, "world_size": topo.world_size, "started": started, "same": hpcsync.init() is topo,
       "same_backend_named": hpcsync.init(backend=started, timeout=60) is topo,
       "same_spelled_otherwise": hpcsync.init(timeout=datetime.timedelta(seconds=60)) is topo, "errors": {}}
other = "gloo" if started != "gloo" else "hpcsync"
for name, kwargs in (("backend", {"backend": other}), ("timeout", {"timeout": 5}), ("store", {"store": "mpi"}),
                       ("master_port", {"master_port": 1234})):
    try:
        hpcsync.init(**kwargs)
        out["errors"][name] = None
    except ValueError as exc:
        out["errors"][name] = str(exc)
out["still"] = dist.is_initialized() and dist.get_backend() == started
hpcsync.shutdown()
report(topo.rank, out)
