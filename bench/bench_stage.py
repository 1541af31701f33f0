"""Benchmark: staging a dataset onto every node's local disk.

    python bench/bench_stage.py [--nodes 1 2 3] [--ranks-per-node 2] [--big-mib 1024] [--small 10000] [--repeat 3]
                                [--where DIR] [--quick]

Two datasets: one big file, and many 10 KiB files in nested directories. Three ways, side by
side in one run, each round interleaved and the best of ``--repeat`` kept (disk writeback swings
single runs a lot here):

- ``hpcsync.stage``: one MPI job (``--ranks-per-node`` ranks on each node), timed around the call;
- ``cp -r per node``: the usual practice, one ``cp -r`` per node leader, all nodes at once;
- ``cp -r per rank``: every rank copies for itself (into its own folder), all at once.

Source reads = how many times the dataset's bytes were read from the source (stage: its own
count; cp: one read per copy). On one node the destination is a local folder; with ``--nodes N``
the nodes are network namespaces on this machine (``tests/netns_cluster.py``), each with its own
node-local folder, and the source sits on a path all of them see (so that ``cp`` can run at all).
Each measurement starts from an empty destination after ``sync``. ``--where`` puts source and
copies on another filesystem: ``/dev/shm`` (RAM) makes the comparison repeatable, since it removes
the disk's writeback, which on this VM swings one ``cp -r`` of the same files between 0.4 and 2.5 s.
Prints a table, writes JSON (default ``bench/results/stage.json``).
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
METHODS = ["hpcsync.stage", "cp -r per node", "cp -r per rank"]


def worker(src: str, dst: str) -> None:
    """One rank of the stage measurement (under mpirun): time the collective call alone."""
    import hpcsync
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()
    t0 = time.perf_counter()
    r = hpcsync.stage(src, dst, progress=False)
    seconds = MPI.COMM_WORLD.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(json.dumps({"seconds": seconds, "source_reads": r.source_reads, "bytes": r.bytes,
                          "broadcasts": r.broadcasts, "nodes": r.nodes}), flush=True)


def make_big(folder: Path, mib: int) -> None:
    folder.mkdir(parents=True)
    block = os.urandom(2**20)
    with open(folder / "big.bin", "wb") as f:
        for _ in range(mib):
            f.write(block)


def make_small(folder: Path, count: int) -> None:
    for i in range(count):
        p = folder / f"d{i % 10}" / f"e{(i // 10) % 10}" / f"f{i:06d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(os.urandom(10240))


def dataset_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


class Place:
    """Where copies go and how commands reach each node: this machine, or namespace nodes."""

    def __init__(self, nodes: int, work: Path) -> None:
        self.nodes, self.cluster = nodes, None
        if nodes > 1:
            sys.path.insert(0, str(ROOT / "tests"))
            from netns_cluster import ROUTED, Cluster

            self.cluster = Cluster(work, nodes, ROUTED).start()
            self.local = self.cluster.node_local  # the same path on every node, another folder on each
        else:
            self.local = str(work / "local")
            os.makedirs(self.local)

    def on_node(self, i: int, cmd: list) -> list:
        return cmd if self.cluster is None else self.cluster.on_node(i, *cmd)

    def clean(self) -> None:
        folders = [Path(self.local)] if self.cluster is None else \
            [Path(self.cluster.dir, "nodes", n) for n in self.cluster.names]
        for f in folders:
            for child in f.iterdir():
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        subprocess.run(["sync"])

    def stage(self, src: Path, per_node: int) -> dict:
        n = per_node * self.nodes
        env = mpirun_env(OMP_NUM_THREADS="1")
        if self.cluster is None:
            cmd = ["mpirun.openmpi", "--oversubscribe", "--bind-to", "none", "-n", str(n)]
        else:
            lau = self.cluster.openmpi([per_node] * self.nodes)
            env.update(lau.env)
            cmd = lau.command(n, env)
        proc = subprocess.run([*cmd, sys.executable, __file__, "--worker", str(src), os.path.join(self.local, "dst")],
                              env=env, stdout=subprocess.PIPE, text=True, timeout=3000)
        if proc.returncode != 0:
            raise SystemExit(f"stage job failed (rc={proc.returncode})")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def copies(self, src: Path, per_node: int) -> float:
        """``per_node`` concurrent ``cp -r`` on every node, all nodes at once; wall time."""
        t0 = time.perf_counter()
        procs = [subprocess.Popen(self.on_node(i, ["cp", "-r", str(src), os.path.join(self.local, f"copy{k}")]))
                 for i in range(self.nodes) for k in range(per_node)]
        if any(p.wait() != 0 for p in procs):
            raise SystemExit("cp -r failed")
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()


def measure(place: Place, name: str, src: Path, per_node: int, repeat: int) -> list:
    size = dataset_bytes(src)
    best: dict = {}
    for _ in range(repeat):  # methods interleaved within each round
        for method in METHODS:
            place.clean()
            if method == "hpcsync.stage":
                r = place.stage(src, per_node)
                row = {"seconds": r["seconds"], "source_reads": r["source_reads"] / size, "broadcasts": r["broadcasts"]}
            else:
                copies = 1 if method == "cp -r per node" else per_node
                row = {"seconds": place.copies(src, copies), "source_reads": float(copies * place.nodes)}
            if method not in best or row["seconds"] < best[method]["seconds"]:
                best[method] = row
    cp = best["cp -r per node"]["seconds"]
    return [{"dataset": name, "nodes": place.nodes, "ranks": per_node * place.nodes, "method": m, "bytes": size,
             **best[m], "mb_per_s": size / best[m]["seconds"] / 1e6, "speed_vs_cp": cp / best[m]["seconds"]}
            for m in METHODS]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--big-mib", type=int, default=1024)
    ap.add_argument("--small", type=int, default=10_000, help="number of 10 KiB files")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="CI smoke run: 64 MiB, 500 files, 1 and 2 nodes, once")
    ap.add_argument("--where", help="folder for sources and copies (default: the system temp folder)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "stage.json"))
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    if args.quick:
        args.nodes, args.big_mib, args.small, args.repeat = [1, 2], 64, 500, 1
    work = Path(tempfile.mkdtemp(prefix="hpcsync-bench-stage-", dir=args.where))
    rows = []
    try:
        data = {"big": work / "src-big", "small": work / "src-small"}
        make_big(data["big"], args.big_mib)
        make_small(data["small"], args.small)
        for nodes in args.nodes:
            place = Place(nodes, work / f"nodes{nodes}")
            try:
                for name, src in data.items():
                    rows += measure(place, f"{name} ({dataset_bytes(src) / 2**20:.0f} MiB, "
                                           f"{sum(1 for p in src.rglob('*') if p.is_file())} files)",
                                    src, args.ranks_per_node, args.repeat)
            finally:
                place.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n| dataset | nodes | ranks | method | seconds | MB/s | speed vs cp -r per node | source reads |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dataset']} | {r['nodes']} | {r['ranks']} | {r['method']} | {r['seconds']:.3f} | "
              f"{r['mb_per_s']:.0f} | {r['speed_vs_cp']:.2f}x | {r['source_reads']:.0f} |")
    save_json(args.out, "rows", rows, where=args.where or tempfile.gettempdir())


if __name__ == "__main__":
    main()
