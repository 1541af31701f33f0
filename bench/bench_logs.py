"""Benchmark: where a rank's log file should live while the job runs.

    python bench/bench_logs.py [--records 20000] [--rounds 5] [--shared DIR] [--quick]

Times one record through hpcsync's file handler (its format, rank fields, a line written per
record) into a file in ``--shared`` (default: ``runs/bench-logs`` on the working disk, where a job's
log folder would be) and into node-local memory (``/dev/shm``, gathered at the end: the copy is
timed too), beside the same records with no handler at all (the floor: ``logging`` itself).
Rounds alternate the targets; the medians go to a table and ``bench/results/logs.json``.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import save_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpcsync.observe import logs  # noqa: E402


def per_record_us(folder: str, records: int, gather_to: str = "") -> float:
    """µs per record logged to ``folder`` (``""``: no handler), plus a copy to ``gather_to`` if set."""
    log = logging.getLogger(f"bench.{time.perf_counter_ns()}")
    log.propagate = False
    log.setLevel(logging.INFO)
    handler = None
    if folder:
        path = os.path.join(folder, "rank-00000.log")
        handler = logging.FileHandler(path, mode="w")
        handler.addFilter(logs._RankFields(0, 64, "node0"))
        handler.setFormatter(logging.Formatter(logs.FORMAT))
        log.addHandler(handler)
    t0 = time.perf_counter()
    for i in range(records):
        log.info("step %d loss %.4f lr %.2e", i, 1.0 / (i + 1), 3e-4)
    if handler is not None:
        handler.close()
        if gather_to:
            shutil.copy(path, os.path.join(gather_to, "rank-00000.log"))
    return (time.perf_counter() - t0) / records * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shared", default=str(ROOT / "runs" / "bench-logs"))
    ap.add_argument("--quick", action="store_true", help="CI's smoke run: 2,000 records, 2 rounds")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "logs.json"))
    args = ap.parse_args()
    if args.quick:
        args.records, args.rounds = 2000, 2
    os.makedirs(args.shared, exist_ok=True)
    local = tempfile.mkdtemp(prefix="hpcsync-bench-logs-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    targets = {"no handler (logging itself)": ("", ""), "file in the log folder": (args.shared, ""),
               "node-local file, copied at the end": (local, args.shared)}
    times = {name: [] for name in targets}
    try:
        for _ in range(args.rounds):
            for name, (folder, gather) in targets.items():
                times[name].append(per_record_us(folder, args.records, gather))
    finally:
        shutil.rmtree(local, ignore_errors=True)
    floor = statistics.median(times["no handler (logging itself)"])
    rows = [{"target": name, "us_per_record": round(statistics.median(t), 2),
             "vs_no_handler": round(statistics.median(t) / floor, 2)} for name, t in times.items()]
    print(f"{'target':38s} {'µs/record':>10s} {'× no handler':>13s}")
    for r in rows:
        print(f"{r['target']:38s} {r['us_per_record']:10.2f} {r['vs_no_handler']:13.2f}")
    save_json(args.out, "rows", rows, records=args.records, rounds=args.rounds, shared=args.shared)


if __name__ == "__main__":
    main()
