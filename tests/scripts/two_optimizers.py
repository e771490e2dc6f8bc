"""A GAN-style loop, as a user writes one: two models, two optimizers, two optimizer steps per step.

Each step trains the discriminator D (its backward all-reduces D's gradients, then
``opt_d.step()``), then the generator G through D (a second backward, G's gradients all-reduced,
then ``opt_g.step()`` and G's LR scheduler). Both models, both optimizers and the scheduler are
registered; nothing else is. ``--layout ddp`` wraps both models in DDP, ``--layout fsdp`` shards
both with FSDP2 (``fully_shard``) over the world.

Runs unchanged under ``torchrun``. Deterministic on CPU: the models are seeded, each step's
batch and noise are seeded by (step, rank), so a run with failures must end with exactly the
state of a run without, on every rank (``--out PREFIX``: each rank writes its models' local
shards, both optimizers' state and the scheduler's to ``PREFIX.rank<r>``).

Fault injection (``tests/scripts/faults.py``): ``--kill-phase`` ``forward`` (before the first
optimizer step), ``between`` (after ``opt_d.step()``, before G's backward), ``logging`` (after
both, before the loss all-reduce), ``vote`` (inside a commit vote); a second fault with
``--chaos-dir DIR`` (``DIR/kill.<rank>`` holding "<phase> <step>").
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
from faults import ChaosDir, Faults  # noqa: E402  (tests/scripts/faults.py, beside this script)

import tm_launch  # noqa: E402

NOISE, DATA = 8, 16


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--layout", choices=("ddp", "fsdp"), default="ddp")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", default=None, help="each rank writes its state to OUT.rank<r>")
    p.add_argument("--step-log", default=None, help="append 'time rank step generation pid' per finished step")
    Faults.add_arguments(p)
    p.add_argument("--chaos-dir", default=None, help="more faults: DIR/kill.<rank> holding '<phase> <step>' (faults.ChaosDir)")
    return p.parse_args()


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(step * 100 + rank)
    return torch.randn(8, DATA, generator=g) * 0.5 + 1.0, torch.randn(8, NOISE, generator=g)


def local_state(named: dict) -> dict:
    """Every registered object's state dict, flattened to plain tensors (a DTensor's local shard)."""
    out = {}

    def visit(path, v):
        if isinstance(v, torch.Tensor):
            out[path] = (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
        elif isinstance(v, dict):
            for k, x in v.items():
                visit(f"{path}/{k}", x)
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                visit(f"{path}/{i}", x)
        elif isinstance(v, (int, float)):
            out[path] = torch.tensor(v, dtype=torch.float64)

    for name, obj in named.items():
        visit(name, obj.state_dict())
    return out


def main():
    args = parse()
    faults = Faults(args, ChaosDir(args.chaos_dir, "gan"))
    job = tm_launch.init()
    rank = job.rank
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(NOISE, 32), nn.Tanh(), nn.Linear(32, DATA))
    disc = nn.Sequential(nn.Linear(DATA, 32), nn.Tanh(), nn.Linear(32, 1))
    if args.layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        gen, disc = DDP(gen), DDP(disc)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (job.world_size,))
        gen, disc = fully_shard(gen, mesh=mesh), fully_shard(disc, mesh=mesh)
    opt_g = torch.optim.Adam(gen.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=2e-3, betas=(0.5, 0.999))
    sched_g = torch.optim.lr_scheduler.StepLR(opt_g, step_size=7, gamma=0.5)
    job.register(generator=gen, discriminator=disc, opt_g=opt_g, opt_d=opt_d, sched_g=sched_g)
    faults.arm_backward(disc, job)
    bce = nn.functional.binary_cross_entropy_with_logits
    for step in job.steps(args.steps):
        faults.step = step
        real, z = batch(step, rank)
        faults.at(job, "forward")
        # the discriminator: real against generated, one forward
        opt_d.zero_grad(set_to_none=True)
        fake = gen(z).detach()
        logits = disc(torch.cat([real, fake]))
        target = torch.cat([torch.ones(8, 1), torch.zeros(8, 1)])
        loss_d = bce(logits, target)
        loss_d.backward()
        opt_d.step()
        faults.at(job, "between")
        # the generator, through the discriminator
        opt_g.zero_grad(set_to_none=True)
        loss_g = bce(disc(gen(z)), torch.ones(8, 1))
        loss_g.backward()
        opt_g.step()
        sched_g.step()
        faults.at(job, "logging")
        logged = torch.stack([loss_d.detach(), loss_g.detach()])
        dist.all_reduce(logged)
        faults.at(job, "logged")
        if rank == 0 and not job.in_sandbox and step % 10 == 0 and job.step_ok:
            print(
                f"[gan] step {step}: loss_d {logged[0].item() / job.world_size:.5f} loss_g {logged[1].item() / job.world_size:.5f}",
                flush=True,
            )
        if args.step_log and not job.in_sandbox:
            faults.log_step(args.step_log, job, step)
    if args.out:
        state = local_state({"generator": gen, "discriminator": disc, "opt_g": opt_g, "opt_d": opt_d, "sched_g": sched_g})
        torch.save(state, f"{args.out}.rank{rank}")
    dist.barrier()


if __name__ == "__main__":
    main()
