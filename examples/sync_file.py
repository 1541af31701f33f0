"""The file sync alone: every rank writes its own CSV part, rank 0 ends up with one file.

    mpiexec -n 4 python examples/sync_file.py out/metrics.csv
"""
import csv
import sys

import hpcsync

target = sys.argv[1] if len(sys.argv) > 1 else "metrics.csv"
rank = hpcsync.get_rank()  # from MPI; no torch needed

with hpcsync.SyncedFile(target, strip_header=True) as part:  # joined on exit, in rank order
    with part.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["rank", "step", "value"])
        for step in range(3):
            writer.writerow([rank, step, rank * 10 + step])

if hpcsync.is_main_process():
    print(f"{target}: {part.result.bytes} bytes from {part.result.ranks} rank(s) via {part.result.method}")
