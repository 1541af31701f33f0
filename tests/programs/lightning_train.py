"""A LightningModule trained by lightning.Trainer on hpcsync (mpirun, socket-free backend)."""
import sys

import lightning as L
from lightning.fabric.utilities.rank_zero import rank_zero_only
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hpcsync.resilience.lightning as hl
from _report import report


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
        self.losses = []

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


torch.manual_seed(0)
x = torch.randn(512, 4)
y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
kwargs = hl.trainer_kwargs(backend=sys.argv[1])
rank_zero_before_fit = rank_zero_only.rank  # Lightning's own, read from no MPI variable
model = Regressor()
trainer = L.Trainer(max_epochs=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, **kwargs)
trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=32))
weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
report(trainer.global_rank, {"rank": trainer.global_rank, "world_size": trainer.world_size,
                             "backend": dist.get_backend(), "first": sum(model.losses[:8]) / 8,
                             "last": sum(model.losses[-8:]) / 8, "weights": weights,
                             "samples_seen": len(model.losses), "rank_zero_before_fit": rank_zero_before_fit})
