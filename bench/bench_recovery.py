"""Benchmark: what surviving a failure costs -- the stall of a checkpoint (written before going on,
or in the background), and the time a lost node costs under ``hpcsync run``.

    python bench/bench_recovery.py [--ranks 2] [--model-mib 256] [--rounds 5] [--quick]
    python bench/bench_recovery.py --failures [--quick]     (root: namespace nodes, Open MPI)

**Stall.** One mpirun job; the model is ``--model-mib`` of float32 parameters with SGD momentum
(a shared state of twice that). Rounds alternate ``Checkpoints.save()`` written before it returns
and ``save(background=True)``, each followed by a second of training-like compute
(matrix products); the table gives the stall (how long ``save`` held training up, slowest rank),
the time until rank 0's files were complete, and how much the compute slowed while the
background write ran, beside the floor: serialising the state to memory (``torch.save`` to a
buffer on rank 0). JSON: ``bench/results/checkpoint-stall.json``.

**Failures** (``--failures``). Three namespace nodes (four for a cut link: a step of three, so
that the side of two is believed), ``hpcsync run --spare-nodes 1`` with Open MPI over them,
``examples/train.py --checkpoint-every``; node 1's rank is SIGKILLed, or its link taken down,
right after a periodic checkpoint. The time lost per failure, split: detection (the
failure to the end of the failed step), relaunch (to the next step's start), restore (to the
resumed checkpoint loaded), and the work redone (the training since that checkpoint). JSON:
``bench/results/recovery.json``.
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

from common import mpirun_env, save_json

ROOT = Path(__file__).resolve().parents[1]


def _compute(seconds: float) -> int:
    """Training-like work for ``seconds``: matrix products; returns how many ran."""
    import torch

    a = torch.randn(256, 256)
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)
        n += 1
    return n


def worker(model_mib: int, rounds: int, root: str) -> None:
    import io

    import torch
    from mpi4py import MPI

    import hpcsync

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    torch.manual_seed(0)
    numel = model_mib * 2**20 // 4
    params = [torch.nn.Parameter(torch.randn(numel // 8)) for _ in range(8)]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    sum(p.sum() for p in params).backward()
    opt.step()  # momentum buffers exist: the optimizer state is as big as the model
    state = {"model": {f"p{i}": p.data for i, p in enumerate(params)}, "optimizer": opt.state_dict()}
    baseline = statistics.median(_compute(1.0) for _ in range(2))
    ckpts = hpcsync.Checkpoints(root, keep=1)
    written = {}
    write = ckpts._write

    def timed_write(*a):  # when rank 0's files are complete, on whichever thread wrote them
        path = write(*a)
        written["at"] = time.perf_counter()
        return path

    ckpts._write = timed_write
    rows = []
    for r in range(rounds):
        for mode in ("sync", "background"):
            comm.Barrier()
            t0 = time.perf_counter()
            ckpts.save(2 * r + (mode == "background"), shared=state, local={"rank": rank},
                       background=mode == "background")
            stall = time.perf_counter() - t0
            work = _compute(1.0)
            ckpts.wait()
            complete = written["at"] - t0 if rank == 0 else stall
            rows.append({"mode": mode, "stall_s": stall, "complete_s": complete, "compute_ratio": work / baseline})
    buf = io.BytesIO()
    t0 = time.perf_counter()
    torch.save(state, buf)
    serialise = time.perf_counter() - t0
    ckpts.close()
    every = comm.gather(rows, root=0)
    if rank == 0:
        out = {}
        for mode in ("sync", "background"):
            per_round = [max(rs[i]["stall_s"] for rs in every) for i in range(len(rows)) if rows[i]["mode"] == mode]
            complete = [max(rs[i]["complete_s"] for rs in every) for i in range(len(rows)) if rows[i]["mode"] == mode]
            slowed = [min(rs[i]["compute_ratio"] for rs in every) for i in range(len(rows)) if rows[i]["mode"] == mode]
            out[mode] = {"stall_s": statistics.median(per_round), "complete_s": statistics.median(complete),
                         "compute_while_writing": statistics.median(slowed)}
        out["serialise_s"] = serialise
        out["state_mib"] = len(buf.getvalue()) / 2**20
        print(json.dumps(out))


def stall(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="hpcsync-bench-ckpt-", dir=args.dir) as root:
        cmd = ["mpirun.openmpi", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-n", str(args.ranks),
               sys.executable, __file__, "--worker", str(args.model_mib), str(args.rounds), root]
        proc = subprocess.run(cmd, env=mpirun_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    s, b = res["sync"], res["background"]
    print(f"checkpoint stall, {args.ranks} ranks, state {res['state_mib']:.0f} MiB (model {args.model_mib} MiB + "
          f"momentum), median of {args.rounds} rounds")
    print(f"{'':28}{'stall s':>10}{'complete s':>12}{'compute while writing':>24}")
    print(f"{'written before going on':28}{s['stall_s']:>10.3f}{s['complete_s']:>12.3f}{'-':>24}")
    print(f"{'written in the background':28}{b['stall_s']:>10.3f}{b['complete_s']:>12.3f}"
          f"{b['compute_while_writing']:>23.2f}x")
    print(f"{'floor: serialise to memory':28}{res['serialise_s']:>10.3f}")
    print(f"background stall / synchronous stall: {b['stall_s'] / s['stall_s']:.2f}x")
    return {"ranks": args.ranks, "model_mib": args.model_mib, "rounds": args.rounds, **res}


def failures(args: argparse.Namespace) -> list:
    sys.path.insert(0, str(ROOT / "tests"))
    import test_supervisor as ts  # the harness and the supervised run of the tests
    from netns_cluster import ROUTED, Cluster

    rows = []
    base = Path(tempfile.mkdtemp(prefix="hpcsync-bench-recovery-"))
    for failure in ("kill", "link"):
        # a cut link needs three training nodes: between two, each side blames the other and
        # nothing says which failed (hpcsync run then tries the same nodes again)
        cluster = Cluster(base / failure, 3 if failure == "kill" else 4, ROUTED).start()
        try:
            work = base / f"{failure}-work"
            work.mkdir()
            every = 150 if args.quick else 300
            proc, log = ts.supervised(cluster, work, [ts.EXAMPLE, *ts.TRAIN, "--out", str(work / "out"),
                                                      "--checkpoint-dir", str(work / "ckpt"),
                                                      "--checkpoint-every", str(every)], "--spare-nodes", "1")
            ts.wait_for_checkpoint(proc, log, work / "ckpt")
            t_fail = time.time()
            ts.break_node(cluster, failure)
            proc.wait(timeout=600)
            if proc.returncode != 0:
                raise SystemExit(log.read_text()[-3000:])
            first, second = json.loads((work / "state" / "state.json").read_text())["attempts"][:2]
            row = {"failure": failure, "timeout_s": float(ts.TIMEOUT), "detection_s": first["ended"] - t_fail,
                   "relaunch_s": second["started"] - first["ended"],
                   "restore_s": second["resumed_at"] - second["started"],
                   "work_redone_s": t_fail - second["resumed_saved_at"], "resumed_step": second["resumed_step"]}
            row["lost_s"] = row["detection_s"] + row["relaunch_s"] + row["restore_s"] + row["work_redone_s"]
            rows.append(row)
        finally:
            cluster.stop()
    print(f"\ntime lost per failure, hpcsync run over Open MPI, 3 namespace nodes (4 for a link), group timeout "
          f"{ts.TIMEOUT} s")
    print(f"{'failure':10}{'detection':>11}{'relaunch':>10}{'restore':>9}{'redone':>8}{'lost':>8}")
    for r in rows:
        print(f"{r['failure']:10}{r['detection_s']:>10.1f}s{r['relaunch_s']:>9.1f}s{r['restore_s']:>8.1f}s"
              f"{r['work_redone_s']:>7.1f}s{r['lost_s']:>7.1f}s")
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--model-mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: the system's temp folder)")
    ap.add_argument("--failures", action="store_true", help="also the time lost per failure (root: namespace nodes)")
    ap.add_argument("--quick", action="store_true", help="a 16 MiB model, 2 rounds (CI)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "checkpoint-stall.json"))
    ap.add_argument("--failures-out", default=str(ROOT / "bench" / "results" / "recovery.json"))
    args = ap.parse_args()
    if args.quick:
        args.model_mib, args.rounds = 16, 2
    save_json(args.out, "stall", stall(args))
    if args.failures:
        save_json(args.failures_out, "failures", failures(args))


if __name__ == "__main__":
    main()
