"""DDP as its users configure it for speed, live under tm-launch: one script, one option each.

``--ddp OPTION``:

* ``static``: ``DDP(model, static_graph=True, gradient_as_bucket_view=True)`` (what DDP's
  documentation suggests for speed: the graph is recorded in the first iteration, gradients are
  views into the communication buckets);
* ``unused``: ``find_unused_parameters=True``, with a branch the forward uses only on even steps
  (DDP searches the autograd graph for the parameters it did not reach and marks them ready);
* ``fp16``: a communication hook, ``register_comm_hook(group, fp16_compress_hook)``;
* ``plain``: none of them (the reference layout).

Runs unchanged under ``torchrun``. Deterministic on CPU: seeded model, batches seeded by
(step, rank). The model holds a BatchNorm (buffers that DDP broadcasts from rank 0 at every
forward). ``--out PREFIX`` writes each rank's whole ``state_dict()`` (buffers included), its
optimizer's and its scheduler's state to ``PREFIX.rank<r>``.

Fault injection: ``--kill-rank R --kill-step S --kill-phase PHASE`` (``tests/scripts/faults.py``;
``backward`` is inside DDP's gradient communication).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
from faults import Faults  # noqa: E402  (tests/scripts/faults.py, beside this script)

import tm_launch  # noqa: E402

OPTIONS = ("plain", "static", "unused", "fp16")


class Net(nn.Module):
    """Two paths: ``side`` is used only when the forward is asked to (``find_unused_parameters``)."""

    def __init__(self, width: int):
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.norm = nn.BatchNorm1d(width)
        self.mid = nn.Linear(width, width)
        self.side = nn.Linear(width, width)
        self.out = nn.Linear(width, 8)

    def forward(self, x, use_side: bool = True):
        h = torch.tanh(self.norm(self.inp(x)))
        h = torch.tanh(self.mid(h))
        if use_side:
            h = h + torch.tanh(self.side(h))
        return self.out(h)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--ddp", choices=OPTIONS, default="static")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--bucket-mb", type=float, default=0.004, help="DDP's bucket_cap_mb: small, so the model spans several buckets")
    p.add_argument("--out", default=None, help="each rank writes its state to OUT.rank<r>")
    p.add_argument("--step-log", default=None, help="append 'time rank step generation pid' per finished step")
    Faults.add_arguments(p)
    return p.parse_args()


def wrap(model: nn.Module, option: str, group, bucket_mb: float) -> DDP:
    kwargs = {"process_group": group, "bucket_cap_mb": bucket_mb}
    if option == "static":
        kwargs.update(static_graph=True, gradient_as_bucket_view=True)
    if option == "unused":
        kwargs.update(find_unused_parameters=True)
    ddp = DDP(model, **kwargs)
    if option == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        ddp.register_comm_hook(group, fp16_compress_hook)
    return ddp


def state(model: nn.Module, opt, sched) -> dict:
    """Everything a rank holds: the module's whole state_dict, the optimizer's, the scheduler's."""

    def plain(v):
        return v.detach().clone() if isinstance(v, torch.Tensor) else v

    return {
        "model": {k: plain(v) for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
    }


def main():
    args = parse()
    faults = Faults(args)
    job = tm_launch.init()
    torch.manual_seed(0)
    model = Net(args.width)
    ddp = wrap(model, args.ddp, job.group, args.bucket_mb)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
    job.register(model=model, optimizer=opt, scheduler=sched)
    faults.arm_backward(model, job)
    opt.register_step_pre_hook(lambda *a: faults.at(job, "optimizer"))
    for step in job.steps(args.steps):
        faults.step = step
        g = torch.Generator().manual_seed(step * 1000 + job.rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
        faults.at(job, "forward")
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x, use_side=args.ddp != "unused" or step % 2 == 0), y)
        loss.backward()
        opt.step()
        sched.step()
        faults.at(job, "logging")
        logged = loss.detach().clone()
        dist.all_reduce(logged, group=job.group)
        faults.at(job, "logged")
        if args.step_log and not job.in_sandbox:
            faults.log_step(args.step_log, job, step)
    if args.out:
        torch.save(state(model, opt, sched), f"{args.out}.rank{job.rank}")
    dist.barrier(group=job.group)


if __name__ == "__main__":
    main()
