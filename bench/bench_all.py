"""Every row of the performance table, per rank count, in one run: the backend (collectives vs raw
mpi4py and gloo under Open MPI and MPICH, the 4 KiB floor, DDP vs no_sync), file sync vs ``cat``
and the HDF5 writer.

    python bench/bench_all.py [--ranks 2 4] [--quick] [--before bench/results/all.json]

Runs bench_backend.py (Open MPI with DDP, then MPICH without DDP but with its floors,
``--anchors``), bench_filesync.py (1 GB, best of 2) and bench_h5.py (1 GB, best of 3) one after
another for each rank count (--quick: their quick modes, 2 ranks), prints one summary table of
the headline ratios, each beside its target, and
writes ``bench/results/all.json`` (the scripts' own JSON files hold every row). ``--before``: an
earlier run's ``all.json``, printed beside each ratio; the DDP rows' target becomes "no worse
than before" (ratio ≤ 1.05 × before: these machines are noisy).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(script: str, out: Path, *args: str) -> dict:
    subprocess.run([sys.executable, str(HERE / script), "--out", str(out), *args], check=True,
                   stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(HERE / "results" / "all.json"))
    ap.add_argument("--before", help="an earlier run's all.json: its ratios printed beside these")
    args = ap.parse_args()
    before = {(r["ranks"], r["measure"]): r["ratio"] for r in json.loads(Path(args.before).read_text())} \
        if args.before else {}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in args.ranks:

        q = args.quick  # CI smoke run: each script's own --quick (2 ranks, small sizes)
        be = run("bench_backend.py", out.with_name(f"all-backend-{n}.json"),
                 *(["--quick"] if q else ["--ranks", str(n)]))["results"][0]
        mpich = run("bench_backend.py", out.with_name(f"all-backend-mpich-{n}.json"), "--mpi", "mpich",
                    "--parts", "no-ddp", "--anchors", *(["--quick", "--sizes", "4096", "1048576"] if q else
                                           ["--ranks", str(n), "--sizes", "4096", "1048576", "16777216", "67108864",
                                            "268435456"]))["results"][0]
        fs = run("bench_filesync.py", out.with_name(f"all-filesync-{n}.json"),
                 *(["--quick"] if q else ["--ranks", str(n), "--sizes-mb", "1000", "--repeat", "2"]))["rows"]
        fs = [r for r in fs if r["bytes"] == max(x["bytes"] for x in fs)]
        h5 = run("bench_h5.py", out.with_name(f"all-h5-{n}.json"),
                 *(["--quick"] if q else ["--ranks", str(n), "--mb", "1000", "--repeat", "3"]))["rows"]
        for lib, res in (("Open MPI", be), ("MPICH", mpich)):
            for r in res["collectives"]:
                if r["bytes"] >= 1 << 20 and r.get("hpcsync") and r.get("mpi4py"):
                    rows.append((n, f"{lib}: {r['op']} {r['bytes'] >> 20} MiB vs raw mpi4py",
                                 r["mpi4py"] / r["hpcsync"], 0.9))
            c = res["checks"]
            rows.append((n, f"{lib}: 4 KiB all_reduce, times raw", c["default"] / c["mpi4py (raw)"], 3.0))
            rows.append((n, f"{lib}:   no-op ProcessGroup floor, times raw",
                         c["no-op ProcessGroup (floor)"] / c["mpi4py (raw)"], None))
        for d in be["ddp"]:
            what = f"DDP {d['model'].split(',')[0]} vs no_sync"
            rows.append((n, what, d["hpcsync"] / d["hpcsync no_sync"],
                         round(1.05 * before[n, what], 2) if (n, what) in before else 1.1))
            rows.append((n, f"DDP {d['model'].split(',')[0]} vs gloo", d["hpcsync"] / d["gloo"], None))
        cat = next(r for r in fs if r["method"] == "cat")
        for r in fs:
            if r["method"].startswith("hpcsync"):
                rows.append((n, f"sync_file {r['method']} vs cat", r["mb_per_s"] / cat["mb_per_s"], 0.9))
        fb = next(r for r in h5 if r["method"] == "hpcsync-gather-fallback")
        lim = next(r for r in h5 if r["method"] == "h5py-mpio-by-hand")
        par = next(r for r in h5 if r["method"] == "hpcsync-parallel")
        rows.append((n, "HDF5 parallel vs gather fallback", par["mb_per_s"] / fb["mb_per_s"], 1.0))
        rows.append((n, "HDF5 parallel vs h5py mpio by hand", par["mb_per_s"] / lim["mb_per_s"], None))
    print("| ranks | measure | ratio |" + (" before |" if before else "") + " target | met |")
    print("|---|---|---|" + ("---|" if before else "") + "---|---|")
    for n, what, ratio, target in rows:
        lower_better = "vs no_sync" in what or "times raw" in what or "vs gloo" in what
        met = "" if target is None else ("yes" if (ratio <= target if lower_better else ratio >= target) else "no")
        was = before.get((n, what))
        print(f"| {n} | {what} | {ratio:.2f} |" + ((f" {was:.2f} |" if was is not None else " |") if before else "")
              + f" {'' if target is None else ('≤ ' if lower_better else '≥ ') + str(target)} | {met} |")
    out.write_text(json.dumps([{"ranks": n, "measure": w, "ratio": r, "target": t} for n, w, r, t in rows], indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
