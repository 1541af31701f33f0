"""Benchmark: collective HDF5 output of ragged per-rank rows.

    python bench/bench_h5.py [--ranks 2 4] [--mb 1000] [--repeat 3] [--quick]

Every rank holds a different number of rows (rank r: proportional to r + 1; rows of 64 float32,
256 B), in total ``--mb`` MB. Compared on the same rows, one ``mpirun`` job per measurement (so
root peak memory is per method): hpcsync's ``CollectiveWriter`` on parallel HDF5 (``mpio``),
the same writer's gather-to-root fallback (``parallel=False``: what users get without parallel
h5py), and h5py ``driver="mpio"`` by hand (one dataset of the known total, one collective write
per rank: the limit). Time = open to close (inclusive), after ``sync``, best of ``--repeat``
rounds with the methods interleaved; root memory = peak RSS
growth on rank 0 during the write. Every file is checked (shape, each rank's rows in rank order).
Prints a table, writes ``bench/results/h5.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import mpirun_env, save_json

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["hpcsync-parallel", "hpcsync-gather-fallback", "h5py-mpio-by-hand"]
COLS = 64


def rows_of(rank: int, size: int, total_bytes: int) -> int:
    weights = [r + 1 for r in range(size)]
    return total_bytes // (COLS * 4) * weights[rank] // sum(weights)


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def worker(method: str, path: str, total_bytes: int) -> None:
    import numpy as np
    from mpi4py import MPI

    import h5py
    from hpcsync import h5

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    n = rows_of(rank, size, total_bytes)
    rows = np.empty((n, COLS), dtype=np.float32)
    rows[:] = np.arange(COLS, dtype=np.float32)
    rows[:, 0] = rank
    if rank == 0:
        os.sync()
    comm.Barrier()
    base = status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS to now
    t0 = time.perf_counter()
    if method == "h5py-mpio-by-hand":
        counts = comm.allgather(n)
        with h5py.File(path, "w", driver="mpio", comm=comm) as f:
            dset = f.create_dataset("rows", shape=(sum(counts), COLS), dtype=np.float32)
            lo = sum(counts[:rank])
            with dset.collective:
                dset[lo:lo + n] = rows
    else:
        with h5.CollectiveWriter(path, group=comm, parallel=method == "hpcsync-parallel") as w:
            w.write("rows", rows)
    comm.Barrier()
    seconds = time.perf_counter() - t0
    peak = status_kib("VmHWM")
    grow = comm.gather(max(0, peak - base) / 1024, root=0)
    if rank == 0:
        print(json.dumps({"seconds": seconds, "root_peak_growth_mib": grow[0], "max_rank_growth_mib": max(grow)}))


def check(path: str, ranks: int, total_bytes: int) -> None:
    import h5py
    import numpy as np

    counts = [rows_of(r, ranks, total_bytes) for r in range(ranks)]
    with h5py.File(path, "r") as f:
        d = f["rows"]
        assert d.shape == (sum(counts), COLS), d.shape
        lo = 0
        for r, n in enumerate(counts):
            for i in {lo, lo + n - 1}:
                assert d[i, 0] == r and d[i, 5] == 5, (r, i, d[i, :6])
            lo += n
        assert np.array_equal(d[-1, 1:], np.arange(1, COLS, dtype=np.float32))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mb", type=float, default=1000)
    ap.add_argument("--quick", action="store_true", help="CI smoke run: 2 ranks, 16 MB")
    ap.add_argument("--repeat", type=int, default=1, help="measure each cell this many times, keep the best")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "h5.json"))
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], int(args.worker[2]))
        return
    if args.quick:
        args.ranks, args.mb = [2], 16
    total = int(args.mb * 1e6)
    env = mpirun_env(PYTHONWARNINGS="ignore")
    rows = []
    with tempfile.TemporaryDirectory(prefix="hpcsync-h5bench-", dir=os.environ.get("BENCH_TMP")) as tmp:
        for ranks in args.ranks:
            best: dict = {}
            for _ in range(args.repeat):  # methods interleaved, so disk state hits each alike
                for method in METHODS:
                    path = os.path.join(tmp, f"{method}-{ranks}.h5")
                    cmd = ["mpirun.openmpi", "--oversubscribe", "--bind-to", "none", "-n", str(ranks),
                           sys.executable, __file__, "--worker", method, path, str(total)]
                    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
                    if proc.returncode != 0:
                        raise SystemExit(f"{method} on {ranks} ranks failed: {proc.stderr[-2000:]}")
                    got = json.loads(proc.stdout.strip().splitlines()[-1])
                    check(path, ranks, total)
                    os.unlink(path)
                    if method not in best or got["seconds"] < best[method]["seconds"]:
                        best[method] = got
            for method in METHODS:
                res = best[method]
                res.update(ranks=ranks, method=method, bytes=total, mb_per_s=total / 1e6 / res["seconds"])
                rows.append(res)
                print(f"  {ranks} ranks {total / 1e6:.0f} MB {method:24s} {res['mb_per_s']:8.1f} MB/s  "
                      f"root +{res['root_peak_growth_mib']:.0f} MiB", flush=True)
    print("\n| ranks | MB | method | MB/s | × by hand (limit) | × gather fallback | root peak growth MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        same = {x["method"]: x for x in rows if x["ranks"] == r["ranks"]}
        lim, fb = same["h5py-mpio-by-hand"], same["hpcsync-gather-fallback"]
        print(f"| {r['ranks']} | {r['bytes'] / 1e6:.0f} | {r['method']} | {r['mb_per_s']:.0f} | "
              f"{r['mb_per_s'] / lim['mb_per_s']:.2f} | {r['mb_per_s'] / fb['mb_per_s']:.2f} | "
              f"{r['root_peak_growth_mib']:.0f} |")
    save_json(args.out, "rows", rows)


if __name__ == "__main__":
    main()
