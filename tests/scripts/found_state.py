"""A torchrun script that keeps training state it never registers, as scripts do: an EMA of the
weights, a GradScaler, a tokens-seen counter that drives the learning rate. It registers its
model and optimizer (the README's API) and nothing else.

- ``--ema``: ``torch.optim.swa_utils.AveragedModel`` (an exponential moving average), updated
  after each optimizer step and saved with the model at the end.
- ``--scaler``: CPU float16 autocast with a ``torch.amp.GradScaler`` whose scale changes during
  the run (a high initial scale that overflows and backs off, a short growth interval).
- ``--ema-per-rank``: with ``--ema``, each rank's EMA starts from its own offset of the weights (an
  average each rank keeps of its own, as a local-SGD script does): no other rank holds a copy, so
  the replica survey must find it this rank's own, carried to a joiner from the lost rank's copy.
- ``--teacher frozen|mean``: knowledge distillation from a teacher the script never registers (the
  student also fits the teacher's outputs): ``frozen``, a fixed second network (no gradients, never
  stepped); ``mean``, a mean teacher, an average of the student's weights updated in place after
  each optimizer step.
- ``--exclude-ema``: ``job.register(..., exclude=[ema])``: the EMA is left out, so a recovery
  diverges in the EMA alone (what ``tm-launch rehearse`` must find).
- ``--tokens``: ``tokens_seen``, a plain variable of the loop (here inside ``main()``; the
  module-level twin is ``found_state_module.py``), counted after the optimizer step and setting
  the next step's learning rate (a linear warm-up over tokens).

Each rank writes ``--out DIR/rank<r>.pt``: the model's and the optimizer's ``state_dict()``, the
EMA's, the scaler's and ``tokens_seen``. Fault points: ``tests/scripts/faults.py``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
from faults import Faults  # noqa: E402  (tests/scripts/faults.py, beside this script)
from ordinary import flat  # noqa: E402

import tm_launch  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--ema", action="store_true")
    p.add_argument("--scaler", action="store_true")
    p.add_argument("--tokens", action="store_true")
    p.add_argument("--ema-per-rank", action="store_true", help="each rank's EMA differs (an offset by rank at the start)")
    p.add_argument("--teacher", choices=("frozen", "mean"), default=None, help="distil from an unregistered teacher")
    p.add_argument("--exclude-ema", action="store_true", help="register(exclude=[ema]): the EMA is left out (and diverges)")
    p.add_argument("--log-loss", action="store_true", help="all-reduce the loss after the optimizer step")
    p.add_argument("--out", default=None, help="write each rank's state here")
    Faults.add_arguments(p)
    args = p.parse_args()

    job = tm_launch.init()
    rank = job.rank
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9)) if args.ema else None
    if ema is not None and args.ema_per_rank:
        with torch.no_grad():
            for p in ema.parameters():
                p.add_(1e-3 * (rank + 1))
    teacher = None
    if args.teacher:
        torch.manual_seed(1 if args.teacher == "frozen" else 0)  # the mean teacher starts as the student
        teacher = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)).requires_grad_(False)
    model = DDP(net, process_group=job.group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    job.register(model=model, optimizer=opt, exclude=[ema] if args.exclude_ema else [])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=3) if args.scaler else None
    tokens_seen = 0
    faults = Faults(args)
    faults.arm_backward(model, job)
    for step in job.steps(args.steps):
        faults.step = step
        if args.tokens:  # a linear warm-up over the tokens seen so far
            for group in opt.param_groups:
                group["lr"] = 1e-2 * min(1.0, (tokens_seen + 1) / 400)
        g = torch.Generator().manual_seed(1 + step * 97 + rank)
        n = 8 + step % 5
        x = torch.randn(n, 8, generator=g)
        y = x[:, :1] * 0.5 + torch.randn(n, 1, generator=g) * 0.1
        faults.at(job, "forward")
        with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
            out = model(x).float()
            loss = nn.functional.mse_loss(out, y)
        if teacher is not None:  # distillation: fit the teacher's outputs too
            with torch.no_grad():
                soft = teacher(x)
            loss = loss + 0.5 * nn.functional.mse_loss(out, soft)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad()
        faults.at(job, "logging")
        if ema is not None:
            ema.update_parameters(net)
        if args.teacher == "mean":
            with torch.no_grad():
                for t, w in zip(teacher.parameters(), net.parameters()):
                    t.mul_(0.9).add_(w, alpha=0.1)
        if args.tokens:
            tokens_seen += n * 8
        if args.log_loss:
            dist.all_reduce(loss.detach(), group=job.group)
        faults.at(job, "logged")
    state: dict = {}
    flat("model", model.state_dict(), state)
    flat("optimizer", opt.state_dict(), state)
    if ema is not None:
        flat("ema", ema.state_dict(), state)
    if teacher is not None:
        flat("teacher", teacher.state_dict(), state)
    if scaler is not None:
        flat("scaler", scaler.state_dict(), state)
    state["tokens_seen"] = tokens_seen
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        torch.save(state, os.path.join(args.out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
