"""Benchmark: what ``guard.should_stop()`` adds to a training step, side by side in one job.

    python bench/bench_preemption.py [--ranks 2 4] [--steps 2000] [--step-us 0 1000 10000] [--jitter 0.2] [--quick]

One mpirun job per rank count; on every rank a loop of ``--steps`` steps, each a busy compute of
``--step-us`` microseconds stretched by up to ``--jitter`` of it at random (each rank its own: real
steps differ between ranks), run in rounds that alternate three variants: the bare loop,
``should_stop()`` every step (hpcsync's non-blocking ``Iallreduce`` completed at the next call),
and a blocking 8-byte ``Allreduce`` every step (a per-step agreement that makes every rank wait for
the slowest at every step). Prints the per-step overhead of each against the bare loop (median
of the rounds, slowest rank) and writes ``bench/results/preemption.json``.
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


def _busy(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def worker(steps: int, step_us: list, rounds: int, jitter: float) -> None:
    import random

    import numpy as np
    from mpi4py import MPI

    import hpcsync

    comm = MPI.COMM_WORLD
    flag, out = np.zeros(1, np.int64), np.zeros(1, np.int64)
    guard = hpcsync.preemption()
    rng = random.Random(comm.Get_rank())
    lengths = {}

    def bare(us):
        for t in lengths[us]:
            _busy(t)

    def guarded(us):
        for t in lengths[us]:
            _busy(t)
            if guard.should_stop():
                raise SystemExit("nobody sent a signal")

    def blocking(us):
        for t in lengths[us]:
            _busy(t)
            comm.Allreduce(flag, out, op=MPI.MAX)

    results = {}
    for us in step_us:
        lengths[us] = [us * (1 + jitter * rng.random()) for _ in range(steps)]  # the same in every variant
        times = {"bare": [], "should_stop": [], "blocking_allreduce": []}
        for _ in range(rounds):
            for name, fn in (("bare", bare), ("should_stop", guarded), ("blocking_allreduce", blocking)):
                comm.Barrier()
                t0 = time.perf_counter()
                fn(us)
                times[name].append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX) / steps)
        results[str(us)] = times
    guard.close()
    if comm.Get_rank() == 0:
        print(json.dumps({"world_size": comm.Get_size(), "results": results}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--step-us", type=float, nargs="+", default=[0, 1000, 10000])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--jitter", type=float, default=0.2, help="each step up to this fraction longer, per rank")
    ap.add_argument("--quick", action="store_true", help="CI smoke run: 2 ranks, 300 steps, 2 rounds")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "preemption.json"))
    args = ap.parse_args()
    if args.worker:
        worker(args.steps, args.step_us, args.rounds, args.jitter)
        return
    if args.quick:
        args.ranks, args.steps, args.step_us, args.rounds = [2], 300, [0, 1000], 2
    env = mpirun_env(OMP_NUM_THREADS="1")
    rows = []
    print("| ranks | step | bare step | should_stop() adds | blocking Allreduce adds | should_stop / step |")
    print("|---|---|---|---|---|---|")
    for n in args.ranks:
        cmd = ["mpirun.openmpi", "--oversubscribe", "--bind-to", "none", "-n", str(n), sys.executable, __file__,
               "--worker", "--steps", str(args.steps), "--rounds", str(args.rounds), "--jitter", str(args.jitter),
               "--step-us", *map(str, args.step_us)]
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"benchmark job with {n} ranks failed (rc={proc.returncode})")
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        for us, times in res["results"].items():
            med = {k: statistics.median(v) for k, v in times.items()}
            guard_us = (med["should_stop"] - med["bare"]) * 1e6
            block_us = (med["blocking_allreduce"] - med["bare"]) * 1e6
            bare_us = med["bare"] * 1e6
            rows.append({"ranks": n, "step_us": float(us), "bare_us": bare_us, "should_stop_us": guard_us,
                         "blocking_allreduce_us": block_us, "all": times})
            share = f"{guard_us / bare_us * 100:.2f} %" if bare_us >= 1 else "-"
            print(f"| {n} | {float(us):g} µs | {bare_us:.1f} µs | {guard_us:.1f} µs | {block_us:.1f} µs | {share} |",
                  flush=True)
    save_json(args.out, "rows", rows, steps=args.steps, rounds=args.rounds, jitter=args.jitter)


if __name__ == "__main__":
    main()
