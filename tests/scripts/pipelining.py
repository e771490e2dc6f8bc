"""torch's own pipeline stages live under tm-launch: ``torch.distributed.pipelining``'s
``PipelineStage`` under one of torch's schedules, as a user writes it.

``--schedule``: ``gpipe`` (``ScheduleGPipe``), ``1f1b`` (``Schedule1F1B``), ``interleaved``
(``ScheduleInterleaved1F1B``, two stages per rank), ``zero-bubble``
(``ScheduleInterleavedZeroBubble``, two stages per rank: input and weight gradients apart),
``looped-bfs`` (``ScheduleLoopedBFS``, two stages per rank, looped as interleaved), ``zbv``
(``ScheduleZBVZeroBubble``) and ``dualpipev`` (``ScheduleDualPipeV``): two stages per rank in a
"V" (rank r holds stages r and 2 * ranks - 1 - r: the first rank holds the first and the last).
Pure pipeline on 2 ranks (one stage per rank and no data-parallel replica:
``job.register(..., replicas=[job.rank])``, the state of a lost stage comes from its snapshot);
on 4 ranks a ``(dp, pp)`` mesh of 2 x 2, each stage's gradients
all-reduced over ``dp`` and registered with ``replicas=`` its dp group.

``--fsdp replicas``: each stage module wrapped in FSDP2 (``fully_shard``) over its data-parallel
replicas, as torchtitan's ``dp_replicate`` does: a ``(pp, dp, shard)`` mesh of 2 x ranks/2 x 1,
``pp`` outermost (rank r holds stage r // (ranks/2)), each stage sharded on its ``(dp, shard)``
sub-mesh (HSDP: a shard of degree 1, replicated across ``dp``). ``--fsdp shards``: each stage
sharded over ``dp`` of a ``(pp, dp)`` mesh (no replica: a lost shard comes from its snapshot).
FSDP reduces the gradients inside the schedule (the stage's last backward), and the state is
registered without ``replicas=``: tm-launch finds a stage's replicas from its DTensors' mesh.

The stages are built as torch's documentation writes them, without ``input_args`` /
``output_args``: on the first step each stage infers its neighbours' tensor shapes through
object point-to-point (``_forward_metadata_inference`` / ``_backward_metadata_inference``).

Runs unchanged under ``torchrun``. Deterministic on CPU: seeded model, each step's batch seeded
by (step, data-parallel index). ``--out PREFIX`` writes each rank's whole ``state_dict()`` of its
stage modules (under ``--fsdp`` its local shards), its optimizer's and its scheduler's state to ``PREFIX.rank<r>``.

Fault injection: ``--kill-rank R --kill-step S --kill-phase PHASE`` (``tests/scripts/faults.py``);
``forward`` is at the top of the step, ``microbatch`` in the forward of the stage's second
microbatch (the first one's activations sent or on their way), ``backward`` inside the first
backward microbatch that reaches the stage's first layer (under 1F1B a forward microbatch is
then in flight).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
from faults import Faults  # noqa: E402  (tests/scripts/faults.py, beside this script)

import tm_launch  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble", "looped-bfs", "zbv", "dualpipev")
MULTI = {  # the schedules with two stages per rank -> torch's class name, and their placement
    "interleaved": ("ScheduleInterleaved1F1B", "loop"),
    "zero-bubble": ("ScheduleInterleavedZeroBubble", "loop"),
    "looped-bfs": ("ScheduleLoopedBFS", "loop"),
    "zbv": ("ScheduleZBVZeroBubble", "v"),
    "dualpipev": ("ScheduleDualPipeV", "v"),
}


class Block(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.w1 = nn.Linear(d, h)
        self.w2 = nn.Linear(h, d)

    def forward(self, x):
        return x + self.w2(torch.tanh(self.w1(x)))


def parts(width: int, n: int) -> list[nn.Module]:
    """The whole network in ``n`` stage modules (the first takes the input layer, the last the
    output layer), the same seeded weights on every rank."""
    torch.manual_seed(0)
    inp, blocks, out = nn.Linear(16, 32), [Block(32, width) for _ in range(n)], nn.Linear(32, 8)
    mods = [nn.Sequential(b) for b in blocks]
    mods[0] = nn.Sequential(inp, blocks[0])
    mods[-1] = nn.Sequential(*mods[-1], out)
    return mods


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--schedule", choices=SCHEDULES, default="gpipe")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--out", default=None, help="each rank writes its state to OUT.rank<r>")
    p.add_argument(
        "--fsdp",
        choices=("replicas", "shards"),
        default=None,
        help="each stage in FSDP2 over its data-parallel group: replicated across it (torchtitan's dp_replicate) or sharded",
    )
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (stands in for compute)")
    p.add_argument("--step-log", default=None, help="append 'time rank step generation pid' per finished step")
    p.add_argument(
        "--sandbox-hold",
        default=None,
        metavar="FILE",
        help="the first process to warm up in a spare's sandbox holds in its first sandbox step (its stages built, "
        "none of its warm-up run), its pid in FILE, until it is killed or its agent is gone",
    )
    Faults.add_arguments(p)
    return p.parse_args()


def hold_in_sandbox(job, path: str | None) -> None:
    """``--sandbox-hold``: once per job (``FILE.claimed``), a spare's sandboxed worker stops here
    for a test to kill it, or its agent, while it warms up its stages. It leaves on its own once
    its agent is gone (a killed agent's worker must not outlive it)."""
    from tm_launch.worker.failpoints import _claim

    if not path or not job.in_sandbox or not _claim(path + ".claimed"):
        return
    with open(path + ".part", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".part", path)
    agent = os.getppid()
    while os.getppid() == agent:
        time.sleep(0.05)
    os._exit(1)


def batch(step: int, dp_index: int):
    g = torch.Generator().manual_seed(step * 1000 + dp_index)
    return torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)


def local(value):
    """A DTensor's local shard (FSDP2's sharded state), anything else as it is."""
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def optimizer_state(opt) -> dict:
    state = opt.state_dict()
    state["state"] = {i: {k: local(v) for k, v in s.items()} for i, s in state["state"].items()}
    return state


def main():
    args = parse()
    faults = Faults(args)
    job = tm_launch.init()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, schedules

    rank, world = job.rank, job.world_size
    dp = world // 2
    if args.fsdp == "replicas":  # torchtitan's order: pp outermost
        mesh = init_device_mesh("cpu", (2, dp, 1), mesh_dim_names=("pp", "dp", "shard"))
    elif args.fsdp == "shards":
        mesh = init_device_mesh("cpu", (2, dp), mesh_dim_names=("pp", "dp"))
    else:
        mesh = init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp", "pp"))
    pp_group, pp_rank = mesh["pp"].get_group(), mesh["pp"].get_local_rank()
    per_rank = 2 if args.schedule in MULTI else 1
    n_stages = 2 * per_rank
    if MULTI.get(args.schedule, ("", "loop"))[1] == "v":
        indices = [pp_rank, n_stages - 1 - pp_rank]  # rank r holds stages r, n - 1 - r
    else:
        indices = [pp_rank + 2 * i for i in range(per_rank)]  # interleaved: rank r holds stages r, r + 2
    model = nn.ModuleList(m for i, m in enumerate(parts(args.width, n_stages)) if i in indices)  # this rank's stages only
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for m in model:
            fully_shard(m, mesh=mesh["dp", "shard"] if args.fsdp == "replicas" else mesh["dp"])
    stages = [PipelineStage(m, i, n_stages, torch.device("cpu"), group=pp_group) for i, m in zip(indices, model)]
    loss_fn = nn.functional.mse_loss
    if args.schedule in MULTI:
        kind = getattr(schedules, MULTI[args.schedule][0])
        schedule = kind(stages, n_microbatches=args.microbatches, loss_fn=loss_fn)
    else:
        kind = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
        schedule = kind(stages[0], n_microbatches=args.microbatches, loss_fn=loss_fn)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
    replicas = None if args.fsdp else mesh["dp"].get_group() if dp > 1 else [rank]  # FSDP2: found from its mesh
    job.register(model=model, optimizer=opt, scheduler=sched, replicas=replicas)
    faults.arm_backward(model, job)
    forwards = [0]  # this step's forward microbatches on this rank

    def microbatch(module, inputs):
        forwards[0] += 1
        if forwards[0] == 2:
            faults.at(job, "microbatch")

    model[0].register_forward_pre_hook(microbatch)
    opt.register_step_pre_hook(lambda *a: faults.at(job, "optimizer"))
    first, last = 0 in indices, n_stages - 1 in indices
    for step in job.steps(args.steps):
        faults.step = step
        hold_in_sandbox(job, args.sandbox_hold)
        x, y = batch(step, mesh["dp"].get_local_rank())
        faults.at(job, "forward")
        forwards[0] = 0
        if args.step_sleep:
            time.sleep(args.step_sleep)
        opt.zero_grad()
        losses: list = []
        if first and last:  # a "V": the first rank holds the first stage and the last
            schedule.step(x, target=y, losses=losses)
        elif first:
            schedule.step(x)
        elif last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        if dp > 1 and not args.fsdp:  # FSDP2 reduces them inside the schedule
            for p in model.parameters():
                if p.grad is not None:  # none in a step that failed before its backward (it runs again)
                    dist.all_reduce(p.grad, group=mesh["dp"].get_group())
                    p.grad.div_(dp)
        opt.step()
        sched.step()
        faults.at(job, "logging")
        logged = torch.stack(losses).sum() if losses else torch.zeros(())
        dist.all_reduce(logged, group=job.group)
        faults.at(job, "logged")
        if args.step_log and not job.in_sandbox:
            faults.log_step(args.step_log, job, step)
    if args.out:
        state = {
            "model": {k: local(v).detach().clone() for k, v in model.state_dict().items()},
            "optimizer": optimizer_state(opt),
            "scheduler": sched.state_dict(),
        }
        torch.save(state, f"{args.out}.rank{rank}")
    dist.barrier(group=job.group)


if __name__ == "__main__":
    main()
