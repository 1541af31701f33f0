"""Benchmark: gloo rendezvous through rank 0's TCPStore vs hpcsync's MPIStore (no listening port).

    python bench/bench_store.py [--ranks 2 4 8] [--repeats 5] [--quick]

Each run is one mpirun job that times ``hpcsync.init(backend="gloo", store=...)`` (slowest rank)
for both stores, alternating, ``--repeats`` times; prints the medians and writes
``bench/results/store.json``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import mpirun_env, save_json

ROOT = Path(__file__).resolve().parents[1]


def worker(repeats: int) -> None:
    import torch.distributed as dist
    from mpi4py import MPI

    import hpcsync

    comm = MPI.COMM_WORLD
    times = {"tcp": [], "mpi": []}
    for _ in range(repeats):
        for kind in ("tcp", "mpi"):
            comm.Barrier()
            t0 = time.perf_counter()
            hpcsync.init(backend="gloo", store=kind, timeout=120, abort_on_exception=False)
            dist.barrier()
            dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            hpcsync.shutdown()
            times[kind].append(dt)
    if comm.Get_rank() == 0:
        print(json.dumps({"world_size": comm.Get_size(), "times": times}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="CI smoke run: 2 ranks, 1 repeat")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "store.json"))
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return
    if args.quick:
        args.ranks, args.repeats = [2], 1
    env = mpirun_env(OMP_NUM_THREADS="1")
    rows = []
    print("| ranks | TCPStore init (median) | MPIStore init (median) | MPI / TCP |")
    print("|---|---|---|---|")
    for n in args.ranks:
        proc = subprocess.run(["mpirun.openmpi", "--oversubscribe", "--bind-to", "none", "-n", str(n), sys.executable,
                               __file__, "--worker", str(args.repeats)], env=env, stdout=subprocess.PIPE, text=True,
                              timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"benchmark job with {n} ranks failed (rc={proc.returncode})")
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        tcp, mpi = statistics.median(res["times"]["tcp"]), statistics.median(res["times"]["mpi"])
        rows.append({"ranks": n, "tcp_s": tcp, "mpi_s": mpi, "all": res["times"]})
        print(f"| {n} | {tcp * 1e3:.0f} ms | {mpi * 1e3:.0f} ms | {mpi / tcp:.2f} |", flush=True)
    save_json(args.out, "rows", rows)


if __name__ == "__main__":
    main()
