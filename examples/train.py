"""A real DDP training run on hpcsync: classify points of a synthetic spiral dataset.

Runs unchanged under ``mpirun -n 16``, ``mpiexec -n 4``, ``srun --mpi=pmix``, ``torchrun`` and
plain ``python``. Uses the whole toolkit: ``hpcsync.init()``, the dataset staged onto every node's
local disk with ``hpcsync.stage`` (``--data DIR --stage-to LOCAL``), a ``DistributedSampler``,
per-rank metrics CSV joined at the end with ``SyncedFile``, predictions written with the
collective HDF5 writer, a checkpoint from rank 0, and a summary printed by rank 0.

    mpiexec -n 4 python examples/train.py --epochs 8 --out runs/demo
    mpiexec -n 4 python examples/train.py --data runs/spirals --stage-to /tmp/$USER/spirals
"""
from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

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
                 r.destination, r.nodes, len(r.copied), len(r.skipped), r.seconds)
        path = os.path.join(args.stage_to, "spirals.npz")
    with np.load(path) as z:
        return TensorDataset(torch.from_numpy(z["x"]), torch.from_numpy(z["y"]))


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
    return p.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    topo = hpcsync.init(backend=args.backend)
    rank, world = topo.rank, topo.world_size
    if rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(comm.shared_random_seed())  # same initial weights everywhere
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))

    data = load_dataset(args)
    n_val = len(data) // 5
    train, val = torch.utils.data.random_split(data, [len(data) - n_val, n_val],
                                               generator=torch.Generator().manual_seed(1))
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    model = nn.Sequential(nn.Linear(2, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, 3))
    ddp = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr * world ** 0.5, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    log.info("training on %d rank(s), %d node(s), backend %s", world, topo.num_nodes,
             dist.get_backend() if dist.is_initialized() else "none")

    metrics_path = os.path.join(args.out, "metrics.csv")
    history = []
    t0 = time.perf_counter()
    with hpcsync.SyncedFile(metrics_path, strip_header=True) as part:
        with open(part.path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["rank", "epoch", "step", "loss"])
            for epoch in range(args.epochs):
                sampler.set_epoch(epoch)
                total, count = 0.0, 0
                for step, (x, y) in enumerate(loader):
                    opt.zero_grad()
                    loss = loss_fn(ddp(x), y)
                    loss.backward()
                    opt.step()
                    writer.writerow([rank, epoch, step, f"{loss.item():.6f}"])
                    total, count = total + loss.item() * len(y), count + len(y)
                epoch_loss = comm.reduce_dict({"loss": total / max(count, 1)})["loss"]
                history.append(float(epoch_loss))
                log.info("epoch %d  loss %.4f", epoch, epoch_loss)
    train_time = time.perf_counter() - t0

    # Each rank scores its share of the validation set; predictions go to one HDF5 file.
    idx = np.array_split(np.arange(len(val)), world)[rank]
    x_val = torch.stack([val[i][0] for i in idx]) if len(idx) else torch.zeros(0, 2)
    y_val = torch.tensor([int(val[i][1]) for i in idx], dtype=torch.long)
    with torch.no_grad():
        pred = model(x_val).argmax(1) if len(idx) else torch.zeros(0, dtype=torch.long)
    correct = comm.all_gather(int((pred == y_val).sum()))
    accuracy = sum(correct) / len(val)
    h5_path = os.path.join(args.out, "predictions.h5")
    from hpcsync import h5

    h5.write_rows(h5_path, {"x": x_val.numpy(), "label": y_val.numpy(), "pred": pred.numpy(),
                            "rank": np.full(len(idx), rank, dtype=np.int32)},
                  attrs={"accuracy": accuracy, "world_size": world})

    if rank == 0:
        torch.save({"model": model.state_dict(), "epochs": args.epochs}, os.path.join(args.out, "model.pt"))
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
    hpcsync.shutdown()


if __name__ == "__main__":
    main()
