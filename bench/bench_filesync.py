"""Benchmark: joining per-rank part files into one file.

    python bench/bench_filesync.py [--ranks 2 4] [--sizes-mb 1 10 100 1000] [--big] [--repeat 3] [--quick]

Compares, on the same parts in one run: hpcsync's root-side in-kernel copy (what ``auto`` picks
on one node), its gather path and MPI-IO path, the approach of
detectron2's ``comm.gather`` (pickle, pad to the largest, ``all_gather`` over gloo), mpi4py's
lowercase object ``gather``, and ``cat parts > target`` as the limit. Each measurement is one
``mpirun`` job (so root peak memory is per method), started after ``sync`` (no dirty pages left
by the previous one): throughput = merged bytes / merge time, root
memory = peak RSS growth on the root during the merge (VmHWM, reset just before it). Prints a table, writes JSON to
``bench/results/filesync.json``. Parts sit in the page cache for every method (written just before).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import mpirun_env, save_json

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["hpcsync-copy", "hpcsync-gather", "hpcsync-mpiio", "pad+allgather(gloo)", "mpi4py-gather", "cat"]


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak() -> None:
    """Reset VmHWM (peak RSS) to the current RSS, so the peak covers the merge only."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def worker(method: str, folder: str, total: int) -> None:
    """One rank of one measurement (runs under mpirun)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    part = os.path.join(folder, f"part{rank:04d}")
    target = os.path.join(folder, "merged")
    n = total // size + (1 if rank < total % size else 0)
    line = (f"{rank},0123456789,abcdefghijklmnopqrstuvwxyz\n").encode()
    block = line * (2**20 // len(line))
    with open(part, "wb") as f:  # CSV-like text, written in 1 MiB blocks
        left = n
        while left:
            f.write(block[:left])
            left -= min(left, len(block))
    if method == "pad+allgather(gloo)":
        import pickle

        import torch
        import torch.distributed as dist

        import hpcsync

        hpcsync.init(backend="gloo", timeout=600)
    else:
        import hpcsync
        from hpcsync.core import torchcomm  # noqa: F401
        from hpcsync.data import filesync  # noqa: F401  imports are not part of the merge

        hpcsync.topology()
    if rank == 0:
        os.sync()  # start every measurement with no dirty pages left by the previous one
    comm.Barrier()
    base = status_kib("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    if method.startswith("hpcsync-") and method != "hpcsync-mpiio":
        res = hpcsync.sync_file(target, part=part, method=method.split("-")[1], text=False, keep_parts=True,
                                progress=False)
        assert res.method == method.split("-")[1], res
    elif method == "hpcsync-mpiio":
        hpcsync.sync_file(target, part=part, method="mpiio", text=False, keep_parts=True, progress=False)
    elif method == "mpi4py-gather":
        with open(part, "rb") as f:
            data = f.read()
        parts = comm.gather(data, root=0)
        if rank == 0:
            with open(target, "wb") as f:
                for p in parts:
                    f.write(p)
                f.flush()
                os.fsync(f.fileno())
    elif method == "pad+allgather(gloo)":
        # detectron2 comm.gather/all_gather: pickle to a uint8 tensor, pad to the largest, all_gather
        with open(part, "rb") as f:
            buf = pickle.dumps(f.read())
        t = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
        dist.all_gather(sizes, torch.tensor([t.numel()]))
        big = max(int(s) for s in sizes)
        padded = torch.cat([t, torch.zeros(big - t.numel(), dtype=torch.uint8)])
        outs = [torch.empty(big, dtype=torch.uint8) for _ in range(size)]
        dist.all_gather(outs, padded)
        if rank == 0:
            with open(target, "wb") as f:
                for o, s in zip(outs, sizes):
                    f.write(pickle.loads(o[: int(s)].numpy().tobytes()))
                f.flush()
                os.fsync(f.fileno())
    comm.Barrier()
    seconds = time.perf_counter() - t0
    peak = status_kib("VmHWM")
    if rank == 0:
        assert os.path.getsize(target) == total, (os.path.getsize(target), total)
        print(json.dumps({"seconds": seconds, "root_peak_growth_mib": max(0, peak - base) / 1024}))


def measure(method: str, ranks: int, total: int, tmp: Path) -> dict:
    folder = tmp / f"{method.replace('(', '').replace(')', '').replace('+', '')}-{ranks}-{total}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    if method == "cat":
        parts = []
        per = [total // ranks + (1 if r < total % ranks else 0) for r in range(ranks)]
        for r, n in enumerate(per):
            p = folder / f"part{r:04d}"
            p.write_bytes((b"x" * 64 + b"\n") * (n // 65) + b"y" * (n % 65))
            parts.append(str(p))
        os.sync()
        t0 = time.perf_counter()
        subprocess.run(f"cat {' '.join(parts)} > {folder}/merged && sync {folder}/merged", shell=True, check=True)
        out = {"seconds": time.perf_counter() - t0, "root_peak_growth_mib": 0.0}
    else:
        env = mpirun_env(HPCSYNC_PROGRESS="0")
        cmd = ["mpirun.openmpi", "--oversubscribe", "--bind-to", "none", "-n", str(ranks), sys.executable, __file__,
               "--worker", method, str(folder), str(total)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            shutil.rmtree(folder, ignore_errors=True)
            return {"error": proc.stderr.strip().splitlines()[-1][:200] if proc.stderr.strip() else f"rc={proc.returncode}"}
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    shutil.rmtree(folder, ignore_errors=True)
    out["mb_per_s"] = total / 1e6 / out["seconds"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 10, 100, 1000])
    ap.add_argument("--big", action="store_true", help="add one 2.2 GiB merge (hpcsync methods and cat only)")
    ap.add_argument("--quick", action="store_true", help="CI smoke run: 2 ranks, 1 and 8 MB")
    ap.add_argument("--repeat", type=int, default=1, help="measure each cell this many times, keep the best")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "filesync.json"))
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], int(args.worker[2]))
        return
    if args.quick:
        args.ranks, args.sizes_mb = [2], [1, 8]
    runs = [(r, int(mb * 1e6), m) for r in args.ranks for mb in args.sizes_mb for m in METHODS]
    if args.big:
        runs += [(2, int(2.2 * 2**30), m) for m in ("hpcsync-copy", "hpcsync-gather", "hpcsync-mpiio", "cat")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="hpcsync-bench-", dir=os.environ.get("BENCH_TMP")) as tmp:
        tries: dict = {}
        for _ in range(args.repeat):  # every cell once per round: disk state hits each method alike
            for key in runs:
                tries.setdefault(key, []).append(measure(key[2], key[0], key[1], Path(tmp)))
        for ranks, total, method in runs:
            ok = [t for t in tries[(ranks, total, method)] if "error" not in t]
            res = max(ok, key=lambda t: t["mb_per_s"]) if ok else tries[(ranks, total, method)][0]
            rows.append({"ranks": ranks, "bytes": total, "method": method, **res})
            r = rows[-1]
            print(f"  {ranks} ranks {total / 1e6:9.1f} MB {method:22s} "
                  + (f"{r['mb_per_s']:9.1f} MB/s  root +{r['root_peak_growth_mib']:8.1f} MiB" if "error" not in r
                     else f"error: {r['error']}"), flush=True)
    print("\n| ranks | merged MB | method | MB/s | × pad+allgather | × cat | root peak growth MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['ranks']} | {r['bytes'] / 1e6:.1f} | {r['method']} | error | | | |")
            continue
        same = {x["method"]: x for x in rows if x["ranks"] == r["ranks"] and x["bytes"] == r["bytes"] and "error" not in x}
        pad = same.get("pad+allgather(gloo)")
        cat = same.get("cat")
        vs_pad = f"{r['mb_per_s'] / pad['mb_per_s']:.2f}" if pad else "-"
        vs_cat = f"{r['mb_per_s'] / cat['mb_per_s']:.2f}" if cat else "-"
        print(f"| {r['ranks']} | {r['bytes'] / 1e6:.1f} | {r['method']} | {r['mb_per_s']:.0f} | {vs_pad} | {vs_cat} | "
              f"{r['root_peak_growth_mib']:.0f} |")
    save_json(args.out, "rows", rows)


if __name__ == "__main__":
    main()
