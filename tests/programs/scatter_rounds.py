"""BoundedComm.scatter in rounds: rank 0 sends each rank an object of its own size (one spans
several rounds, one is tiny, one is empty-ish), with rounds of ``ROUND`` bytes.

    scatter_rounds.py ROUND

Each rank reports whether it got exactly what rank 0 meant to send it, and its length.
"""
import sys

import hpcsync  # noqa: F401
from hpcsync.core import bounded
from hpcsync.core.topology import topology
from _report import report

topo = topology()
from mpi4py import MPI  # noqa: E402

ctl = bounded.control("scatter test", MPI.COMM_WORLD, 30)
sizes = [2500, 10, 0, 1500][:topo.world_size]
objs = [bytes((r * 31 + i) % 251 for i in range(n)) for r, n in enumerate(sizes)] if topo.rank == 0 else None
got = ctl.scatter(objs, root=0, round_bytes=int(sys.argv[1]))
want = bytes((topo.rank * 31 + i) % 251 for i in range(sizes[topo.rank]))
report(topo.rank, {"rank": topo.rank, "world_size": topo.world_size, "ok": got == want, "len": len(got)})
