"""Object gather past 2 GiB: the last rank sends > 2 GiB on its own (per-rank and total)."""
import hashlib
import sys

import hpcsync  # noqa: F401  (as a user program does; registers the backend if torch is loaded)
from hpcsync import comm
from _report import report

per_rank = int(sys.argv[1])
rank, size = comm.get_rank(), comm.get_world_size()
n = per_rank if rank == size - 1 else 1000 + rank
blob = bytearray(n)
blob[::4096] = bytes([(rank + 7) % 256]) * len(blob[::4096])
digest = hashlib.sha1(blob).hexdigest()
mode = sys.argv[2] if len(sys.argv) > 2 else "gather"
if mode == "gather":
    got = comm.gather(blob, dst=0)
else:
    got = comm.all_gather(blob)
del blob
info = [(len(g), hashlib.sha1(g).hexdigest()) for g in got]
digests = comm.all_gather((n, digest))
report(rank, {"rank": rank, "world_size": size, "received": info, "expected": digests})
