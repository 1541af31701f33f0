"""Sync the same target again and again (metrics every epoch), then two targets at once.

    repeat_sync.py WORKDIR ITERATIONS

Rank 0 checks every merged file; every rank reports the first failure it saw.
"""
import os
import sys

import hpcsync
from hpcsync import comm
from _report import report

work, iterations = sys.argv[1], int(sys.argv[2])
rank, size = comm.get_rank(), comm.get_world_size()
target = os.path.join(work, "f.csv")
bad = None
for it in range(iterations):
    with hpcsync.SyncedFile(target, strip_header=True) as part:
        with open(part.path, "w") as f:
            f.write(f"epoch,rank\n{it},{rank}\n")
    if rank == 0 and bad is None:
        with open(target) as f:
            got = f.read()
        if got != "epoch,rank\n" + "".join(f"{it},{r}\n" for r in range(size)):
            bad = f"iteration {it}: {got!r}"
# two targets with one basename, one parts_dir, open at the same time
shared = os.path.join(work, "parts")
a, b = os.path.join(work, "a", "m.csv"), os.path.join(work, "b", "m.csv")
os.makedirs(os.path.dirname(a), exist_ok=True)
os.makedirs(os.path.dirname(b), exist_ok=True)
for it in range(20):
    with hpcsync.SyncedFile(a, parts_dir=shared) as pa, hpcsync.SyncedFile(b, parts_dir=shared) as pb:
        with open(pa.path, "w") as f:
            f.write(f"a{it}r{rank}\n")
        with open(pb.path, "w") as f:
            f.write(f"b{it}r{rank}\n")
    if rank == 0 and bad is None:
        for name, path in (("a", a), ("b", b)):
            with open(path) as f:
                got = f.read()
            if got != "".join(f"{name}{it}r{r}\n" for r in range(size)):
                bad = f"two targets, iteration {it}, {name}: {got!r}"
report(rank, {"rank": rank, "world_size": size, "bad": bad, "left": sorted(os.listdir(work))})
