"""Benchmark: the hpcsync backend vs gloo vs raw mpi4py vs the memory limit, and DDP step time.

    python bench/bench_backend.py [--ranks 2 4] [--mpi openmpi mpich] [--quick] [--baseline DIR]

Every rank runs, in one job and side by side: each collective on the hpcsync group and on a gloo
group, the same MPI call with mpi4py on numpy (the MPI limit), and one ``np.add`` over the same
bytes (the memory limit). Sizes are per-rank message bytes (all_gather: the gathered output;
reduce_scatter: the input). Time per call = the slowest rank's mean over the iterations, best of
``--rounds`` interleaved rounds (hpcsync, gloo, mpi4py, hpcsync, ...): this 2-core VM is noisy.
Then DDP training steps of an MLP and a small CNN on each backend. One job per MPI library and
rank count; at the end one table of the backend's targets over all of them (:data:`TARGETS`).
``--baseline DIR``: a checkout of another commit whose backend runs as a second group in the same
jobs, interleaved with this one ("before" and "after" in one run). ``--anchors``: more rows per
collective that tell what hpcsync's own code costs from what the memory, torch's dispatch and
the agreement cost: raw mpi4py on the torch tensors' own memory ("raw on torch"); that call after
the 16-byte ``Allreduce`` hpcsync makes before each call ("raw + agreement": the floor of any
design that agrees first); that call with the same reduction started non-blocking before it and
waited for after it ("raw + agreement beside"); and that call through torch's ``dist.*`` into the
thinnest Python backend (:mod:`floors`), without and with the agreement ("thin backend",
"thin + agreement"). The last four make the MPI call hpcsync makes with this MPI (the
non-blocking form then ``Wait`` where hpcsync takes it). Prints tables, writes
``bench/results/backend.json`` and ``bench/results/backend.png``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import floors
from common import mpirun_env, save_json

ROOT = Path(__file__).resolve().parents[1]
SIZES = [4, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
QUICK_SIZES = [4, 4 << 10, 1 << 20, 16 << 20]
OPS = ["all_reduce", "all_gather", "broadcast", "reduce_scatter"]
REPEATS = 3  # hpcsync, gloo, mpi4py measured in turn this many times; each keeps its best
# (ops, smallest size, goal): hpcsync's speed as a fraction of raw mpi4py's (raw time / hpcsync
# time) for these collectives at these sizes and up; and the 4 KiB all_reduce's time, times raw.
TARGETS = ((("all_reduce", "all_gather", "broadcast"), 1 << 20, 0.9),)
SMALL_TARGET = 3.0


def _load_baseline(path: str) -> None:
    """Register the backend of the checkout at ``path`` as ``hpcsync_base`` (its package copied
    under that name, so both trees live in one process)."""
    import importlib
    import shutil
    import tempfile

    import torch.distributed as dist

    import atexit

    rdzv = importlib.import_module("torch.distributed.rendezvous")  # dist.rendezvous is a function

    tmp = tempfile.mkdtemp(prefix="hpcsync-baseline-")
    atexit.register(shutil.rmtree, tmp, True)
    shutil.copytree(Path(path) / "hpcsync", Path(tmp) / "hpcsync_base")
    sys.path.insert(0, tmp)
    register = rdzv.register_rendezvous_handler

    def tolerant(scheme, handler):  # "hpcsync://" is this tree's already
        try:
            register(scheme, handler)
        except RuntimeError:
            pass

    rdzv.register_rendezvous_handler = tolerant
    try:
        base = importlib.import_module("hpcsync_base.backend")
    finally:
        rdzv.register_rendezvous_handler = register
    dist.Backend.register_backend("hpcsync_base", base._create, extended_api=True, devices=["cpu"])


def worker(quick: bool, parts: str) -> None:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    import numpy as np
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    from torch import nn

    import hpcsync

    torch.set_num_threads(1)
    topo = hpcsync.init(backend="gloo", timeout=600)
    R, W = topo.rank, topo.world_size
    ours = dist.new_group(list(range(W)), backend="hpcsync")
    gloo = dist.new_group(list(range(W)), backend="gloo")
    baseline = os.environ.get("BENCH_BASELINE")
    if baseline:
        _load_baseline(baseline)
    base = dist.new_group(list(range(W)), backend="hpcsync_base") if baseline else None
    rounds = int(os.environ.get("BENCH_ROUNDS", REPEATS))
    comm = MPI.COMM_WORLD.Dup()
    anchors = bool(os.environ.get("BENCH_ANCHORS"))
    agree_comm, agree_buf = comm.Dup(), np.zeros(2, dtype=np.int64)

    def agree():
        """The agreement hpcsync makes before each call: one 16-byte MAX Allreduce."""
        agree_comm.Allreduce(MPI.IN_PLACE, agree_buf, op=MPI.MAX)

    def agreed(call):
        def run():
            agree()
            call()
        return run

    def beside(call):
        """``call`` with the agreement beside it instead: started non-blocking first, waited for after."""
        def run():
            req = agree_comm.Iallreduce(MPI.IN_PLACE, agree_buf, op=MPI.MAX)
            call()
            req.Wait()
        return run

    floors.register()
    from hpcsync.backend.engine import _nonblocking_fast

    hpcsync_nb = _nonblocking_fast()  # the MPI calls hpcsync makes non-blocking (then Wait) with this MPI
    if anchors:  # the thinnest Python backends through torch's dispatch: without, then with the agreement
        thin, thin_agreed = (dist.new_group(list(range(W)), backend="thin") for _ in range(2))
        thin_agreed.agree = agree

    rows = []
    ddp_only = parts == "ddp"
    coll_only = parts == "collectives"
    no_ddp = parts in ("collectives", "no-ddp")

    def timed(fn, nbytes):
        iters = max(3, min(300, int((2e8 if not quick else 3e7) / max(nbytes, 1))))
        for _ in range(2):
            fn()
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        comm.Barrier()
        return comm.allreduce((time.perf_counter() - t0) / iters, op=MPI.MAX)

    # torch 2.13's names (the *_into_tensor / *_tensor ones are deprecated: each call pays a warning)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    sizes = [int(b) for b in os.environ["BENCH_SIZES"].split(",")] if os.environ.get("BENCH_SIZES") else (
        QUICK_SIZES if quick else SIZES)
    for nbytes in ([] if ddp_only else sizes):
        n = max(1, nbytes // 4)
        x = torch.ones(n)
        xn = np.ones(n, dtype=np.float32)
        part = max(1, n // W)
        g_out = torch.empty(part * W)
        g_in = torch.ones(part)
        gn_out = np.empty(part * W, dtype=np.float32)
        gn_in = np.ones(part, dtype=np.float32)
        rs_in = torch.ones(part * W)
        rs_out = torch.empty(part)
        rsn_in = np.ones(part * W, dtype=np.float32)
        rsn_out = np.empty(part, dtype=np.float32)
        a, b, c = np.ones(n, np.float32), np.ones(n, np.float32), np.empty(n, np.float32)
        mem = timed(lambda: np.add(a, b, out=c), nbytes)
        impls = {
            "all_reduce": {
                "hpcsync": lambda: dist.all_reduce(x, group=ours),
                "gloo": lambda: dist.all_reduce(x, group=gloo),
                "mpi4py": lambda: comm.Allreduce(MPI.IN_PLACE, xn),
            },
            "all_gather": {
                "hpcsync": lambda: all_gather(g_out, g_in, group=ours),
                "gloo": lambda: all_gather(g_out, g_in, group=gloo),
                "mpi4py": lambda: comm.Allgather(gn_in, gn_out),
            },
            "broadcast": {
                "hpcsync": lambda: dist.broadcast(x, src=0, group=ours),
                "gloo": lambda: dist.broadcast(x, src=0, group=gloo),
                "mpi4py": lambda: comm.Bcast(xn, root=0),
            },
            "reduce_scatter": {
                "hpcsync": lambda: reduce_scatter(rs_out, rs_in, group=ours),
                "gloo": lambda: reduce_scatter(rs_out, rs_in, group=gloo),
                "mpi4py": lambda: comm.Reduce_scatter_block(rsn_in, rsn_out),
            },
        }
        if os.environ.get("BENCH_NO_GLOO"):
            for fns in impls.values():
                del fns["gloo"]
        if anchors:  # raw on torch's own memory; the floors make the very MPI call hpcsync makes
            xt, gt_in, gt_out, rst_in, rst_out = x.numpy(), g_in.numpy(), g_out.numpy(), rs_in.numpy(), rs_out.numpy()
            raw_torch = {"all_reduce": lambda: comm.Allreduce(MPI.IN_PLACE, xt),
                         "all_gather": lambda: comm.Allgather(gt_in, gt_out),
                         "broadcast": lambda: comm.Bcast(xt, root=0),
                         "reduce_scatter": lambda: comm.Reduce_scatter_block(rst_in, rst_out)}
            nonblocking = {"all_gather": ("Allgather", lambda: comm.Iallgather(gt_in, gt_out).Wait()),
                           "broadcast": ("Bcast", lambda: comm.Ibcast(xt, root=0).Wait()),
                           "reduce_scatter": ("Reduce_scatter_block",
                                              lambda: comm.Ireduce_scatter_block(rst_in, rst_out).Wait())}
            as_hpcsync = {op: nonblocking[op][1] if op in nonblocking and nonblocking[op][0] in hpcsync_nb else call
                          for op, call in raw_torch.items()}
            floors.Thin.calls = as_hpcsync
            through = {"all_reduce": lambda g: dist.all_reduce(x, group=g),
                       "all_gather": lambda g: all_gather(g_out, g_in, group=g),
                       "broadcast": lambda g: dist.broadcast(x, src=0, group=g),
                       "reduce_scatter": lambda g: reduce_scatter(rs_out, rs_in, group=g)}
            for op, call in as_hpcsync.items():
                impls[op]["raw on torch"] = raw_torch[op]
                impls[op]["raw + agreement"] = agreed(call)
                impls[op]["raw + agreement beside"] = beside(call)
                impls[op]["thin backend"] = lambda f=through[op]: f(thin)
                impls[op]["thin + agreement"] = lambda f=through[op]: f(thin_agreed)
        if base is not None:
            impls["all_reduce"]["baseline"] = lambda: dist.all_reduce(x, group=base)
            impls["all_gather"]["baseline"] = lambda: all_gather(g_out, g_in, group=base)
            impls["broadcast"]["baseline"] = lambda: dist.broadcast(x, src=0, group=base)
            impls["reduce_scatter"]["baseline"] = lambda: reduce_scatter(rs_out, rs_in, group=base)
        for op, fns in impls.items():
            row = {"op": op, "bytes": nbytes, "np.add": mem}
            for _ in range(1 if quick else rounds):  # interleaved rounds; the best of each is kept
                for name, fn in fns.items():
                    if f"{name}_error" in row:
                        continue
                    try:
                        t = timed(fn, nbytes)
                        row[name] = min(t, row.get(name) or t)
                    except Exception as exc:  # noqa: BLE001  e.g. gloo lacking an op
                        row[name] = None
                        row[f"{name}_error"] = str(exc).splitlines()[0][:120]
            rows.append(row)
            if R == 0:
                print(f"  {op:15s} {nbytes:>10d} B  " + "  ".join(
                    f"{k}={v * 1e6:9.1f}us" for k, v in row.items()
                    if k in ("hpcsync", "baseline", "gloo", "mpi4py", "raw on torch", "raw + agreement",
                             "raw + agreement beside", "thin backend", "thin + agreement", "np.add")
                    and v),
                    flush=True)

    # DDP steps: same model, same data, each backend
    def ddp_steps(make_model, make_batch, group, steps, sync=True):
        """Mean step time (slowest rank); sync=False: the same steps under no_sync() -- DDP's hooks
        run but no gradient is communicated: the floor that overlap can reach."""
        import contextlib

        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(make_model(), process_group=group)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = make_batch()

        def step():
            opt.zero_grad()
            with contextlib.nullcontext() if sync else model.no_sync():
                nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        for _ in range(3):
            step()
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        comm.Barrier()
        return comm.allreduce((time.perf_counter() - t0) / steps, op=MPI.MAX)

    models = {
        "MLP 1024-1024-10, batch 32": (lambda: nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)),
                                       lambda: (torch.randn(32, 1024), torch.randint(0, 10, (32,)))),
        "CNN conv16-conv32-fc, 32x32, batch 32": (
            lambda: nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                  nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                                  nn.Linear(32 * 8 * 8, 10)),
            lambda: (torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,)))),
        "CNN conv64-conv128-conv128-fc, 32x32, batch 64 (compute-heavy)": (
            lambda: nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(),
                                  nn.MaxPool2d(2), nn.Conv2d(128, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                  nn.Flatten(), nn.Linear(128 * 8 * 8, 10)),
            lambda: (torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,)))),
    }
    # What the safety nets cost per call (4 KiB all_reduce), side by side: groups made with the
    # desync check off, the default (flight record + 16-byte fingerprint Iallreduce) and debug mode
    # (full all-gathered agreement before each call); plus the flight record alone, in-process.
    checks = {}
    if not (ddp_only or coll_only):
        x4k, x4n = torch.ones(1024), np.ones(1024, dtype=np.float32)
        noop = dist.new_group(list(range(W)), backend="noop")
        calls = {"no-op ProcessGroup (floor)": lambda: dist.all_reduce(x4k, group=noop)}
        for mode, var in (("check off", ("HPCSYNC_DESYNC_CHECK", "0")), ("default", None),
                          ("debug", ("HPCSYNC_DEBUG", "1"))):
            if var:
                os.environ[var[0]] = var[1]
            g = dist.new_group(list(range(W)), backend="hpcsync")
            if var:
                del os.environ[var[0]]
            calls[mode] = lambda g=g: dist.all_reduce(x4k, group=g)
        if base is not None:
            calls["default (baseline)"] = lambda: dist.all_reduce(x4k, group=base)
        calls["mpi4py (raw)"] = lambda: comm.Allreduce(MPI.IN_PLACE, x4n)
        if anchors:
            x4t = x4k.numpy()
            calls["raw on torch"] = lambda: comm.Allreduce(MPI.IN_PLACE, x4t)
            calls["raw + agreement"] = agreed(lambda: comm.Allreduce(MPI.IN_PLACE, x4t))
            calls["raw + agreement beside"] = beside(lambda: comm.Allreduce(MPI.IN_PLACE, x4t))
            floors.Thin.calls = {"all_reduce": lambda: comm.Allreduce(MPI.IN_PLACE, x4t)}
            calls["thin backend"] = lambda: dist.all_reduce(x4k, group=thin)
            calls["thin + agreement"] = lambda: dist.all_reduce(x4k, group=thin_agreed)
        for _ in range(1 if quick else rounds):
            for mode, fn in calls.items():
                t = timed(fn, 4096 * 20)
                checks[mode] = min(t, checks.get(mode, t))
        from hpcsync.observe import watchdog
        from hpcsync.backend.desync import Call, describe

        glog = watchdog.GroupLog("bench", list(range(W)))
        t0 = time.perf_counter()
        for _ in range(100000):
            describe(glog.start("all_reduce", str(x4k.dtype), tuple(x4k.shape), -1), Call("all_reduce", x4k))
        checks["flight record alone"] = (time.perf_counter() - t0) / 100000
        if R == 0 and checks:
            print("  4 KiB all_reduce: " + "  ".join(f"{k}={v * 1e6:.1f}us" for k, v in checks.items()), flush=True)

    ddp = []
    for name, (mk, batch) in ({} if no_ddp else models).items():
        steps = 3 if quick else 20 if "heavy" not in name else 8
        row = {"model": name}
        for _ in range(1 if quick else 2):  # interleaved rounds, best kept
            for label, group in (("hpcsync", ours), ("gloo", gloo)):
                for key, sync in ((label, True), (f"{label} no_sync", False)):
                    t = ddp_steps(mk, batch, group, steps, sync=sync)
                    row[key] = min(t, row.get(key, t))
        ddp.append(row)
        if R == 0:
            print(f"  DDP {name}: " + "  ".join(f"{k}={fmt_time(v)}" for k, v in row.items() if k != "model"), flush=True)
    if R == 0:
        print(json.dumps({"world_size": W, "mpi": os.environ.get("BENCH_MPI", "openmpi"),
                          "mpi_library": MPI.Get_library_version().splitlines()[0][:60],
                          "binding": os.environ.get("BENCH_BINDING", "none"),
                          "nodes": int(os.environ.get("BENCH_NODES", "1")), "collectives": rows,
                          "ddp": ddp, "checks": checks}))
    hpcsync.shutdown()


def fmt_time(s):
    return "-" if s is None else (f"{s * 1e6:.1f} µs" if s < 1e-3 else f"{s * 1e3:.2f} ms")


def targets(results):
    """One row per target and run: (MPI, ranks, measure, goal, figure, baseline's figure or None, met,
    the figure against raw on torch's memory, against raw + agreement, and what the thinnest
    agree-first backend reaches on the same measure; None where not measured)."""
    rows = []
    for res in results:
        lib, W = res.get("mpi", "openmpi"), res["world_size"]
        for ops, smallest, goal in TARGETS:
            for r in res["collectives"]:
                if r["op"] in ops and r["bytes"] >= smallest and r.get("hpcsync") and r.get("mpi4py"):
                    was = r["mpi4py"] / r["baseline"] if r.get("baseline") else None
                    fig = r["mpi4py"] / r["hpcsync"]
                    rows.append((lib, W, f"{r['op']} {human(r['bytes'])}, × raw speed", f"≥ {goal}", fig, was,
                                 fig >= goal, ratio_of(r.get("raw on torch"), r["hpcsync"]),
                                 ratio_of(r.get("raw + agreement"), r["hpcsync"]),
                                 ratio_of(r["mpi4py"], r.get("thin + agreement"))))
        c = res.get("checks") or {}
        if c.get("default") and c.get("mpi4py (raw)"):
            raw = c["mpi4py (raw)"]
            was = c["default (baseline)"] / raw if c.get("default (baseline)") else None
            fig = c["default"] / raw
            rows.append((lib, W, "all_reduce 4 KiB, time × raw", f"≤ {SMALL_TARGET}", fig, was, fig <= SMALL_TARGET,
                         ratio_of(c["default"], c.get("raw on torch")), ratio_of(c["default"], c.get("raw + agreement")),
                         ratio_of(c.get("thin + agreement"), raw)))
    return rows


def report(results, out_json, out_png):
    lines = []
    for res in results:
        W = res["world_size"]
        base = any(r.get("baseline") for r in res["collectives"])
        lines.append(f"\n### {W} ranks on {res.get('nodes', 1)} node(s), {res.get('mpi', 'openmpi')}, "
                     f"--bind-to {res.get('binding', 'none')}\n")
        lines.append("| op | size | hpcsync | gloo | mpi4py | np.add | hpcsync GB/s | × gloo | × mpi4py |"
                     + (" baseline | baseline × mpi4py |" if base else ""))
        lines.append("|---|---|---|---|---|---|---|---|---|" + ("---|---|" if base else ""))
        for r in res["collectives"]:
            o, g, m, b = r.get("hpcsync"), r.get("gloo"), r.get("mpi4py"), r.get("baseline")
            bw = f"{r['bytes'] / o / 1e9:.2f}" if o else "-"
            lines.append(f"| {r['op']} | {human(r['bytes'])} | {fmt_time(o)} | {fmt_time(g)} | {fmt_time(m)} | "
                         f"{fmt_time(r['np.add'])} | {bw} | {ratio(g, o)} | {ratio(m, o)} |"
                         + (f" {fmt_time(b)} | {ratio(m, b)} |" if base else ""))
        if res["ddp"]:
            lines.append("\n| DDP step | hpcsync | no_sync (floor) | hpcsync / floor | gloo | gloo no_sync "
                         "| gloo / floor | hpcsync / gloo |")
            lines.append("|---|---|---|---|---|---|---|---|")
            for d in res["ddp"]:
                o, of, g, gf = d["hpcsync"], d["hpcsync no_sync"], d["gloo"], d["gloo no_sync"]
                lines.append(f"| {d['model']} | {fmt_time(o)} | {fmt_time(of)} | {o / of:.2f} | {fmt_time(g)} | "
                             f"{fmt_time(gf)} | {g / gf:.2f} | {o / g:.2f} |")
        if res.get("checks"):
            lines.append("\n| 4 KiB all_reduce, hpcsync | " + " | ".join(res["checks"]) + " |")
            lines.append("|---|" + "---|" * len(res["checks"]))
            lines.append("| time per call | " + " | ".join(fmt_time(v) for v in res["checks"].values()) + " |")
    rows = targets(results)
    if rows:
        base = any(r[5] is not None for r in rows)
        anchored = any(r[7] is not None for r in rows)
        lines.append("\n### Targets\n")
        lines.append("| MPI | ranks | measure | goal | figure |" + (" baseline |" if base else "") + " met |"
                     + (" same against raw on torch | against raw + agreement | thinnest agree-first backend |"
                        if anchored else ""))
        lines.append("|---|---|---|---|---|" + ("---|" if base else "") + "---|" + ("---|---|---|" if anchored else ""))
        for lib, W, what, goal, fig, was, met, torch_fig, agreed_fig, thin_fig in rows:
            lines.append(f"| {lib} | {W} | {what} | {goal} | {fig:.2f} |"
                         + ((f" {was:.2f} |" if was is not None else " - |") if base else "")
                         + f" {'yes' if met else 'no'} |"
                         + (f" {ratio(torch_fig, 1)} | {ratio(agreed_fig, 1)} | {ratio(thin_fig, 1)} |"
                            if anchored else ""))
    print("\n".join(lines))
    save_json(out_json, "results", results, targets=[dict(zip(("mpi", "ranks", "measure", "goal", "figure",
                                                                "baseline", "met", "against raw on torch",
                                                                "against raw + agreement", "thin + agreement"), r))
                                                   for r in rows])
    try:
        plot(results, out_png)
    except ImportError:
        print("(matplotlib not installed: no plot)")
    print(f"wrote {out_png}")


def ratio(a, b):
    return f"{a / b:.2f}" if a and b else "-"


def ratio_of(a, b):
    return a / b if a and b else None


def human(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:g} {unit}"
        n /= 1024
    return f"{n:g} TiB"


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in results if r["collectives"]]
    fig, axes = plt.subplots(len(results), len(OPS), figsize=(4.2 * len(OPS), 3.4 * len(results)), squeeze=False)
    for i, res in enumerate(results):
        for j, op in enumerate(OPS):
            ax = axes[i][j]
            rows = [r for r in res["collectives"] if r["op"] == op]
            for name, style in (("hpcsync", "o-"), ("gloo", "s--"), ("mpi4py", "^:"), ("np.add", "k-")):
                pts = [(r["bytes"], r["bytes"] / r[name] / 1e9) for r in rows if r.get(name)]
                if pts:
                    ax.plot(*zip(*pts), style, label=name, linewidth=1 if name == "np.add" else 1.5)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{op}, {res['world_size']} ranks")
            ax.set_xlabel("bytes")
            ax.set_ylabel("GB/s")
            ax.grid(True, which="both", alpha=0.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--quick", action="store_true", help="CI smoke run: 2 ranks, sizes up to 16 MiB")
    ap.add_argument("--bind-core", action="store_true",
                    help="also run the DDP part under mpirun --bind-to core (ranks that fit the cores)")
    ap.add_argument("--sizes", type=int, nargs="+", help="message sizes in bytes (default: 4 B - 256 MiB)")
    ap.add_argument("--parts", choices=["all", "collectives", "no-ddp"], default="all",
                    help="collectives: skip the DDP and per-call-check parts (scaling curves); no-ddp: skip DDP")
    ap.add_argument("--mpi", choices=["openmpi", "mpich"], nargs="+", default=["openmpi"],
                    help="the MPI libraries (one job each): Debian's Open MPI (mpirun), the venv's MPICH (mpiexec)")
    ap.add_argument("--rounds", type=int, default=REPEATS, help="interleaved rounds; each figure is the best")
    ap.add_argument("--baseline", help="a checkout of another commit: its backend measured beside this one")
    ap.add_argument("--no-gloo", action="store_true", help="collectives: hpcsync and raw mpi4py only (more rounds "
                    "in the same time)")
    ap.add_argument("--anchors", action="store_true", help="collectives: also raw mpi4py on the torch tensors' "
                    "memory, and that after the 16-byte agreement hpcsync makes before each call")
    ap.add_argument("--nodes", type=int, default=1,
                    help="spread the ranks over this many network-namespace nodes (needs root; TCP between them)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "backend.json"))
    args = ap.parse_args()
    if args.worker:
        worker(bool(os.environ.get("BENCH_QUICK")), os.environ.get("BENCH_PARTS", "all"))
        return
    if args.quick:
        args.ranks = [2]
    env = mpirun_env(OMP_NUM_THREADS="1", BENCH_ROUNDS=str(args.rounds), **({"BENCH_QUICK": "1"} if args.quick else {}),
                     **({"BENCH_SIZES": ",".join(map(str, args.sizes))} if args.sizes else {}),
                     **({"BENCH_BASELINE": str(Path(args.baseline).resolve())} if args.baseline else {}),
                     **({"BENCH_NO_GLOO": "1"} if args.no_gloo else {}),
                     **({"BENCH_ANCHORS": "1"} if args.anchors else {}))
    runs = [(mpi, n, "none") for mpi in args.mpi for n in args.ranks]
    if args.bind_core:
        runs += [(mpi, n, "core") for mpi in args.mpi for n in args.ranks if n <= (os.cpu_count() or 1)]
    cluster = None
    if args.nodes > 1:  # namespace nodes on this machine (root): TCP between them, as across racks
        import tempfile

        sys.path.insert(0, str(ROOT / "tests"))
        from netns_cluster import BRIDGED, Cluster

        cluster = Cluster(Path(tempfile.mkdtemp(prefix="hpcsync-nodes-")), args.nodes, BRIDGED)
        cluster.start()
    results = []
    try:
        for mpi, n, binding in runs:
            print(f"{mpi}, {n} ranks, {args.nodes} node(s), --bind-to {binding}:", flush=True)
            run_env = {**env, "BENCH_BINDING": binding, "BENCH_NODES": str(args.nodes), "BENCH_MPI": mpi,
                       "BENCH_PARTS": "ddp" if binding != "none" else args.parts}
            if mpi == "mpich":  # mpi4py loads the venv's libmpi.so.12 when MPI4PY_MPIABI is unset
                run_env.pop("MPI4PY_MPIABI", None)
            if cluster is not None:
                lau = cluster.openmpi([n // args.nodes] * args.nodes, "round-robin")
                run_env.update(lau.env)
                cmd = [*lau.command(n, run_env), sys.executable, __file__, "--worker"]
            elif mpi == "mpich":
                cmd = [str(Path(sys.executable).parent / "mpiexec"), "-bind-to", binding, "-n", str(n),
                       sys.executable, __file__, "--worker"]
            else:
                cmd = ["mpirun.openmpi", *(["--oversubscribe"] if binding == "none" else []), "--bind-to", binding,
                       "-n", str(n), sys.executable, __file__, "--worker"]
            proc = subprocess.run(cmd, env=run_env, stdout=subprocess.PIPE, text=True, timeout=3000)
            if proc.returncode != 0:
                raise SystemExit(f"benchmark job with {n} ranks failed (rc={proc.returncode})")
            lines = proc.stdout.strip().splitlines()
            print("\n".join(lines[:-1]))
            results.append(json.loads(lines[-1]))
    finally:
        if cluster is not None:
            cluster.stop()
    report(results, args.out, str(Path(args.out).with_suffix(".png")))


if __name__ == "__main__":
    main()
