"""What stage-in costs each rank at a million files: peak memory and bytes received, per rank.

    python bench/bench_stage.py --files 1000000 [--nodes 1 2] [--baseline DIR] [--where /dev/shm]

``--files`` files of 1 KiB in 1,000 folders (ImageNet's shape), staged once into an empty
destination by one MPI job: on one node (2 ranks, which share the copying), and on 2 namespace
nodes of 2 ranks each (node leaders move the bytes; the other ranks wait). Per rank: the growth of
its peak resident memory during the call (``ru_maxrss`` after minus before), the bytes it
received from the other ranks (the stage's own count, ``StageResult.received_bytes``; versions
without it report none), and the size of the result it was handed (pickled). ``--baseline`` runs
another hpcsync version in the same way, side by side. Adds its rows to
``bench/results/stage_scale.json`` (replacing earlier rows of the same files and nodes).
"""
from __future__ import annotations

import json
import os
import pickle
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional

from common import mpirun_env, save_json

ROOT = Path(__file__).resolve().parents[1]


def worker(src: str, dst: str) -> None:
    """One rank: stage, then report this rank's memory growth and traffic (under mpirun)."""
    from mpi4py import MPI

    from hpcsync import stage

    MPI.COMM_WORLD.Barrier()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    r = stage(src, dst, progress=False)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    mine = {"rank": MPI.COMM_WORLD.Get_rank(), "host": os.uname().nodename, "rss_before_mib": before / 1024,
            "rss_growth_mib": (peak - before) / 1024, "received_bytes": getattr(r, "received_bytes", None),
            "result_bytes": len(pickle.dumps(asdict(r))), "seconds": seconds,
            "copied": getattr(r, "copied_files", None) if hasattr(r, "copied_files") else len(r.copied)}
    every = MPI.COMM_WORLD.gather(mine, root=0)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print("RESULT " + json.dumps(every), flush=True)


def make_files(folder: Path, count: int) -> None:
    """``count`` files of 1 KiB in 1,000 folders."""
    data = os.urandom(1024)
    for d in range(1000):
        (folder / f"c{d:03d}").mkdir(parents=True)
    for i in range(count):
        fd = os.open(folder / f"c{i % 1000:03d}" / f"f{i:07d}.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, data)
        os.close(fd)


def run_one(version: str, package: Optional[str], nodes: int, src: Path, work: Path) -> List[Dict[str, Any]]:
    env = mpirun_env(OMP_NUM_THREADS="1", PYTHONPATH=package or str(ROOT))
    me = [sys.executable, str(Path(__file__).resolve()), "--worker", str(src)]
    if nodes == 1:
        dst = work / "dst"
        cmd = ["mpirun.openmpi", "--oversubscribe", "--bind-to", "none", "-x", "PYTHONPATH", "-n", "2",
               *me, str(dst)]
        cluster = None
    else:
        sys.path.insert(0, str(ROOT / "tests"))
        from netns_cluster import ROUTED, Cluster

        cluster = Cluster(work / "nodes", nodes, ROUTED).start()
        dst = Path(cluster.node_local, "dst")
        lau = cluster.openmpi([2] * nodes)
        cmd = [*lau.command(2 * nodes, env), "-x", "PYTHONPATH", *me, str(dst)]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            raise RuntimeError(f"{version}, {nodes} node(s): no result\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
        return json.loads(line[len("RESULT "):])
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(work / "dst", ignore_errors=True)


def main(files: int, nodes: List[int], baseline: str, where: Optional[str], out: str) -> None:
    base = Path(tempfile.mkdtemp(prefix="hpcsync-stage-scale-", dir=where))
    try:
        src = base / "src"
        t0 = time.perf_counter()
        make_files(src, files)
        print(f"made {files} files of 1 KiB in {time.perf_counter() - t0:.0f} s", flush=True)
        versions = [("hpcsync.stage", None)] + ([("baseline", baseline)] if baseline else [])
        rows = []
        for n in nodes:
            for name, package in versions:
                work = base / f"w-{name}-{n}"
                work.mkdir()
                try:
                    ranks = run_one(name, package, n, src, work)
                except RuntimeError as exc:  # (e.g. the folder too small for this many copies): say so, go on
                    print(str(exc)[-1500:], flush=True)
                    ranks = []
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                for r in ranks:
                    rows.append({"version": name, "files": files, "nodes": n, **r})
        print("\n| version | files | nodes | rank | node | peak memory growth (MiB) | received (MiB) | "
              "result (MiB) | seconds |\n|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            rec = "-" if r["received_bytes"] is None else f"{r['received_bytes'] / 2**20:.2f}"
            print(f"| {r['version']} | {r['files']} | {r['nodes']} | {r['rank']} | {r['host']} | "
                  f"{r['rss_growth_mib']:.0f} | {rec} | {r['result_bytes'] / 2**20:.2f} | {r['seconds']:.1f} |")
        where = where or tempfile.gettempdir()
        try:  # rows of other runs (other file counts or node counts) are kept
            with open(out) as f:
                kept = [r for r in json.load(f)["rows"] if (r["files"], r["nodes"]) not in
                        {(x["files"], x["nodes"]) for x in rows}]
        except (OSError, ValueError, KeyError):
            kept = []
        for r in rows:
            r["where"] = where
        save_json(out, "rows", kept + rows)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--worker":
    worker(sys.argv[2], sys.argv[3])
