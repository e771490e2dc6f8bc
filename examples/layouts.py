"""Hybrid parallel layouts on a DeviceMesh with tm-launch's live API.

    torchrun --standalone --nproc-per-node 4 examples/layouts.py --layout fsdp-tp
    tm-launch --standalone --nproc-per-node 4 examples/layouts.py --layout hsdp
    tm-launch --nnodes 2 --nproc-per-node 2 --rdzv-backend etcd-v3 \\
        --rdzv-endpoint ETCD_HOST:2379 --rdzv-id my-run examples/layouts.py --layout ddp-tp

Layouts (any even world size; the mesh is built for the world the job has):

* ``fsdp``: FSDP2 (``fully_shard``) over every rank.
* ``hsdp``: FSDP2 on a 2-d (replicate, shard) mesh: each shard is held by 2 ranks.
* ``fsdp-tp``: tensor parallel (``parallelize_module``) inside pairs of ranks, FSDP2 across them.
* ``ddp-tp``: tensor parallel inside pairs of ranks, gradients averaged across them (DDP-style).
* ``zero``: data parallel with ``ZeroRedundancyOptimizer``: each rank's optimizer state is its own.

A lost rank is repaired live from a live rank that holds the same state: tm-launch reads that
off the DTensors' placements (``hsdp``'s replicate peer, ``ddp-tp``'s data-parallel peer), and
off ``job.register(..., replicas=...)`` for plain tensors. Where a rank's shard exists nowhere
else (``fsdp``, ``fsdp-tp``, ``zero``'s optimizer partitions), it comes back from the rank's
in-memory snapshot, which tm-launch keeps on the next node (``--snapshot-every``); the
checkpoint (``--ckpt-dir``) is for what snapshots cannot cover (two neighbouring nodes lost at
once, a restart). Build everything rank-dependent after ``tm_launch.init()``, from ``job.rank``:
a spare that takes over a rank runs the script again for it.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import tm_launch


class MLPBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class Model(nn.Module):
    def __init__(self, dim: int = 32, depth: int = 2):
        super().__init__()
        self.embed = nn.Linear(16, dim)
        self.blocks = nn.Sequential(*(MLPBlock(dim) for _ in range(depth)))
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)))


def parallelize(model: Model, layout: str, rank: int, world: int):
    """Apply ``layout``; returns (model, data-parallel group to average gradients over or None,
    this rank's data-parallel index, the ranks holding copies of the plain tensors or None)."""
    dp_index = rank  # which batch this rank trains on
    if layout in ("fsdp-tp", "ddp-tp"):
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        for block in model.blocks:  # Megatron-style: split `up` by columns and `down` by rows
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        dp_index = mesh["dp"].get_local_rank()  # both ranks of a tp pair see the same batch
        if layout == "ddp-tp":
            # embed and head stay plain tensors, identical on every rank of the mesh: say so.
            return model, mesh["dp"].get_group(), dp_index, mesh
        shard_mesh = mesh["dp"]
    elif layout == "zero":  # plain data parallel: the model is the same on every rank
        return model, dist.group.WORLD, dp_index, None
    elif layout == "hsdp":
        shard_mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:  # fsdp
        shard_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    for block in model.blocks:
        fully_shard(block, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    return model, None, dp_index, None  # every parameter is a DTensor now: it carries its layout


def average_gradients(model: nn.Module, group) -> None:
    """DDP's job by hand: the mean gradient over the data-parallel group (TP shards included)."""
    for p in model.parameters():
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        dist.all_reduce(grad, group=group)  # gloo has no ReduceOp.AVG
        grad.div_(dist.get_world_size(group))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=("fsdp", "hsdp", "fsdp-tp", "ddp-tp", "zero"), default="fsdp-tp")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--ckpt-dir", default=None, help="checkpoint here (DCP) and resume from it")
    parser.add_argument("--ckpt-every", type=int, default=25)
    args = parser.parse_args()
    if args.layout == "zero" and args.ckpt_dir:
        parser.error("--ckpt-dir: this example checkpoints with torch.distributed.checkpoint, which does not take a "
                     "ZeroRedundancyOptimizer (consolidate_state_dict() on one rank and torch.save() it instead)")  # fmt: skip

    job = tm_launch.init()
    torch.manual_seed(0)  # the same full model everywhere before it is split
    model, dp_group, dp_index, replicas = parallelize(Model(), args.layout, job.rank, job.world_size)
    if args.layout == "zero":  # tm-launch registers this rank's partition
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=3e-3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    job.register(model=model, optimizer=opt, replicas=replicas)

    start = 0
    latest = os.path.join(args.ckpt_dir, "latest") if args.ckpt_dir else None
    if latest and os.path.exists(latest) and not job.in_sandbox:  # a joiner gets the live state instead
        with open(latest) as f:
            start = int(f.read())
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=os.path.join(args.ckpt_dir, str(start)))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if job.rank == 0:
            print(f"resumed from the checkpoint of step {start}", flush=True)

    for step in job.steps(args.steps, start=start):
        if args.ckpt_dir and step > start and step % args.ckpt_every == 0 and not job.in_sandbox:
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(args.ckpt_dir, str(step)))
            if job.rank == 0:  # written once the checkpoint is complete on every rank
                with open(latest + ".tmp", "w") as f:
                    f.write(str(step))
                os.replace(latest + ".tmp", latest)
        g = torch.Generator().manual_seed(step * 100 + dp_index)
        x = torch.randn(8, 16, generator=g)
        loss = F.mse_loss(model(x), x[:, :4].cos())
        opt.zero_grad(set_to_none=True)
        loss.backward()  # FSDP2 reduce-scatters; tensor parallel all-reduces inside each pair
        if dp_group is not None:
            average_gradients(model, dp_group)
        opt.step()
        if job.rank == 0 and step % 20 == 0 and job.step_ok and not job.in_sandbox:
            print(f"[{args.layout}] step {step}: loss {loss.item():.6f}", flush=True)


if __name__ == "__main__":
    main()
