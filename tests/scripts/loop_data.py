"""The data loop torchrun scripts have, *not* handed to ``job.data()``: the loader iterated by the
script itself inside ``job.steps()`` (``tm_launch.worker.state.loop_loaders`` keeps it exact).

``--loop next`` (default): ``it = iter(loader)`` before the loop, ``next(it)`` each step, and at an
epoch's end (``StopIteration``) ``sampler.set_epoch(...)`` and a new ``iter(loader)``.
``--loop for``: ``for x, y in loader:`` inside each step (the step's gradient accumulated over
a small loader of this rank's samples, shuffled per step by ``set_epoch(step)``; one optimizer step).
``--sampler random``: a ``RandomSampler`` (refused at the first step, in one line). ``--sampler custom``:
a sampler of the script's own (deterministic, but tm-launch cannot reposition it: left to torch with
one warning, and a recovery is not exact: what ``tm-launch rehearse`` must catch).

Runs unchanged under plain torchrun and tm-launch live mode. DDP with dropout (each rank's own
masks from the global generator, found as per-rank state without registration), a shuffled
``DistributedSampler`` over a small deterministic dataset, two DataLoader workers with
``--workers 2``. ``--out PREFIX`` writes each rank's whole state (parameters, optimizer state,
its global generator, the sampler's epoch) to ``PREFIX.rank<r>``: a run with a worker SIGKILLed
must end with every rank's state bitwise equal to plain torchrun's fault-free run. Faults:
``tests/scripts/faults.py`` (``forward`` is right after the step's batch was taken).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, Sampler

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
from faults import Faults  # noqa: E402  (tests/scripts/faults.py, beside this script)

import tm_launch  # noqa: E402


class Points(Dataset):
    """Sample i: a fixed input and target made from i alone."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g), torch.randn(2, generator=g)


class RankShuffle(Sampler):
    """This rank's share of the samples in an order drawn from (seed, epoch): as deterministic as a
    ``DistributedSampler``, but a class tm-launch does not know how to reposition."""

    def __init__(self, n: int, world: int, rank: int, seed: int):
        self.n, self.world, self.rank, self.seed, self.epoch = n, world, rank, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        return iter(order[self.rank :: self.world])

    def __len__(self) -> int:
        return len(range(self.rank, self.n, self.world))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--samples", type=int, default=40, help="dataset size (5 batches per rank and epoch at 2 ranks)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--loop", default="next", choices=("next", "for"))
    p.add_argument("--sampler", default="distributed", choices=("distributed", "random", "custom"))
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--step-log", default=None)
    Faults.add_arguments(p)
    args = p.parse_args()
    faults = Faults(args)

    job = tm_launch.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 2))
    torch.manual_seed(1000 + job.rank)  # each rank's own dropout masks (and its loaders' base seeds)
    ddp = DDP(model, process_group=job.group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    data = Points(args.samples)
    if args.sampler == "random":
        sampler = RandomSampler(data)
    elif args.sampler == "custom":
        sampler = RankShuffle(args.samples, job.world_size, job.rank, seed=5)
    else:
        sampler = DistributedSampler(data, num_replicas=job.world_size, rank=job.rank, shuffle=True, seed=5)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, num_workers=args.workers)
    job.register(model=model, optimizer=opt)
    per_epoch = len(loader)
    it = iter(loader)
    for step in job.steps(args.steps):
        faults.step = step
        opt.zero_grad()
        if args.loop == "next":
            try:
                x, y = next(it)
            except StopIteration:  # the epoch ended: shuffle the next one, as torchrun scripts do
                sampler.set_epoch(step // per_epoch)
                it = iter(loader)
                x, y = next(it)
            faults.at(job, "forward")  # right after the batch was taken
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            loss.backward()
        else:
            sampler.set_epoch(step)
            for i, (x, y) in enumerate(loader):
                if i == 1:
                    faults.at(job, "forward")  # mid-way through the step's pass over the loader
                loss = torch.nn.functional.mse_loss(ddp(x), y) / per_epoch
                loss.backward()
        opt.step()
        faults.at(job, "logging")
        logged = loss.detach().clone()
        dist.all_reduce(logged, group=job.group)  # the loss, logged after the optimizer step
        faults.at(job, "logged")
        if args.step_log and not job.in_sandbox:
            Faults.log_step(args.step_log, job, step)
    if args.out:
        state = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
        for i, s in opt.state_dict()["state"].items():
            state.update({f"opt.{i}.{k}": torch.as_tensor(v).clone() for k, v in s.items()})
        state["rng"] = torch.get_rng_state()
        state["sampler_epoch"] = torch.tensor(getattr(sampler, "epoch", -1))
        torch.save(state, f"{args.out}.rank{job.rank}")


if __name__ == "__main__":
    main()
