"""Benchmark: what ``mon.step()`` (hpcsync.monitor) adds to a training step, side by side in one job.

    python bench/bench_monitor.py [--ranks 2] [--backends hpcsync gloo] [--steps 1000] [--step-us 5000]
                                  [--rounds 5] [--jitter 0.1] [--quick]

One mpirun job per rank count and backend; on every rank a loop of ``--steps`` steps, each a busy
compute of ``--step-us`` microseconds stretched by up to ``--jitter`` of it at random (the same
lengths in every variant) and a 16-float all_reduce, run in rounds that alternate three variants:
the bare loop, ``mon.step()`` every step, and ``mon.step()`` with two sections (``data`` around
the compute, ``comm`` around the all_reduce). The monitor runs with its defaults (a window of 50
steps: an ``Igather`` and an ``Iallreduce`` posted per window, tested at every step, rank 0
judging each window). Prints, per variant, the step time against the bare loop (median of the
rounds, slowest rank) and the time inside ``mon.step()`` itself (timed around each call, wall clock
and the thread's CPU time, which leaves out time the rank was descheduled; the timer's own cost
taken out; the rank that spends most: rank 0, which judges), and writes
``bench/results/monitor.json``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Tuple

from common import mpirun_env, save_json

ROOT = Path(__file__).resolve().parents[1]


def _busy(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def worker(backend: str, steps: int, step_us: float, rounds: int, jitter: float) -> None:
    import random

    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    import hpcsync

    topo = hpcsync.init(backend=backend, timeout=120)
    comm = MPI.COMM_WORLD
    rng = random.Random(topo.rank)
    lengths = [step_us * (1 + jitter * rng.random()) for _ in range(steps)]
    t = torch.ones(16)
    mon = hpcsync.monitor()
    data, wait = mon.section("data"), mon.section("comm")
    clock, cpu = time.perf_counter, time.thread_time
    cpu_spent: list = []

    def bare() -> float:
        for us in lengths:
            _busy(us)
            dist.all_reduce(t)
        return 0.0

    def monitored() -> float:
        inside = cpu_inside = 0.0
        for us in lengths:
            _busy(us)
            dist.all_reduce(t)
            c0, t0 = cpu(), clock()
            mon.step()
            inside += clock() - t0
            cpu_inside += cpu() - c0
        cpu_spent.append(cpu_inside)
        return inside

    def sections() -> float:  # the sections' cost shows in the step time only
        for us in lengths:
            with data:
                _busy(us)
            with wait:
                dist.all_reduce(t)
            mon.step()
        return 0.0

    def timer() -> Tuple[float, float]:  # what timing one call costs (the clock reads)
        inside = cpu_inside = 0.0
        for _ in lengths:
            c0, t0 = cpu(), clock()
            inside += clock() - t0
            cpu_inside += cpu() - c0
        return inside / steps, cpu_inside / steps

    timer_s, cpu_timer_s = min(timer() for _ in range(3))
    for fn in (bare, monitored, sections):  # warm-up: first calls, imports
        fn()
    cpu_spent.clear()
    times: dict = {"bare": [], "monitor": [], "sections": []}
    inside: dict = {"wall": [], "cpu": []}
    for _ in range(rounds):
        for name, fn in (("bare", bare), ("monitor", monitored), ("sections", sections)):
            comm.Barrier()
            t0 = clock()
            spent = fn()
            elapsed = clock() - t0
            times[name].append(comm.allreduce(elapsed, op=MPI.MAX) / steps)
            if name == "monitor":
                inside["wall"].append(comm.allreduce(spent / steps - timer_s, op=MPI.MAX))
                inside["cpu"].append(comm.allreduce(cpu_spent[-1] / steps - cpu_timer_s, op=MPI.MAX))
    mon.close()
    if comm.Get_rank() == 0:
        print(json.dumps({"world_size": comm.Get_size(), "times": times, "inside": inside, "timer_s": timer_s,
                          "verdicts": len(mon.verdicts)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", default="hpcsync", help=argparse.SUPPRESS)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2])
    ap.add_argument("--backends", nargs="+", default=["hpcsync", "gloo"])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--step-us", type=float, default=5000.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--jitter", type=float, default=0.1, help="each step up to this fraction longer, per rank")
    ap.add_argument("--quick", action="store_true", help="CI smoke run: 2 ranks, hpcsync, 300 steps of 1 ms, 2 rounds")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "monitor.json"))
    args = ap.parse_args()
    if args.worker:
        worker(args.backend, args.steps, args.step_us, args.rounds, args.jitter)
        return
    if args.quick:
        args.ranks, args.backends, args.steps, args.step_us, args.rounds = [2], ["hpcsync"], 300, 1000.0, 2
    # verdicts (a rank descheduled on a busy machine is slower, and may be named) go to a scratch folder
    env = mpirun_env(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HPCSYNC_REPORT_DIR=tempfile.mkdtemp(prefix="monitor-"))
    rows = []
    print("| ranks | backend | step | bare step | + mon.step() | ratio | + with 2 sections | ratio | inside mon.step() "
          "(CPU) | share of the step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in args.ranks:
        for backend in args.backends:
            cmd = ["mpirun.openmpi", "--oversubscribe", "--bind-to", "none", "-n", str(n), sys.executable, __file__,
                   "--worker", "--backend", backend, "--steps", str(args.steps), "--rounds", str(args.rounds),
                   "--jitter", str(args.jitter), "--step-us", str(args.step_us)]
            proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, timeout=1800)
            if proc.returncode != 0:
                raise SystemExit(f"benchmark job with {n} ranks on {backend} failed (rc={proc.returncode})")
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            med = {k: statistics.median(v) * 1e6 for k, v in res["times"].items()}
            inside_us = statistics.median(res["inside"]["wall"]) * 1e6
            cpu_us = statistics.median(res["inside"]["cpu"]) * 1e6
            row = {"ranks": n, "backend": backend, "step_us": args.step_us, "bare_us": med["bare"],
                   "monitor_us": med["monitor"], "sections_us": med["sections"],
                   "monitor_ratio": med["monitor"] / med["bare"], "sections_ratio": med["sections"] / med["bare"],
                   "inside_step_us": inside_us, "inside_cpu_us": cpu_us, "inside_share": inside_us / med["bare"],
                   "timer_us": res["timer_s"] * 1e6,
                   "verdicts": res["verdicts"], "all": {"times": res["times"], "inside": res["inside"]}}
            rows.append(row)
            print(f"| {n} | {backend} | {args.step_us:g} µs | {med['bare']:.1f} µs | {med['monitor'] - med['bare']:+.1f} µs "
                  f"| {row['monitor_ratio']:.4f} | {med['sections'] - med['bare']:+.1f} µs | {row['sections_ratio']:.4f} "
                  f"| {inside_us:.2f} µs ({cpu_us:.2f} µs CPU) | {row['inside_share'] * 100:.3f} % |", flush=True)
    save_json(args.out, "rows", rows, steps=args.steps, rounds=args.rounds, jitter=args.jitter,
              command=" ".join(["python", "bench/bench_monitor.py", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
