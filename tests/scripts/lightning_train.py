"""A PyTorch Lightning job with tm-launch's live failover: the only change to a Lightning script is
the strategy, ``Trainer(strategy=LiveStrategy())`` (``tm_launch.lightning``).

    tm-launch --nnodes 2 --nproc-per-node 1 --rdzv-backend etcd-v3 ... tests/scripts/lightning_train.py
    torchrun --standalone --nproc-per-node 2 tests/scripts/lightning_train.py --strategy ddp   # the same job

The model has dropout (per-rank random numbers), the loss is logged with ``sync_dist=True``
(a collective inside the step) and all-reduced again after the optimizer step (a collective
after the commit), the LR follows a per-step scheduler, and the loader shuffles (Lightning's
DistributedSampler). Deterministic on CPU: with a worker killed at any phase of a step, every
rank ends with exactly the parameters of the run without the failure (``--out-dir``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
from faults import kill_once  # noqa: E402  (tests/scripts/faults.py, beside this script)

from tm_launch.lightning import LiveStrategy  # noqa: E402

PHASES = ("forward", "backward", "optimizer", "logged")


class Model(pl.LightningModule):
    def __init__(self, lr: float = 0.05, bn: bool = False):
        super().__init__()
        norm = [torch.nn.BatchNorm1d(32)] if bn else []
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), *norm, torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 4))
        self.lr = lr
        self.faults = None

    def on_train_batch_start(self, batch, batch_idx):
        a = self.faults
        if a and a.pause_file and self.global_step == a.pause_step:  # every rank holds until the file exists
            while not os.path.exists(a.pause_file):
                time.sleep(0.02)

    def on_train_epoch_start(self):
        # Restart mode (--ckpt-dir): dropout's random numbers depend only on (epoch, rank), so a
        # restart that resumes from an epoch-end checkpoint (Lightning's checkpoints hold no RNG
        # state) draws what the uninterrupted run drew. Live failover needs no such care: the RNG
        # is per-rank state, mirrored with every commit.
        if self.faults and self.faults.ckpt_dir:
            torch.manual_seed(1000 * self.current_epoch + self.global_rank)

    def training_step(self, batch, batch_idx):
        self._fault("forward")
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True)  # an all-reduce inside the step
        return loss

    def on_before_optimizer_step(self, optimizer):
        self._fault("optimizer")  # after the step's commit vote, before the update

    def on_train_batch_end(self, outputs, batch, batch_idx):
        mean = outputs["loss"].detach().clone()
        if dist.is_initialized():
            dist.all_reduce(mean)  # a collective after the optimizer step (loss logging)
        self._fault("logged")
        if self.faults and self.faults.step_log:
            with open(self.faults.step_log, "a") as f:
                f.write(f"{time.time():.6f} {self.global_rank} {self.global_step - 1} 0 {os.getpid()}\n")
        if self.faults and self.faults.step_sleep:
            time.sleep(self.faults.step_sleep)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def _fault(self, phase: str) -> None:
        a = self.faults
        if a is not None and phase == a.kill_phase and self.global_rank == a.kill_rank and self.global_step == a.kill_step:
            kill_once(a.kill_marker, self.global_rank, f"step {self.global_step} ({phase})")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", choices=["live", "ddp"], default="live")
    p.add_argument("--init", action="store_true", help="call tm_launch.init() first (instead of init_process_group)")
    p.add_argument("--ckpt-dir", default=None, help="Lightning checkpoints at every epoch end; resume from the last")
    p.add_argument(
        "--bn",
        action="store_true",
        help="a BatchNorm after the first layer: per-rank buffers (running statistics) the script never registers",
    )
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--out-dir", default=None, help="every rank saves its final parameters here (rank<R>.pt)")
    p.add_argument("--step-log", default=None)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--kill-phase", default="forward", choices=PHASES)
    p.add_argument("--kill-marker", default="killed")
    p.add_argument("--pause-step", type=int, default=-1)
    p.add_argument("--pause-file", default=None)
    args = p.parse_args()

    if args.init:
        import tm_launch

        tm_launch.init()
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(args.samples, 16, generator=g), torch.randn(args.samples, 4, generator=g))
    model = Model(bn=args.bn)
    model.faults = args
    if args.kill_phase == "backward":
        model.net[0].register_full_backward_pre_hook(lambda m, grad: model._fault("backward"))  # mid gradient all-reduce
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = pl.Trainer(
        strategy=LiveStrategy() if args.strategy == "live" else "ddp",
        accelerator="cpu",
        devices=local,
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // local,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=bool(args.ckpt_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True, save_top_k=0)] if args.ckpt_dir else None,
    )
    last = os.path.join(args.ckpt_dir, "last.ckpt") if args.ckpt_dir else None
    trainer.fit(model, DataLoader(data, batch_size=8, shuffle=True), ckpt_path=last if last and os.path.exists(last) else None)
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(args.out_dir, f"rank{trainer.global_rank}.pt"))
    if dist.is_initialized():
        # As torchrun scripts end: a group torch still holds is freed by the interpreter's
        # teardown, where gloo's thread can abort the process (tm_launch.worker.job.plain._destroy_default_group).
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
