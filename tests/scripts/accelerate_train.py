"""An accelerate training loop with tm-launch's live failover. The loop is the script's own, so it
uses the live API directly: ``tm_launch.init()`` before ``Accelerator()``, ``job.register()``
with what ``accelerator.prepare()`` returned, and ``job.steps()`` as the loop.

    tm-launch --nnodes 2 --nproc-per-node 1 --rdzv-backend etcd-v3 ... tests/scripts/accelerate_train.py
    torchrun --standalone --nproc-per-node 2 tests/scripts/accelerate_train.py      # the same job

The loader's position follows from the step (epoch, batch = divmod(step, len(loader))), so a
joining rank, or a step that runs again, starts the iterator at the right batch with
``accelerator.skip_first_batches``. Dropout draws from the per-rank RNG (registered per_rank).
After a spare is promoted to other ranks, ``accelerator.process_index`` is checked against
``dist.get_rank()`` and ``RANK`` at every step. Deterministic on CPU: with a worker killed, every
rank ends with exactly the parameters of the run without the failure (``--out-dir``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
from faults import kill_once  # noqa: E402  (tests/scripts/faults.py, beside this script)

import tm_launch  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--bn",
        action="store_true",
        help="a BatchNorm after the first layer: per-rank buffers (running statistics) the script never registers",
    )
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--out-dir", default=None, help="every rank saves its final parameters here (rank<R>.pt)")
    p.add_argument("--step-log", default=None)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--kill-marker", default="killed")
    p.add_argument("--pause-step", type=int, default=-1)
    p.add_argument("--pause-file", default=None)
    args = p.parse_args()

    job = tm_launch.init()  # before Accelerator(): accelerate uses the job's process group
    # A seedable sampler shuffles each epoch from (seed, epoch) alone: a new iterator started
    # mid-epoch (skip_first_batches) sees the same order as the one it replaces. accelerate's
    # default draws the order from a generator synchronised at each iterator's start.
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    torch.manual_seed(0)
    norm = [torch.nn.BatchNorm1d(32)] if args.bn else []
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), *norm, torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(args.samples, 16, generator=g), torch.randn(args.samples, 4, generator=g))
    # The loader gets a generator of its own: a DataLoader iterator draws its base seed from it,
    # else from the global RNG, which is dropout's per-rank stream here; a step that runs again
    # (or a joining rank) starts a new iterator, which must not shift that stream.
    loader = DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(2))
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    job.register(model=model, optimizer=opt, scheduler=sched)
    torch.manual_seed(100 + job.rank)  # dropout: a stream of its own per rank
    job.register(per_rank=True, rng=tm_launch.RNGState())

    per_epoch = len(loader)
    batches, at = None, None
    for step in job.steps(args.epochs * per_epoch):
        if not job.in_sandbox:
            identity = (accelerator.process_index, dist.get_rank(), int(os.environ["RANK"]))
            assert len(set(identity)) == 1, f"accelerate's rank {identity[0]}, dist's {identity[1]}, RANK {identity[2]}"
        epoch, index = divmod(step, per_epoch)
        if at != (epoch, index):  # start, a new epoch, a joining rank, or the step runs again
            loader.set_epoch(epoch)
            batches = iter(accelerator.skip_first_batches(loader, index) if index else loader)
        x, y = next(batches)
        at = (epoch, index + 1)
        if step == args.pause_step and args.pause_file and not job.in_sandbox:
            while not os.path.exists(args.pause_file):
                time.sleep(0.02)
        _maybe_die(args, job, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        accelerator.reduce(loss.detach(), reduction="mean")  # loss logging: a collective after the optimizer step
        if args.step_log and job.commit() and not job.in_sandbox:
            with open(args.step_log, "a") as f:
                f.write(f"{time.time():.6f} {job.rank} {step} {getattr(job, 'generation', 0)} {os.getpid()}\n")
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        params = accelerator.unwrap_model(model).state_dict()
        torch.save({k: v.clone() for k, v in params.items()}, os.path.join(args.out_dir, f"rank{job.rank}.pt"))


def _maybe_die(args, job, step: int) -> None:
    """SIGKILL this worker once per job, at --kill-step, if it holds --kill-rank (before the backward)."""
    if not job.in_sandbox and job.rank == args.kill_rank and step == args.kill_step:
        kill_once(args.kill_marker, job.rank, f"step {step}")


if __name__ == "__main__":
    main()
