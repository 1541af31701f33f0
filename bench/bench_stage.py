"""Benchmark: staging a dataset onto every node's local disk.

    python bench/bench_stage.py [--nodes 1 2 3] [--ranks-per-node 2] [--datasets big small tiny]
                                [--big-mib 1024] [--small 10000] [--tiny 100000] [--repeat 3]
                                [--where DIR] [--baseline DIR] [--after-init] [--quick]
    python bench/bench_stage.py --model

Three datasets: one big file (``--big-mib``), ``--small`` files of 10 KiB and ``--tiny`` files of
1 KiB, the files spread over nested folders. Three ways, side by side in one run, each round
interleaved and the best of ``--repeat`` kept (disk writeback swings single runs a lot here); the
ratio to the anchor of every round is kept too (``ratios``: round k's anchor over round k's time),
and the targets are judged on the worst of them:

- ``hpcsync.stage``: one MPI job (``--ranks-per-node`` ranks on each node), timed around the call
  (MPI's start and the first import of hpcsync's staging modules and numpy, ~0.1 s that a
  training job pays anyway, are not in it; the import is in the JSON as ``import_seconds``); its
  ranks run this tree's ``hpcsync`` (``PYTHONPATH``), whose folder is in the JSON as ``package``;
- ``hpcsync.stage after init`` (with ``--after-init``): the same, in a job that called
  ``hpcsync.init()`` first, as ``examples/train.py`` does (the backend and its threads running
  during the stage; init is not in the time, it is in the JSON as ``init_seconds``);
- ``cp -a per node``: the anchor, the usual practice: one ``cp -a`` per node leader, all nodes at
  once (``-a`` keeps modes and mtimes, as stage does);
- ``cp -a per rank``: every rank copies for itself (into its own folder), all at once.

Source reads = how many times the dataset's bytes were read from the source (stage: its own
count; cp: one read per copy). On one node the destination is a local folder; with ``--nodes N``
(N > 1) the nodes are network namespaces on this machine (``tests/netns_cluster.py``; run the
benchmark under ``flock /tmp/hpcsync-netns.lock``), each with its own node-local folder, and the
source sits on a path all of them see (so that ``cp`` can run at all: the shared filesystem).
Each measurement starts from an empty destination after ``sync``; after the last round every
node's staged copy is checked against the source (content, modes, mtimes). ``--where`` puts
source and copies on another filesystem: ``/dev/shm`` (RAM) makes the comparison repeatable,
since it removes the disk's writeback, which on this VM swings one ``cp`` of the same files
between 0.4 and 2.5 s. ``--baseline DIR`` stages with another version of hpcsync too, in the same
rounds (before/after side by side; after init too with ``--after-init``). Prints a table and the
targets (one node: 10 KiB and 1 KiB files at 0.9x ``cp -a`` or better in every round, after init
too; with a baseline, the big file no slower than it), the seconds each
added namespace node costs, writes JSON (default ``bench/results/stage.json``). ``--model``
prints the model of stage vs ``cp`` across N nodes of a cluster (docs/filesync.md).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from common import mpirun_env, save_json

ROOT = Path(__file__).resolve().parents[1]
ANCHOR = "cp -a per node"
METHODS = ["hpcsync.stage", ANCHOR, "cp -a per rank"]
BASELINE = "hpcsync.stage (baseline)"
AFTER_INIT = " after init"  # the same method in a job that called hpcsync.init() first
SMALL_BYTES, TINY_BYTES = 10240, 1024


def worker(src: str, dst: str, init: bool = False) -> None:
    """One rank of the stage measurement (under mpirun): time the collective call alone (the
    imports, which a training job has paid anyway, are timed apart: ``import_seconds``). With
    ``init``, ``hpcsync.init()`` runs first (timed apart too: ``init_seconds``), as in
    ``examples/train.py``: the stage then runs beside the backend's threads."""
    from mpi4py import MPI

    import hpcsync

    initialized = 0.0
    if init:
        t0 = time.perf_counter()
        hpcsync.init()
        initialized = MPI.COMM_WORLD.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    t0 = time.perf_counter()
    from hpcsync import stage  # hpcsync loads its staging modules (and numpy) at first use

    imported = time.perf_counter() - t0
    MPI.COMM_WORLD.Barrier()
    t0 = time.perf_counter()
    r = stage(src, dst, progress=False)
    seconds = MPI.COMM_WORLD.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    imported = MPI.COMM_WORLD.allreduce(imported, op=MPI.MAX)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(json.dumps({"seconds": seconds, "source_reads": r.source_reads, "bytes": r.bytes, "import_seconds": imported,
                          "broadcasts": r.broadcasts, "nodes": r.nodes,
                          "copied": r.copied_files if hasattr(r, "copied_files") else len(r.copied),
                          "init_seconds": initialized, "package": os.path.dirname(hpcsync.__file__)}), flush=True)


def make_big(folder: Path, mib: int) -> None:
    folder.mkdir(parents=True)
    block = os.urandom(2**20)
    with open(folder / "big.bin", "wb") as f:
        for _ in range(mib):
            f.write(block)


def make_files(folder: Path, count: int, size: int) -> None:
    """``count`` files of ``size`` bytes, 100 leaf folders in 10 (ImageNet's shape: class folders)."""
    for i in range(count):
        p = folder / f"d{i % 10}" / f"e{(i // 10) % 10}" / f"f{i:06d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(os.urandom(size))


def dataset_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def tree(root: Path) -> Dict[str, tuple]:
    """rel -> (mode, mtime, size, content hash) of every file and folder; stage's manifest left out."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            if name.startswith(".hpcsync-stage"):
                continue
            p = os.path.join(folder, name)
            s = os.lstat(p)
            digest = ""
            if stat.S_ISREG(s.st_mode):
                with open(p, "rb") as f:
                    digest = hashlib.sha1(f.read()).hexdigest()
            out[os.path.relpath(p, root)] = (s.st_mode, s.st_mtime_ns, s.st_size if digest else 0, digest)
    return out


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

    def node_folders(self) -> List[Path]:
        """Each node's local folder, as this machine sees it."""
        return [Path(self.local)] if self.cluster is None else \
            [Path(self.cluster.dir, "nodes", n) for n in self.cluster.names]

    def on_node(self, i: int, cmd: list) -> list:
        return cmd if self.cluster is None else self.cluster.on_node(i, *cmd)

    def clean(self) -> None:
        for f in self.node_folders():
            for child in f.iterdir():
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        subprocess.run(["sync"])

    def stage(self, src: Path, per_node: int, package: str = "", init: bool = False) -> dict:
        """One stage job; ``package``: a folder holding another version of ``hpcsync`` to run (by
        default this tree's, ahead of any installed one); ``init``: ``hpcsync.init()`` first."""
        n = per_node * self.nodes
        env = mpirun_env(OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join([package or str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
        if self.cluster is None:
            cmd = ["mpirun.openmpi", "--oversubscribe", "--bind-to", "none", "-n", str(n)]
        else:
            lau = self.cluster.openmpi([per_node] * self.nodes)
            env.update(lau.env)
            cmd = lau.command(n, env)
        proc = subprocess.run([*cmd, sys.executable, __file__, "--worker", str(src), os.path.join(self.local, "dst"),
                               *(["--worker-init"] if init else [])], env=env, stdout=subprocess.PIPE, text=True, timeout=3000)
        if proc.returncode != 0:
            raise SystemExit(f"stage job failed (rc={proc.returncode})")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def copies(self, src: Path, per_node: int) -> float:
        """``per_node`` concurrent ``cp -a`` on every node, all nodes at once; wall time."""
        t0 = time.perf_counter()
        procs = [subprocess.Popen(self.on_node(i, ["cp", "-a", str(src), os.path.join(self.local, f"copy{k}")]))
                 for i in range(self.nodes) for k in range(per_node)]
        if any(p.wait() != 0 for p in procs):
            raise SystemExit("cp -a failed")
        return time.perf_counter() - t0

    def check(self, src: Path) -> None:
        """Every node's staged copy equals the source: content, modes, mtimes, folders."""
        want = tree(src)
        for f in self.node_folders():
            if tree(f / "dst") != want:
                raise SystemExit(f"the staged copy in {f / 'dst'} differs from {src}")

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()


def measure(place: Place, name: str, src: Path, per_node: int, repeat: int, baseline: str = "",
            after_init: bool = False) -> list:
    size = dataset_bytes(src)
    best: dict = {}
    staged = [METHODS[0], *([BASELINE] if baseline else [])]
    methods = [*staged, *([m + AFTER_INIT for m in staged] if after_init else []), *METHODS[1:]]
    for k in range(repeat):  # methods interleaved within each round
        for method in methods:
            place.clean()
            if method.startswith("hpcsync.stage"):
                r = place.stage(src, per_node, baseline if method.startswith(BASELINE) else "",
                                method.endswith(AFTER_INIT))
                row = {"seconds": r["seconds"], "source_reads": r["source_reads"] / size, "broadcasts": r["broadcasts"],
                       "import_seconds": r["import_seconds"], "init_seconds": r.get("init_seconds", 0.0),
                       "package": r.get("package", "")}
                if k == repeat - 1 and method == METHODS[0]:
                    place.check(src)
            else:
                copies = 1 if method == ANCHOR else per_node
                row = {"seconds": place.copies(src, copies), "source_reads": float(copies * place.nodes)}
            best.setdefault(method, []).append(row)
    rows = []
    anchors = [r["seconds"] for r in best[ANCHOR]]
    for m in methods:
        top = min(best[m], key=lambda r: r["seconds"])
        rows.append({"dataset": name, "nodes": place.nodes, "ranks": per_node * place.nodes, "method": m,
                     "bytes": size, **top, "all_seconds": [r["seconds"] for r in best[m]],
                     "ratios": [a / r["seconds"] for a, r in zip(anchors, best[m])]})  # round k's anchor / round k
    anchor = rows[methods.index(ANCHOR)]["seconds"]
    for r in rows:
        r.update(mb_per_s=size / r["seconds"] / 1e6, speed_vs_anchor=anchor / r["seconds"])
    return rows


def targets(rows: list) -> list:
    """The stage-in targets on one node, judged from this run's rows: the small-file datasets at
    0.9x ``cp -a`` in every round (``ratio``: the worst round), after init too."""
    out = []
    for r in rows:
        if r["method"] not in ("hpcsync.stage", "hpcsync.stage" + AFTER_INIT) or r["nodes"] != 1:
            continue
        if r["dataset"].startswith(("small", "tiny")):
            how = r["method"][len("hpcsync.stage"):]
            out.append({"target": f"{r['dataset']}, 1 node: stage{how} >= 0.9x cp -a in every run",
                        "ratio": min(r["ratios"]), "ratios": r["ratios"], "met": min(r["ratios"]) >= 0.9})
        if r["method"] != "hpcsync.stage":
            continue
        base = [b for b in rows if b["method"] == BASELINE and b["dataset"] == r["dataset"] and b["nodes"] == 1]
        if r["dataset"].startswith("big") and base:
            out.append({"target": f"{r['dataset']}, 1 node: stage no slower than the baseline",
                        "ratio": base[0]["seconds"] / r["seconds"], "met": r["seconds"] <= base[0]["seconds"] * 1.05})
    return out


# The model of stage vs cp across N nodes (docs/filesync.md, "Across nodes: a model"): assumed
# figures of a typical cluster, ImageNet-1k's training set; --model prints the table.
MODEL = {"S": 140e9, "F": 1.28e6, "B_client": 3e9, "B_fs": 50e9, "R_md": 50e3, "c_open": 0.2e-3, "c_stat": 0.1e-3,
         "B_net": 12.5e9, "alpha": 10e-6, "bubble": 50e-6, "seg": 32768, "c_file": 35e-6, "B_disk": 2e9,
         "C": 16 * 2**20, "p": 4}


def model(n: int, m: dict = MODEL) -> dict:
    """Seconds for stage and for ``cp`` from the shared filesystem on every node, ``n`` nodes.
    The broadcast is Open MPI's non-blocking one (libnbc) for stage's rounds of ``C`` bytes: a
    chain of 32 KiB segments, pipelined, so its bandwidth term is S/B_net at any N, plus a fill of
    (n - 1) hops once, plus a bubble per round per rank (the round's end noticed, the next posted)."""
    rounds = max(m["S"] / m["C"], m["F"] / 4096)
    t_list = m["F"] * m["c_stat"] / m["p"]
    t_read = m["S"] / m["B_client"] + m["F"] * m["c_open"]  # the root alone, one file at a time
    t_bcast = (m["S"] / m["B_net"] + rounds * m["bubble"] + (n - 1) * (m["alpha"] + m["seg"] / m["B_net"])
               if n > 1 else 0.0)
    t_write = m["S"] / m["B_disk"] + m["F"] * m["c_file"]  # every node at once
    stage = t_list + max(t_read, t_bcast, t_write)
    per_node = m["F"] * (m["c_open"] + m["c_file"]) + m["S"] / min(m["B_client"], m["B_fs"] / n)
    cp = max(per_node, n * m["F"] / m["R_md"])
    return {"nodes": n, "stage_s": stage, "cp_s": cp, "read_s": t_read, "bcast_s": t_bcast, "write_s": t_write,
            "list_s": t_list, "cp_metadata_s": n * m["F"] / m["R_md"], "cp_per_node_s": per_node}


def crossover(m: dict = MODEL) -> int:
    """The fewest nodes from which ``cp`` from the shared filesystem is slower than stage by more
    than a tenth (below it the two are within 10 %)."""
    return next(n for n in range(1, 100_000) if model(n, m)["cp_s"] > 1.1 * model(n, m)["stage_s"])


def print_model() -> None:
    print("| nodes | stage (list + max(read, broadcast, write)) | cp -a from the shared filesystem | stage speed-up |")
    print("|---|---|---|---|")
    rows = [model(n) for n in (1, 2, 8, 16, 64, 256, 1000)]
    for r in rows:
        print(f"| {r['nodes']} | {r['stage_s']:.0f} s ({r['list_s']:.0f} + max({r['read_s']:.0f}, {r['bcast_s']:.0f}, "
              f"{r['write_s']:.0f})) | {r['cp_s']:.0f} s | {r['cp_s'] / r['stage_s']:.2f} |")
    print(f"crossover: from {crossover()} nodes cp -a is more than 10 % slower than stage")
    save_json(str(ROOT / "bench" / "results" / "stage-model.json"), "rows", rows, assumed=MODEL,
              crossover_nodes=crossover())


def slopes(rows: list) -> list:
    """Seconds each added namespace node costs (least squares over the node counts measured)."""
    out = []
    for name in dict.fromkeys(r["dataset"] for r in rows):
        for m in [*METHODS, BASELINE, METHODS[0] + AFTER_INIT, BASELINE + AFTER_INIT]:
            pts = [(r["nodes"], r["seconds"]) for r in rows if r["dataset"] == name and r["method"] == m]
            if len(pts) > 1 and len({x for x, _ in pts}) > 1:
                xm, ym = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
                slope = sum((x - xm) * (y - ym) for x, y in pts) / sum((x - xm) ** 2 for x, _ in pts)
                out.append({"dataset": name, "method": m, "seconds_per_added_node": slope,
                            "one_node_seconds": min(pts)[1]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--worker-init", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--datasets", nargs="+", choices=["big", "small", "tiny"], default=["big", "small", "tiny"])
    ap.add_argument("--big-mib", type=int, default=1024)
    ap.add_argument("--small", type=int, default=10_000, help="number of 10 KiB files")
    ap.add_argument("--tiny", type=int, default=100_000, help="number of 1 KiB files")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="CI smoke run: 64 MiB, 500 + 2000 files, 1 and 2 nodes, once")
    ap.add_argument("--where", help="folder for sources and copies (default: the system temp folder)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "stage.json"))
    ap.add_argument("--baseline", default="", help="a folder holding another hpcsync package (e.g. `git archive "
                    "COMMIT hpcsync | tar -x -C DIR`): staged too, as 'hpcsync.stage (baseline)', in the same rounds")
    ap.add_argument("--after-init", action="store_true", help="stage also in jobs that called hpcsync.init() first "
                    "(as examples/train.py does), as 'hpcsync.stage after init', in the same rounds")
    ap.add_argument("--model", action="store_true", help="print the model across nodes (assumed cluster figures), "
                    "write bench/results/stage-model.json, measure nothing")
    ap.add_argument("--files", type=int, help="instead: memory and bytes per rank at this many 1 KiB files "
                    "(bench/stage_scale.py; --nodes 1 2, --baseline, --where apply)")
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker, init=args.worker_init)
        return
    if args.model:
        print_model()
        return
    if args.files:
        import stage_scale

        stage_scale.main(args.files, args.nodes, os.path.abspath(args.baseline) if args.baseline else "", args.where,
                         str(ROOT / "bench" / "results" / "stage_scale.json"))
        return
    if args.quick:
        args.nodes, args.big_mib, args.small, args.tiny, args.repeat = [1, 2], 64, 500, 2000, 1
    work = Path(tempfile.mkdtemp(prefix="hpcsync-bench-stage-", dir=args.where))
    rows: list = []
    try:
        data = {}
        for name in args.datasets:
            data[name] = work / f"src-{name}"
            if name == "big":
                make_big(data[name], args.big_mib)
            else:
                make_files(data[name], args.small if name == "small" else args.tiny,
                           SMALL_BYTES if name == "small" else TINY_BYTES)
        for nodes in args.nodes:
            place = Place(nodes, work / f"nodes{nodes}")
            try:
                for name, src in data.items():
                    files = sum(1 for p in src.rglob("*") if p.is_file())
                    rows += measure(place, f"{name} ({dataset_bytes(src) / 2**20:.0f} MiB, {files} files)",
                                    src, args.ranks_per_node, args.repeat, os.path.abspath(args.baseline) if args.baseline
                                    else "", args.after_init)
            finally:
                place.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n| dataset | nodes | ranks | method | seconds | MB/s | speed vs {ANCHOR} | each run vs {ANCHOR} "
          "| source reads |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dataset']} | {r['nodes']} | {r['ranks']} | {r['method']} | {r['seconds']:.3f} | "
              f"{r['mb_per_s']:.0f} | {r['speed_vs_anchor']:.2f}x | {' '.join(f'{x:.2f}' for x in r['ratios'])} | "
              f"{r['source_reads']:.0f} |")
    goals = targets(rows)
    for g in goals:
        runs = f" (runs: {' '.join(f'{x:.2f}' for x in g['ratios'])})" if "ratios" in g else ""
        print(f"target: {g['target']}: {g['ratio']:.2f}x{runs}, {'met' if g['met'] else 'NOT met'}")
    added = slopes(rows)
    for a in added:
        print(f"{a['dataset']}: {a['method']}: {a['one_node_seconds']:.3f} s on one node, "
              f"{a['seconds_per_added_node']:+.3f} s per added namespace node")
    save_json(args.out, "rows", rows, targets=goals, per_added_node=added, anchor=ANCHOR, where=args.where or tempfile.gettempdir(),
              command=" ".join(["python", "bench/bench_stage.py", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
