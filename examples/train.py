"""A real DDP training run on hpcsync: classify points of a synthetic spiral dataset.

Runs unchanged under ``mpirun -n 16``, ``mpiexec -n 4``, ``srun --mpi=pmix``, ``torchrun`` and
plain ``python``. Uses the whole toolkit: ``hpcsync.init()``, the dataset staged onto every node's
local disk with ``hpcsync.stage`` (``--data DIR --stage-to LOCAL``), a ``DistributedSampler``,
per-rank metrics CSV joined at the end with ``SyncedFile``, predictions written with the
collective HDF5 writer, the final model from rank 0, and a summary printed by rank 0.

With ``--checkpoint-dir DIR`` it survives the end of the allocation: a signal (SIGUSR1, SIGTERM)
on any rank, or a job end time that leaves too little time, stops every rank at the same step
(``hpcsync.preemption``); the step is checkpointed (``hpcsync.Checkpoints``: model, optimizer,
epoch and batch, every rank's RNG states and partial sums), the Slurm job requeued, and the next
start resumes from it. The resumed run ends with the same weights, bit for bit, as one that was
never stopped. ``--fsdp`` shards the model over the ranks (FSDP2's ``fully_shard``) instead of
replicating it (DDP): every rank then checkpoints its own shard (``save(sharded=...)``).

    mpiexec -n 4 python examples/train.py --epochs 8 --out runs/demo
    mpiexec -n 4 python examples/train.py --data runs/spirals --stage-to /tmp/$USER/spirals
    sbatch --requeue --signal=USR1@90 jobs/slurm_pmix.sbatch     (TRAIN_ARGS="--checkpoint-dir ...")
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import itertools
import json
import logging
import math
import os
import random
import signal
import sys
import time
from typing import Any, Iterator, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Sampler, TensorDataset

import hpcsync
from hpcsync import comm

log = logging.getLogger("train")


def make_spirals(n: int, classes: int = 3, seed: int = 0) -> TensorDataset:
    """A learnable, download-free dataset: interleaved 2-D spirals, one per class."""
    rng = np.random.default_rng(seed)
    per = n // classes
    xs, ys = [], []
    for c in range(classes):
        r = np.linspace(0.05, 1.0, per)
        theta = c * 2 * math.pi / classes + r * 3.0 + rng.normal(0, 0.15, per)
        xs.append(np.stack([r * np.cos(theta), r * np.sin(theta)], axis=1))
        ys.append(np.full(per, c))
    x = torch.tensor(np.concatenate(xs), dtype=torch.float32)
    y = torch.tensor(np.concatenate(ys), dtype=torch.long)
    return TensorDataset(x, y)


def load_dataset(args: argparse.Namespace) -> TensorDataset:
    """The spirals from ``--data`` (written there by rank 0 first if missing), read from the copy
    that ``--stage-to`` puts on every node's local disk; generated in memory without ``--data``."""
    if not args.data:
        return make_spirals(args.samples)
    path = os.path.join(args.data, "spirals.npz")
    if comm.get_rank() == 0 and not os.path.exists(path):
        os.makedirs(args.data, exist_ok=True)
        x, y = make_spirals(args.samples).tensors
        np.savez(path, x=x.numpy(), y=y.numpy())
        log.info("wrote the dataset to %s", path)
    comm.synchronize()
    if args.stage_to:  # one read of the source, one copy per node, skipped when already there
        r = hpcsync.stage(args.data, args.stage_to)
        log.info("staged %s to %s on %d node(s): %d file(s) copied, %d up to date, %.2fs", r.source,
                 r.destination, r.nodes, r.copied_files, r.skipped_files, r.seconds)
        path = os.path.join(args.stage_to, "spirals.npz")
    with np.load(path) as z:
        return TensorDataset(torch.from_numpy(z["x"]), torch.from_numpy(z["y"]))


class ResumableSampler(Sampler):
    """A DistributedSampler's order for the epoch from position ``start`` on: a resumed epoch skips
    the batches it trained before the stop without loading them."""

    def __init__(self, base: DistributedSampler) -> None:
        self.base, self.start = base, 0

    def set_epoch(self, epoch: int) -> None:
        self.base.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.base), self.start, None)

    def __len__(self) -> int:
        return max(0, len(self.base) - self.start)


def rng_states() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])


def shard(model: nn.Module, topo: Any) -> nn.Module:
    """The model sharded over every rank with FSDP2: each linear layer, then the whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda" if dist.get_backend() == "nccl" else "cpu", (topo.world_size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def sharded_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """This rank's part of the model's and the optimizer's state (DTensors)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, optim = get_state_dict(model, opt)
    return {"model": weights, "optimizer": optim}


def set_sharded_state(model: nn.Module, opt: torch.optim.Optimizer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def full_weights(model: nn.Module) -> dict:
    """The whole model's weights on rank 0 (collective), from its shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--samples", type=int, default=6000, help="dataset size")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--backend", default="auto", help="auto, gloo, hpcsync, mpi, nccl")
    p.add_argument("--out", default="runs/train", help="output directory (shared by all ranks)")
    p.add_argument("--data", help="dataset directory (rank 0 must see it; created there if missing)")
    p.add_argument("--stage-to", help="node-local directory to stage --data into before training")
    p.add_argument("--checkpoint-dir", help="checkpoint here when the job is signalled or its time runs out, "
                   "requeue it under Slurm, and resume from the latest checkpoint at start")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="STEPS",
                   help="also checkpoint every STEPS steps, written in the background (needs --checkpoint-dir): "
                   "a lost node then costs at most STEPS steps under `hpcsync run`")
    p.add_argument("--checkpoint-sync", action="store_true", help="write the periodic checkpoints before going on")
    p.add_argument("--fsdp", action="store_true", help="shard the model over the ranks (FSDP2) instead of DDP; "
                   "checkpoints are then sharded: every rank writes its own part (--checkpoint-dir must be shared)")
    p.add_argument("--checkpoint-local", metavar="DIR", help="with --fsdp: write checkpoints to this node-local "
                   "folder on every node ($SLURM_TMPDIR), each rank's files copied to --replicas other nodes, and "
                   "to --checkpoint-dir every --shared-every-th save and at a stop; a lost node's ranks restore from "
                   "the copies")
    p.add_argument("--replicas", type=int, default=1, help="with --checkpoint-local: how many other nodes hold a copy")
    p.add_argument("--shared-every", type=int, default=10, metavar="K",
                   help="with --checkpoint-local: also write every K-th save to --checkpoint-dir (0: only at a stop)")
    p.add_argument("--seed", type=int, help="seed of the initial weights (default: a random one, shared)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes per rank")
    p.add_argument("--step-time", type=float, default=0.0, metavar="SECONDS",
                   help="make each step last at least this long: a slow model, to try the preemption stop by hand")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    topo = hpcsync.init(backend=args.backend)
    rank, world = topo.rank, topo.world_size
    if rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    os.makedirs(args.out, exist_ok=True)
    # same initial weights everywhere: --seed, or a seed drawn on rank 0 and shared
    torch.manual_seed(args.seed if args.seed is not None else comm.shared_random_seed())
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))

    data = load_dataset(args)
    n_val = len(data) // 5
    train, val = torch.utils.data.random_split(data, [len(data) - n_val, n_val],
                                               generator=torch.Generator().manual_seed(1))
    sampler = ResumableSampler(DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=0))
    if args.checkpoint_every and not args.checkpoint_dir:
        raise SystemExit("--checkpoint-every needs --checkpoint-dir")
    if args.checkpoint_local and not (args.fsdp and args.checkpoint_dir):
        raise SystemExit("--checkpoint-local needs --fsdp and --checkpoint-dir")
    ckpts = hpcsync.Checkpoints(args.checkpoint_dir, local_dir=args.checkpoint_local, replicas=args.replicas,
                                shared_every=args.shared_every) if args.checkpoint_dir else None
    guard = hpcsync.preemption() if ckpts else None  # records SIGUSR1 / SIGTERM; stops at an agreed step
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        worker_init_fn=guard.worker_init_fn if guard else None)
    model = nn.Sequential(nn.Linear(2, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, 3))
    ddp = shard(model, topo) if args.fsdp else nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr * world ** 0.5, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    # where training starts: the beginning, or the latest complete checkpoint (chosen by rank 0)
    saved = None
    if ckpts and args.fsdp:  # every rank reads its own shard, in place
        template = sharded_state(model, opt)
        saved = ckpts.load(sharded=template)
        if saved is not None:
            set_sharded_state(model, opt, template)
    elif ckpts:
        saved = ckpts.load()
        if saved is not None:
            model.load_state_dict(saved.shared["model"])
            opt.load_state_dict(saved.shared["optimizer"])
    start_epoch, start_batch, steps_done, history = 0, 0, 0, []
    rows: List[List[Any]] = []  # this rank's metrics rows so far (kept only with --checkpoint-dir)
    total, count = 0.0, 0
    if saved is not None:
        start_epoch, start_batch, history = saved.shared["epoch"], saved.shared["batch"], saved.shared["history"]
        steps_done = saved.step
        if saved.local is not None:
            rows, total, count = saved.local["rows"], saved.local["total"], saved.local["count"]
        else:  # a sharded checkpoint of another number of ranks: the model is resharded, the epoch starts anew
            start_batch = 0  # (its batch count was the other number of ranks')
            if rank == 0:
                log.warning("the checkpoint has another number of ranks: the model and optimizer are resharded; "
                            "the epoch, RNG states and metrics rows start anew (not an exact resume)")
        log.info("resuming at epoch %d, batch %d (step %d) from %s%s", start_epoch, start_batch, steps_done, saved.path,
                 f" (Slurm restart {os.environ['SLURM_RESTART_COUNT']})" if os.environ.get("SLURM_RESTART_COUNT") else "")
    log.info("training on %d rank(s), %d node(s), backend %s", world, topo.num_nodes,
             dist.get_backend() if dist.is_initialized() else "none")

    metrics_path = os.path.join(args.out, "metrics.csv")
    stopped: Optional[str] = None
    t0 = time.perf_counter()
    with hpcsync.SyncedFile(metrics_path, strip_header=True) as part:
        with part.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["rank", "epoch", "step", "loss"])
            writer.writerows(rows)
            for epoch in range(start_epoch, args.epochs):
                sampler.set_epoch(epoch)
                first = start_batch if epoch == start_epoch else 0
                sampler.start = first * args.batch_size
                batches = iter(loader)  # (draws a seed from torch's RNG)
                if saved is not None and saved.local is not None and epoch == start_epoch:
                    set_rng_states(saved.local["rng"])  # as they were when the checkpoint was taken
                elif first == 0:
                    total, count = 0.0, 0
                for step, (x, y) in enumerate(batches, start=first):
                    began = time.monotonic()
                    opt.zero_grad()
                    loss = loss_fn(ddp(x), y)
                    loss.backward()
                    opt.step()
                    steps_done += 1
                    row = [rank, epoch, step, f"{loss.item():.6f}"]
                    writer.writerow(row)
                    total, count = total + loss.item() * len(y), count + len(y)
                    time.sleep(max(0.0, args.step_time - (time.monotonic() - began)))
                    if guard is None:
                        continue
                    rows.append(row)
                    stop = guard.should_stop()  # True on every rank at the same step
                    if stop or (args.checkpoint_every and steps_done % args.checkpoint_every == 0):
                        # the state after this step: the resumed run goes on bit for bit; a periodic
                        # one is written in the background, a stop's before the job ends
                        with guard.checkpointing() if stop else contextlib.nullcontext():  # a stop's is timed
                            where = {"epoch": epoch, "batch": step + 1, "history": history}
                            weights = {"sharded": sharded_state(model, opt)} if args.fsdp else \
                                {"shared": {"model": model.state_dict(), "optimizer": opt.state_dict(), **where}}
                            # (node-local copies are written before save() returns; a stop's go to the root too)
                            node_local = {"to_root": stop} if args.checkpoint_local else {}
                            ckpts.save(steps_done, **weights, **({"shared": where} if args.fsdp else {}),
                                       local={"rows": rows, "total": total, "count": count, "rng": rng_states()},
                                       background=not stop and not args.checkpoint_sync and not node_local,
                                       **node_local)
                    if stop:
                        stopped = guard.reason
                        break
                if stopped:
                    break
                epoch_loss = comm.reduce_dict({"loss": total / max(count, 1)})["loss"]
                history.append(float(epoch_loss))
                log.info("epoch %d  loss %.4f", epoch, epoch_loss)
    train_time = time.perf_counter() - t0
    if guard is not None and stopped:
        if rank == 0:  # before requeue(): once a rank exits non-zero, the launcher may end the others
            print(f"stopped at step {steps_done} ({stopped}): checkpoint in {args.checkpoint_dir}", flush=True)
        outcome = guard.requeue()  # rank 0 requeues the Slurm job; outside Slurm there is nothing to do
        guard.close()
        ckpts.close()
        hpcsync.shutdown()
        sys.exit(outcome.exit_code)

    # Each rank scores its share of the validation set; predictions go to one HDF5 file.
    idx = np.array_split(np.arange(len(val)), world)[rank]
    x_val = torch.stack([val[i][0] for i in idx]) if len(idx) else torch.zeros(0, 2)
    y_val = torch.tensor([int(val[i][1]) for i in idx], dtype=torch.long)
    with torch.no_grad():  # (a sharded model's forward is collective: every rank runs it)
        pred = model(x_val).argmax(1) if len(idx) or args.fsdp else torch.zeros(0, dtype=torch.long)
    correct = comm.all_gather(int((pred == y_val).sum()))
    accuracy = sum(correct) / len(val)
    h5_path = os.path.join(args.out, "predictions.h5")
    from hpcsync import h5

    h5.write_rows(h5_path, {"x": x_val.numpy(), "label": y_val.numpy(), "pred": pred.numpy(),
                            "rank": np.full(len(idx), rank, dtype=np.int32)},
                  attrs={"accuracy": accuracy, "world_size": world})

    weights = full_weights(model) if args.fsdp else model.state_dict()  # (collective with --fsdp)
    if rank == 0:
        torch.save({"model": weights, "epochs": args.epochs}, os.path.join(args.out, "model.pt"))
        summary = {"world_size": world, "nodes": topo.num_nodes, "backend": dist.get_backend() if dist.is_initialized() else None,
                   "launcher": topo.launcher, "loss_first": history[0], "loss_last": history[-1],
                   "val_accuracy": accuracy, "train_seconds": round(train_time, 3),
                   "outputs": {"metrics": metrics_path, "predictions": h5_path,
                               "checkpoint": os.path.join(args.out, "model.pt")}}
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(f"done: {world} ranks, loss {history[0]:.3f} -> {history[-1]:.3f}, "
              f"val accuracy {accuracy:.3f}, {train_time:.1f}s; outputs in {args.out}/ "
              f"(metrics.csv, predictions.h5, model.pt, summary.json)", flush=True)
    if guard is not None:  # open until here: a late signal (training is done) is recorded, not fatal
        ckpts.close()  # a periodic checkpoint still being written
        for warning in (signal.SIGUSR1, signal.SIGUSR2):  # done: from here on a warning has nothing to stop
            signal.signal(warning, signal.SIG_IGN)  # (close() leaves a handler that is no longer its own)
        guard.close()
    hpcsync.shutdown()


if __name__ == "__main__":
    main()
