"""lightning.Trainer(min_epochs=max_epochs=60) with a validation loop, under mpirun, signalled
while it trains: the stop must win over min_epochs, skip the validation pass, and leave one
complete hpc checkpoint.

    lightning_stop.py ROOT [sharded]

``sharded``: the model is sharded with FSDP2 under Lightning's ModelParallelStrategy, whose
checkpoint is a directory every rank writes into.

Rank r writes ``ROOT/pid<r>`` once training runs; at exit each rank reports the global step
training stopped at, the validation batches run after the stop, the epochs run, and the checkpoint
folder's listing.
"""
import atexit
import logging
import os
import sys
import time

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hpcsync.resilience.lightning as hl
from _report import report

root = sys.argv[1]
sharded = sys.argv[2:] == ["sharded"]
logging.basicConfig(level=logging.INFO, format="%(message)s")
seen = {"val_after_stop": 0, "stopped_at": None, "epochs": 0}


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, _):
        time.sleep(0.02)  # 480 steps take 9.6 s at least: the signal, sent 1 s in, finds training running
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, _):
        if self.trainer.should_stop:
            seen["val_after_stop"] += 1

    def on_train_batch_end(self, *args):
        if self.trainer.should_stop and seen["stopped_at"] is None:
            seen["stopped_at"] = self.trainer.global_step

    def on_train_start(self):
        path = os.path.join(root, f"pid{self.global_rank}")
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)

    def on_train_epoch_end(self):
        seen["epochs"] += 1

    def configure_model(self):
        if sharded:
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def at_exit():
    report(trainer.global_rank, {"rank": trainer.global_rank, "world_size": trainer.world_size, **seen,
                                 "global_step": trainer.global_step, "listing": sorted(os.listdir(root))})


torch.manual_seed(0)
x = torch.randn(512, 4)
y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
kwargs = hl.trainer_kwargs()
if sharded:  # every rank a data-parallel shard
    from lightning.pytorch.strategies import ModelParallelStrategy

    kwargs["plugins"] = [kwargs["strategy"].cluster_environment]
    kwargs["strategy"] = ModelParallelStrategy(data_parallel_size=kwargs["devices"], tensor_parallel_size=1,
                                               process_group_backend=kwargs["strategy"].process_group_backend)
trainer = L.Trainer(max_epochs=60, min_epochs=60, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, default_root_dir=root, **kwargs)
atexit.register(at_exit)
loader = DataLoader(TensorDataset(x, y), batch_size=32)
trainer.fit(Regressor(), loader, loader)
