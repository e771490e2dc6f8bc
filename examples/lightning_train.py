"""PyTorch Lightning with tm-launch's live failover: the one change is the strategy.

    torchrun --standalone --nproc-per-node 2 examples/lightning_train.py
    tm-launch --standalone --nproc-per-node 2 examples/lightning_train.py
    tm-launch --nnodes 2 --nproc-per-node 8 --rdzv-backend etcd-v3 \\
        --rdzv-endpoint ETCD_HOST:2379 --rdzv-id my-run examples/lightning_train.py

``LiveStrategy`` makes each of Lightning's optimizer steps a live step: when a rank fails, a
spare takes its place, receives Lightning's checkpoint from a survivor in memory and resumes
mid-epoch, and the step that failed runs again on the same batch. Under torchrun (and in
restart mode) it is Lightning's ``DDPStrategy``. Live needs automatic optimization, one
optimizer step per batch and a map-style dataset (or a loader with a ``state_dict``); anything
else runs in restart mode, and the log says why.
"""

import argparse
import os

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from tm_launch.lightning import LiveStrategy


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True)  # a collective inside the step: fine
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()

    pl.seed_everything(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1024, 20, generator=g)
    data = TensorDataset(x, x[:, :4].sum(dim=1, keepdim=True).sin())
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    trainer = pl.Trainer(
        strategy=LiveStrategy(),
        accelerator="cpu",
        devices=per_node,
        num_nodes=int(os.environ.get("WORLD_SIZE", 1)) // per_node,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(Regressor(), DataLoader(data, batch_size=32, shuffle=True))
    if trainer.is_global_zero:
        print(f"trained {args.epochs} epochs; last loss {trainer.callback_metrics['loss'].item():.6f}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()  # as torchrun scripts end: not left to the interpreter's teardown


if __name__ == "__main__":
    main()
