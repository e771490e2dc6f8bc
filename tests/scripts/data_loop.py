"""The data loop a torchrun user writes, handed to tm-launch: ``batches = job.data(loader)``, then
``next(batches)`` once per step, over several epochs (tm-launch calls the sampler's ``set_epoch``).

Runs unchanged under plain torchrun and tm-launch live mode. DDP with dropout (each rank's own
masks: torch's generator seeded per rank, registered as ``RNGState``), a shuffled
``DistributedSampler`` over a small deterministic dataset. ``--out PREFIX`` writes each rank's whole
state (parameters, optimizer state, its generator and data position) to ``PREFIX.rank<r>``: a run
with a worker SIGKILLed must end with every rank's state bitwise equal to plain torchrun's
fault-free run.

``--loader plain|stateful|iterable`` (torchdata's ``StatefulDataLoader``; an ``IterableDataset`` with
``state_dict()``), ``--workers N``; ``--loader
random`` (a ``RandomSampler``: refused) and ``--register-loader`` (the loader passed to
``job.register(per_rank=True, ...)``: refused) check the one-line refusals. Faults:
``tests/scripts/faults.py`` (``forward`` is right after the step's batch was taken).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler

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


class Stream(IterableDataset):
    """An iterable dataset with its own position: this rank's share of a shuffled order per epoch;
    iter() resumes from the position (a state taken after its last sample ends at once) and
    set_epoch() of another epoch starts over."""

    def __init__(self, n: int, rank: int, world: int):
        self.points, self.rank, self.world, self.pos, self.epoch = Points(n), rank, world, 0, 0

    def __iter__(self):
        order = torch.randperm(len(self.points), generator=torch.Generator().manual_seed(5 + self.epoch))[self.rank :: self.world]
        while self.pos < len(order):
            self.pos += 1
            yield self.points[int(order[self.pos - 1])]

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.pos = 0
        self.epoch = epoch

    def state_dict(self) -> dict:
        return {"pos": self.pos, "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.pos, self.epoch = state["pos"], state["epoch"]


def make_loader(kind: str, samples: int, batch: int, workers: int, rank: int, world: int):
    if kind == "iterable":
        return DataLoader(Stream(samples, rank, world), batch_size=batch)
    data = Points(samples)
    if kind == "random":
        return DataLoader(data, batch_size=batch, sampler=RandomSampler(data))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=5)
    if kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(data, batch_size=batch, sampler=sampler, num_workers=workers)
    return DataLoader(data, batch_size=batch, sampler=sampler, num_workers=workers)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--samples", type=int, default=40, help="dataset size (5 batches per rank and epoch at 2 ranks)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--loader", default="plain", choices=("plain", "stateful", "iterable", "random"))
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--register-loader", action="store_true")
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
    loader = make_loader(args.loader, args.samples, args.batch, args.workers, job.rank, job.world_size)
    job.register(model=model, optimizer=opt)
    job.register(per_rank=True, rng=tm_launch.RNGState())
    if args.register_loader:
        job.register(per_rank=True, data=loader)  # what the README once said: refused
    batches = job.data(loader)
    for step in job.steps(args.steps):
        x, y = next(batches)
        faults.step = step
        faults.at(job, "forward")  # right after the batch was taken (and the pause, at --pause-step)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
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
        state["data"] = torch.tensor([batches.epoch, batches.index])
        torch.save(state, f"{args.out}.rank{job.rank}")


if __name__ == "__main__":
    main()
