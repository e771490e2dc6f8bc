"""A DDP job that keeps per-rank state tm-launch cannot see: the rehearsal's known divergence.

Each rank shifts its inputs by a tensor it keeps in a plain attribute of the model (``model.drift``,
neither a parameter nor a buffer) and changes every step; nothing registers it. A rank that joins
after a fault starts it from its initial value, a step that runs again changes it twice, so the
parameters after any fault differ from the fault-free run, and ``tm-launch rehearse`` must say so
and name the cause (state never registered). Everything else is deterministic, as in
``tests/scripts/train.py``. ``--crash`` raises in the first step (a script that fails without
any fault).
"""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import tm_launch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--crash", action="store_true")
    args = p.parse_args()
    job = tm_launch.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model.drift = torch.full((8,), float(job.rank))  # per-rank, in a plain attribute, never registered
    ddp = DDP(model, process_group=job.group)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    job.register(model=model, optimizer=opt)
    for step in job.steps(args.steps):
        if args.crash:
            raise RuntimeError("this script fails on purpose (--crash)")
        g = torch.Generator().manual_seed(step * 100 + job.rank)
        x = torch.randn(4, 8, generator=g) + model.drift
        loss = F.mse_loss(ddp(x), x[:, :1].sin())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        model.drift += 0.1 * (job.rank + 1)


if __name__ == "__main__":
    main()
