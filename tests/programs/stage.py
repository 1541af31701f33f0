"""hpcsync.stage(SRC, DST, **options) on every rank; report the result or the error.

Options: JSON in argv[3] or in $HPCSYNC_TEST_STAGE_OPTS (what crosses a namespace node's shell).
"""
import json
import os
import socket
import sys
from dataclasses import asdict

import hpcsync
from hpcsync import comm
from _report import report

src, dst = sys.argv[1], sys.argv[2]
opts = json.loads(sys.argv[3] if len(sys.argv) > 3 else os.environ.get("HPCSYNC_TEST_STAGE_OPTS", "{}"))
rank, size = comm.get_rank(), comm.get_world_size()
if rank == 1 and "_rank1" in opts:  # a rank that diverges
    opts.update(opts["_rank1"])
opts.pop("_rank1", None)
src, dst = opts.pop("src", src), opts.pop("dst", dst)
out = {"rank": rank, "world_size": size, "hostname": socket.gethostname(),
       "local_rank": comm.get_local_rank(), "node_rank": hpcsync.topology().node_rank}
try:
    out.update(ok=True, result=asdict(hpcsync.stage(src, dst, **opts)))
except Exception as exc:  # what a program that catches the error sees (a StageError, nothing else)
    out.update(ok=False, error=f"{type(exc).__name__}: {exc}")
report(rank, out)
sys.exit(0 if out["ok"] else 3)
