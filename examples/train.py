"""Data-parallel (DDP) training with tm-launch's live API: the script to start from.

    torchrun --standalone --nproc-per-node 2 examples/train.py            # plain torchrun
    tm-launch --standalone --nproc-per-node 2 examples/train.py           # the same, one node
    tm-launch --nnodes 2 --nproc-per-node 8 --rdzv-backend etcd-v3 \\
        --rdzv-endpoint ETCD_HOST:2379 --rdzv-id my-run examples/train.py  # on every node, spares too

Under tm-launch a rank that fails is replaced in place: a spare node (an extra agent beyond
``--nnodes``) takes its ranks, receives their state from a live replica and joins at the step
the others are at, while the surviving processes keep running. Under torchrun the same script
is plain DDP (``tm_launch.init()`` is ``init_process_group()``, ``job.steps(n)`` is ``range(n)``).

``--ckpt-dir``: a ``torch.distributed.checkpoint`` every ``--ckpt-every`` steps, and a new run
resumes from the newest one. That is what restart mode (``tm-launch --no-live``, or a failure no
live replica can repair) and a torchrun restart start from.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

import tm_launch


def batch(step: int, rank: int, size: int = 32):
    """A synthetic batch that depends only on (step, rank): any process can produce it again."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(size, 20, generator=g)
    return x, x[:, :4].sum(dim=1, keepdim=True).sin()


def newest_checkpoint(ckpt_dir: str | None) -> int | None:
    """The step of the newest complete checkpoint (DCP writes ``.metadata`` last)."""
    if not ckpt_dir or not os.path.isdir(ckpt_dir):
        return None
    steps = [
        int(name[5:])
        for name in os.listdir(ckpt_dir)
        if name.startswith("step-") and os.path.exists(os.path.join(ckpt_dir, name, ".metadata"))
    ]
    return max(steps, default=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--ckpt-dir", default=None, help="checkpoint here and resume from the newest")
    parser.add_argument("--ckpt-every", type=int, default=50)
    parser.add_argument("--out", default=None, help="rank 0 saves the trained weights here")
    args = parser.parse_args()

    job = tm_launch.init()  # instead of dist.init_process_group()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1))
    ddp = DDP(model, process_group=job.group)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)

    start = 0
    found = newest_checkpoint(args.ckpt_dir)
    if found is not None and not job.in_sandbox:  # a spare warming up, or a joiner, gets the live state instead
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd, "sched": sched.state_dict()}
        dcp.load(state, checkpoint_id=os.path.join(args.ckpt_dir, f"step-{found}"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        sched.load_state_dict(state["sched"])
        start = found
        if job.rank == 0:
            print(f"resumed from the checkpoint of step {start}", flush=True)

    # What a rank that joins must receive: the same on every rank (replicated by DDP)...
    job.register(model=model, optimizer=opt, scheduler=sched)
    # ...and what each rank alone advances: its random stream (dropout here).
    torch.manual_seed(1 + job.rank)
    job.register(per_rank=True, rng=tm_launch.RNGState())

    for step in job.steps(args.steps, start=start):
        if args.ckpt_dir and step > start and step % args.ckpt_every == 0 and not job.in_sandbox:
            # At the top of the step: the state after step - 1, which every rank completed.
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save(
                {"model": model_sd, "optim": optim_sd, "sched": sched.state_dict()},
                checkpoint_id=os.path.join(args.ckpt_dir, f"step-{step}"),
            )
        x, y = batch(step, job.rank)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces the gradients
        opt.step()  # the step's commit: every rank applies it, or none does and the step runs again
        sched.step()

        # Collectives after the optimizer step (loss logging) are fine. The step has committed
        # by now; step_ok is False if this all-reduce was cut short by a failure, when the value
        # would be this rank's alone. For effects of your own before the optimizer step, ask
        # ``job.commit()`` first.
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=job.group)
        if job.rank == 0 and step % 20 == 0 and job.step_ok and not job.in_sandbox:
            print(f"step {step}: loss {mean.item() / job.world_size:.6f}", flush=True)

    if args.out and job.rank == 0:
        torch.save(model.state_dict(), args.out)
        print(f"trained {args.steps} steps; weights saved to {args.out}", flush=True)


if __name__ == "__main__":
    main()
