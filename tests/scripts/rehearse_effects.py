"""A DDP job whose results include a file it writes at the end, for ``tm-launch rehearse``'s file
comparison and its phase between two optimizer steps.

Rank 0 writes ``final.pt`` in its working directory at the end (``torch.save``: the model's
weights and a count of the steps it ran) and ``loss.txt`` (the last step's loss, as text). With
``--closure-counter`` the count is kept in a closure, where nothing can find it: a step that runs
again counts twice and a rank taking over counts from its own start, so after a fault the file
differs from the fault-free run while every registered object is exact; without it the count is
the loop's step. ``--two-optimizers``: a second model trained on the first one's output with an
optimizer of its own, stepped after the first's in every step (a GAN-style step: two effects),
both registered (``--second-unregistered``: only the first model and its optimizer are; live mode
finds the second pair at the first step). Deterministic on CPU: batches are a function of (step, rank).
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import tm_launch


def closure_counter():
    count = 0

    def tick() -> int:
        nonlocal count
        count += 1
        return count

    return tick


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--closure-counter", action="store_true")
    p.add_argument("--two-optimizers", action="store_true")
    p.add_argument("--second-unregistered", action="store_true", help="with --two-optimizers: register the first pair only")
    args = p.parse_args()
    job = tm_launch.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    second = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    ddp, ddp_second = DDP(model, process_group=job.group), DDP(second, process_group=job.group)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt_second = torch.optim.SGD(second.parameters(), lr=0.05, momentum=0.9)
    if args.two_optimizers and not args.second_unregistered:
        job.register(model=model, optimizer=opt, second=second, second_optimizer=opt_second)
    else:
        job.register(model=model, optimizer=opt)
    tick = closure_counter()
    seen = 0
    for step in job.steps(args.steps):
        g = torch.Generator().manual_seed(step * 100 + job.rank)
        x = torch.randn(4, 8, generator=g)
        out = ddp(x)
        loss = F.mse_loss(out, x[:, :4].sin())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if args.two_optimizers:
            loss_second = F.mse_loss(ddp_second(out.detach()), x[:, :1].cos())
            opt_second.zero_grad(set_to_none=True)
            loss_second.backward()  # its gradient all-reduce runs after the first optimizer step
            opt_second.step()
        seen = tick() if args.closure_counter else step + 1
        logged = loss.detach().clone()
        dist.all_reduce(logged, group=job.group)
    if job.rank == 0:
        torch.save({"model": model.state_dict(), "second": second.state_dict(), "seen": seen}, "final.pt")
        with open("loss.txt", "w") as f:
            f.write(f"{logged.item() / job.world_size:.6f}\n")


if __name__ == "__main__":
    main()
