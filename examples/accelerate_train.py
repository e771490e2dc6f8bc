"""An accelerate training loop with tm-launch's live failover. The loop is the script's, so it
uses the live API: ``tm_launch.init()`` before ``Accelerator()``, ``job.register()`` with what
``accelerator.prepare()`` returned, and ``job.steps()`` as the loop.

    torchrun --standalone --nproc-per-node 2 examples/accelerate_train.py
    tm-launch --standalone --nproc-per-node 2 examples/accelerate_train.py
    tm-launch --nnodes 2 --nproc-per-node 8 --rdzv-backend etcd-v3 \\
        --rdzv-endpoint ETCD_HOST:2379 --rdzv-id my-run examples/accelerate_train.py

A step may run again (a peer failed before it committed) and a rank may join mid-epoch, so the
loader's position follows from the step number: ``divmod(step, len(loader))`` gives the epoch
and the batch, and ``accelerator.skip_first_batches`` starts an iterator there. That needs a
shuffle that depends on (seed, epoch) alone: ``use_seedable_sampler=True``.
"""

import argparse

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader, TensorDataset

import tm_launch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    job = tm_launch.init()  # first: accelerate then uses the job's process group
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.9)
    x = torch.randn(1024, 20, generator=torch.Generator().manual_seed(1))
    # The loader's own generator: a new iterator must not draw from the global RNG (dropout's).
    loader = DataLoader(
        TensorDataset(x, x[:, :4].sum(dim=1, keepdim=True).sin()), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(2)
    )
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    job.register(model=model, optimizer=opt, scheduler=sched)
    torch.manual_seed(10 + job.rank)  # dropout draws from a stream of each rank's own
    job.register(per_rank=True, rng=tm_launch.RNGState())

    batches, expected = None, None
    for step in job.steps(args.epochs * len(loader)):
        epoch, index = divmod(step, len(loader))
        if (epoch, index) != expected:  # the first step, a new epoch, a step run again, a joiner
            loader.set_epoch(epoch)
            batches = iter(accelerator.skip_first_batches(loader, index) if index else loader)
        inputs, targets = next(batches)
        expected = (epoch, index + 1)
        loss = F.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        mean = accelerator.reduce(loss.detach(), reduction="mean")  # after the optimizer step: fine
        if accelerator.is_main_process and index == 0 and job.step_ok and not job.in_sandbox:
            print(f"epoch {epoch}: loss {mean.item():.6f}", flush=True)


if __name__ == "__main__":
    main()
