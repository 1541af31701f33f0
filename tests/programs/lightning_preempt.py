"""lightning.Trainer with hpcsync.resilience.lightning.trainer_kwargs() under Slurm: signalled, checkpointed,
requeued and resumed by Lightning itself from the hpc checkpoint.

    lightning_preempt.py ROOT

Every start of the job appends one line per rank to ``ROOT/starts.txt``: ``rank restart
checkpoint-resumed-from global-step-at-train-start``; a run that trains to the end appends
``rank done global-step``.
"""
import logging
import os
import sys
import time

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hpcsync.resilience.lightning as hl

root = sys.argv[1]
logging.basicConfig(level=logging.INFO, format="%(message)s")


def note(line):
    with open(os.path.join(root, "starts.txt"), "a") as f:
        f.write(line + "\n")


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, _):
        if os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
            time.sleep(0.06)  # the first start trains >= 48 s: a signal sent once it says "training on" finds it
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_train_start(self):
        note(f"{self.global_rank} start {os.environ.get('SLURM_RESTART_COUNT', '0')} "
             f"{os.path.basename(self.trainer.ckpt_path or '-')} {self.trainer.global_step}")
        if self.global_rank == 0:
            print(f"training on {self.trainer.world_size} ranks", flush=True)

    def on_train_epoch_end(self):
        if self.global_rank == 0:
            print(f"epoch {self.current_epoch} ", flush=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


torch.manual_seed(0)
x = torch.randn(512, 4)
y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
trainer = L.Trainer(max_epochs=100, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, default_root_dir=root, **hl.trainer_kwargs())
model = Regressor()
trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=32))
note(f"{trainer.global_rank} done {trainer.global_step}")
