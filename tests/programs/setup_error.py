"""hpcsync.init() given a bad argument or a malformed setting, the error left uncaught.

    setup_error.py BACKEND [NAME=VALUE | NAME=VALUE@last]...

Each NAME=VALUE is set on every rank before init, ``@last`` on the last rank only. A rank whose
init raised writes ``rank<N>.json`` with what it raised, then lets the exception escape (the
interpreter then exits non-zero); a rank whose init returned writes what it got and exits 0.
"""
import os
import sys

import hpcsync
from _report import report

rank = int(os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMI_RANK") or 0)
size = int(os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE") or 1)
backend = sys.argv[1]
for item in sys.argv[2:]:
    name, _, value = item.partition("=")
    if not value.endswith("@last") or rank == size - 1:
        os.environ[name] = value.removesuffix("@last")
try:
    topo = hpcsync.init(backend=backend, timeout=60)
except BaseException as exc:
    report(rank, {"rank": rank, "raised": type(exc).__name__, "value_error": isinstance(exc, ValueError)})
    raise
report(rank, {"rank": topo.rank, "world_size": topo.world_size, "raised": None})
hpcsync.shutdown()
