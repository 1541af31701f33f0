"""Benchmark: the forms of ``hpcsync.Checkpoints`` side by side in one job -- rank 0 doing all
file I/O, every rank writing its own shard (torch.distributed.checkpoint), and those shards on
node-local disks with copies on a peer node -- as the ranks grow.

    python bench/bench_checkpoint.py [--ranks 2 4 8 16 32] [--model-mib 64] [--local-kib 1024]
                                     [--repeat 3] [--per-node 4] [--backend gloo] [--quick] [--out PATH]

One mpirun job per rank count N (Open MPI, one node, ``--oversubscribe --bind-to none``). Every
rank builds the same FSDP2 model (``fully_shard`` over ``init_device_mesh("cpu", (N,))``, 4 square
bias-free Linear layers, one Adam step taken) whose whole state, parameters and Adam's two
moments, is ``--model-mib`` MiB, and a local state of ``--local-kib`` KiB of random bytes (a uint8
tensor, different on every rank). The forms save and load the same state:

- **rank0**: ``save(step, shared=FULL, local=LOCAL)`` / ``load()``. FULL is the model's full state
  dict, gathered once before timing (``get_state_dict(..., full_state_dict=True)``): every rank
  holds the whole state, as under DDP. Rank 0 writes and reads every file; the locals are gathered
  to it on save and scattered on load; FULL is broadcast on load.
- **sharded**: ``save(step, sharded=STATE, local=LOCAL)`` / ``load(sharded=STATE)``, STATE being
  ``get_state_dict(model, opt)`` (DTensors), loaded in place.

Each of ``--repeat`` rounds, per form: a save written before it returns, a ``background=True``
save (its stall: until ``save()`` returns; complete: until ``wait()`` returns, nothing running
meanwhile), and a load of that checkpoint (each rank's local checked against what it saved).
Times are the slowest rank's, the median over rounds.

Bytes received per rank on load = what it read (``rchar`` of ``/proc/self/io`` before and after
``load()``: the bytes of every read()/pread() syscall; MPI's shared-memory transfers are none, nor
are gloo's socket receives: a 1 MiB gloo broadcast adds nothing to it) plus what rank 0 sent it
over MPI (the payload sizes, from the checkpoint's files: shared.pt and that rank's rank-NNNNN.pt
for rank0; shared.pt and the COMPLETE marker for sharded; 0 on rank 0 itself). Not counted: DCP's
exchange of load plans over gloo (small; not measured). Counted: what buffered reads fetch and drop
(DCP's torch.load of each tensor re-reads its zip records in 4 KiB reads, ~0.5 MiB per rank here)
and DCP's .metadata, which every rank reads whole (~2 KB per rank of the job here). Bytes written
per rank on the synchronous save: ``wchar``. The checkpoints go to a fresh folder under /dev/shm
(RAM: the figures are the library's and the kernel's costs, not a disk's), removed after each job.
- **nodes**: the sharded form with ``local_dir`` (a folder per "node" of ``--per-node`` ranks on
  this host, each its own hostname to hpcsync; ``replicas=1``, ``shared_every=0``): saves go to
  the node folders and to the next node, written before ``save()`` returns (its "bg" columns are
  a second such save). Before each load node 1's folder is removed (its disk lost): its ranks
  fetch their shards from node 2's copies. Its load bytes are the byte ranges each rank read from
  its node's folder or received from peers (``Checkpoint.read``; none from the root, asserted),
  not what it served to others.

Prints a table; writes ``bench/results/checkpoint.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import mpirun_env, save_json

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def _io(field: str) -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def worker(args: argparse.Namespace) -> None:
    import torch
    from mpi4py import MPI
    from torch import nn

    import hpcsync

    topo = hpcsync.init(backend=args.backend, timeout=600)
    comm, rank, size = MPI.COMM_WORLD, topo.rank, topo.world_size
    import torch.distributed.checkpoint  # noqa: F401  (imported before any timing)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layers = args.layers
    dim = int((args.model_mib * MIB / 4 / 3 / layers) ** 0.5)  # params + exp_avg + exp_avg_sq, float32
    model = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (size,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, dim)).square().mean().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    sharded = {"model": msd, "optim": osd}
    fmsd, fosd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    full = {"model": fmsd, "optim": fosd}
    state_bytes = sum(t.numel() * t.element_size() for t in [*fmsd.values(), *(
        v for s in fosd["state"].values() for v in s.values())])
    gen = torch.Generator().manual_seed(1000 + rank)
    local = {"rank": rank, "bytes": torch.randint(0, 256, (args.local_kib * 1024,), dtype=torch.uint8, generator=gen)}
    ckpts = {form: hpcsync.Checkpoints(os.path.join(args.root, form), keep=1, timeout=600)
             for form in ("rank0", "sharded")}
    per = max(1, min(args.per_node, size // 2))  # "nodes" of this host: `per` ranks each, a folder each
    socket.gethostname = lambda: f"benchnode{rank // per}"  # (what node-local copies group ranks by)
    ckpts["nodes"] = hpcsync.Checkpoints(os.path.join(args.root, "nodes"), keep=1, timeout=600, replicas=1,
                                         local_dir=os.path.join(args.root, "local", f"node{rank // per}"),
                                         shared_every=0)

    def save(form, step, bg):
        if form == "rank0":
            return ckpts[form].save(step, shared=full, local=local, background=bg)
        return ckpts[form].save(step, sharded=sharded, local=local, background=bg and form != "nodes")

    def load(form):
        if form == "nodes":  # node 1's disk lost first: its ranks restore from the copies on node 2
            comm.Barrier()
            if rank == 0:
                shutil.rmtree(os.path.join(args.root, "local", "node1"))
            comm.Barrier()
        return ckpts[form].load() if form == "rank0" else ckpts[form].load(sharded=sharded)

    def timed(fn):
        comm.Barrier()
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0

    mine = {form: [] for form in ckpts}  # per round: this rank's figures
    for r in range(args.repeat):
        for form in ckpts:
            w0 = _io("wchar")
            _, save_s = timed(lambda: save(form, 2 * r, False))
            written = _io("wchar") - w0
            comm.Barrier()
            t0 = time.perf_counter()
            save(form, 2 * r + 1, True)
            stall_s = time.perf_counter() - t0
            ckpts[form].wait()
            complete_s = time.perf_counter() - t0
            load_ref_s = None
            if form != "rank0":  # the same load, its metadata parsed by the pure-Python reference (before)
                from hpcsync.resilience import dcp_reader

                fast, dcp_reader.MetadataUnpickler = dcp_reader.MetadataUnpickler, dcp_reader.ReferenceUnpickler
                try:
                    _, load_ref_s = timed(lambda: load(form))
                finally:
                    dcp_reader.MetadataUnpickler = fast
                if form == "nodes":  # (node 1's folder is gone again for the timed load below)
                    ckpts[form].save(2 * r + 1, sharded=sharded, local=local)
            r0 = _io("rchar")
            got, load_s = timed(lambda: load(form))
            read = _io("rchar") - r0
            assert torch.equal(got.local["bytes"], local["bytes"]), f"rank {rank}: {form} loaded another local state"
            sent = 0
            if form == "nodes":  # what it read for itself, what came over MPI from peers (not what it served)
                read, sent = got.read["node"], got.read["peers"]
                assert got.read["root"] == 0
            elif rank != 0:
                names = ("shared.pt", f"rank-{rank:05d}.pt") if form == "rank0" else ("shared.pt", "COMPLETE")
                sent = sum(os.path.getsize(os.path.join(got.path, n)) for n in names)
            meta = os.path.join(got.path, "sharded", ".metadata")
            mine[form].append({"save_s": save_s, "stall_s": stall_s, "complete_s": complete_s, "load_s": load_s,
                               "load_ref_s": load_ref_s, "metadata": os.path.getsize(meta) if os.path.exists(meta) else 0,
                               "read": read, "mpi": sent, "written": written})
            del got
    for c in ckpts.values():
        c.close()
    every = comm.gather(mine, root=0)
    if rank == 0:
        rows = []
        for form in ckpts:
            per = [e[form] for e in every]  # per[rank][round]
            row = {"ranks": size, "form": form}
            for k in ("save_s", "stall_s", "complete_s", "load_s", "load_ref_s"):
                if per[0][0][k] is None:
                    row[k] = None
                    continue
                rounds = [max(p[i][k] for p in per) for i in range(args.repeat)]
                row[k], row[k + "_rounds"] = statistics.median(rounds), rounds
            row["metadata_bytes"] = max(p[-1]["metadata"] for p in per)
            last = [p[-1] for p in per]
            got = [x["read"] + x["mpi"] for x in last]
            row.update(load_bytes_max=max(got), load_bytes_rank0=got[0], load_bytes_median=statistics.median(got),
                       load_read_bytes=[x["read"] for x in last], load_mpi_bytes=[x["mpi"] for x in last],
                       save_written_max=max(x["written"] for x in last), save_written_rank0=last[0]["written"])
            rows.append(row)
        with open(args.result, "w") as f:
            json.dump({"rows": rows, "state_bytes": state_bytes, "dim": dim}, f)
    hpcsync.shutdown()


def synthetic_metadata(ranks: int, tensors: int):
    """DCP's metadata of ``ranks`` x ``tensors`` chunks, as its save writes it (each tensor split
    by rows over the ranks, a chunk a rank in its own file)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                       TensorProperties, TensorStorageMetadata)

    sdm, storage = {}, {}
    for t in range(tensors):
        fqn = f"model.layers.{t}.weight"
        chunks = [ChunkStorageMetadata(torch.Size([r * 64, 0]), torch.Size([64, 1024])) for r in range(ranks)]
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([64 * ranks, 1024]), chunks)
        for r, c in enumerate(chunks):
            storage[MetadataIndex(fqn, c.offsets, r)] = _StorageInfo(f"__{r}_0.distcp", t * 262144, 262144)
    return Metadata(sdm, {k: (k,) for k in sdm}, storage, StorageMeta(), "1.0.0")


def parse_bench(chunks: int, repeat: int) -> dict:
    """A metadata of ``chunks`` chunks (1,024 ranks x chunks/1,024 tensors) parsed by the
    pure-Python reference (before), by hpcsync's guarded C unpickler (now) and by plain
    ``pickle.loads`` (no checks: the floor); best of ``repeat``, alternating."""
    import pickle

    sys.path.insert(0, str(ROOT))
    from hpcsync.resilience import dcp_reader

    data = pickle.dumps(synthetic_metadata(1024, max(1, chunks // 1024)))
    n = 1024 * max(1, chunks // 1024)
    ways = {"reference": lambda: dcp_reader.parse_metadata(data, dcp_reader.ReferenceUnpickler),
            "guarded C": lambda: dcp_reader.parse_metadata(data), "pickle.loads": lambda: pickle.loads(data)}
    best = {k: float("inf") for k in ways}
    for _ in range(repeat):
        for k, fn in ways.items():
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
    print(f"metadata parse, {n} chunks ({len(data) / 1e6:.1f} MB), best of {repeat}; load average "
          f"{os.getloadavg()[0]:.1f}")
    print("| parser | s | µs a chunk | vs reference |")
    print("|---|---|---|---|")
    for k, t in best.items():
        print(f"| {k} | {t:.3f} | {t / n * 1e6:.1f} | {best['reference'] / t:.2f}x |")
    print(flush=True)
    return {"chunks": n, "bytes": len(data), "best_s": best, "repeat": repeat, "load": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    ap.add_argument("--model-mib", type=float, default=64, help="the model's whole state: parameters + Adam's")
    ap.add_argument("--local-kib", type=int, default=1024, help="each rank's local state (random bytes)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; times are the median over them")
    ap.add_argument("--per-node", type=int, default=4, help="ranks per node of the node-local form (at most half)")
    ap.add_argument("--backend", default="gloo", help="hpcsync.init's backend (torch.distributed's, for FSDP2 and DCP)")
    ap.add_argument("--layers", type=int, default=4, help="Linear layers of the model (tensors: 3 a layer with Adam's)")
    ap.add_argument("--metadata-chunks", type=int, default=51200, help="chunks of the synthetic metadata parsed")
    ap.add_argument("--parse-repeat", type=int, default=5, help="the metadata parse: best of this many")
    ap.add_argument("--quick", action="store_true", help="CI smoke run: 2 and 4 ranks, a 2 MiB model, 2 rounds")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "checkpoint.json"))
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.ranks, args.model_mib, args.repeat = [2, 4], 2, 2
    parse = parse_bench(args.metadata_chunks, args.parse_repeat)
    env = mpirun_env(OMP_NUM_THREADS="1", OMPI_MCA_mpi_yield_when_idle="1")
    rows, started = [], time.perf_counter()
    print(f"model state {args.model_mib:g} MiB (params + Adam), local {args.local_kib} KiB per rank, backend "
          f"{args.backend}, median of {args.repeat}; load bytes per rank = file reads + MPI from rank 0 (MiB)")
    print("| ranks | form | save s | bg stall s | bg complete s | load s | load s, reference parser | ratio | "
          "metadata KiB | load MiB max | rank 0 | median | save written MiB max | job s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n in args.ranks:
        root = tempfile.mkdtemp(prefix="hpcsync-bench-checkpoint-", dir="/dev/shm")
        try:
            result = os.path.join(root, "result.json")
            cmd = ["mpirun.openmpi", "--oversubscribe", "--bind-to", "none", "-n", str(n), sys.executable, __file__,
                   "--worker", "--root", root, "--result", result, "--model-mib", str(args.model_mib),
                   "--local-kib", str(args.local_kib), "--repeat", str(args.repeat), "--backend", args.backend,
                   "--per-node", str(args.per_node), "--layers", str(args.layers)]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  timeout=1800)
            job_s = time.perf_counter() - t0
            if proc.returncode != 0 or not os.path.exists(result):
                raise SystemExit(f"benchmark job with {n} ranks failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
            with open(result) as f:
                res = json.load(f)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        for row in res["rows"]:
            row.update(state_mib=res["state_bytes"] / MIB, job_s=job_s)
            rows.append(row)
            ref = row["load_ref_s"]
            ratio = "—" if ref is None else f"{ref / row['load_s']:.2f}"
            print(f"| {n} | {row['form']} | {row['save_s']:.3f} | {row['stall_s']:.3f} | {row['complete_s']:.3f} | "
                  f"{row['load_s']:.3f} | {'—' if ref is None else f'{ref:.3f}'} | "
                  f"{ratio} | {row['metadata_bytes'] / 1024:.0f} | "
                  f"{row['load_bytes_max'] / MIB:.1f} | {row['load_bytes_rank0'] / MIB:.1f} | "
                  f"{row['load_bytes_median'] / MIB:.1f} | {row['save_written_max'] / MIB:.1f} | {job_s:.0f} |",
                  flush=True)
    print(f"total {time.perf_counter() - started:.0f} s")
    save_json(args.out, "rows", rows, parse=parse, layers=args.layers, model_mib=args.model_mib,
              local_kib=args.local_kib, repeat=args.repeat,
              backend=args.backend, checkpoint_dir="/dev/shm (tmpfs)")


if __name__ == "__main__":
    main()
