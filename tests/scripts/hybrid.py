"""Hybrid-parallel training the way torchtitan and Megatron users write it, live under tm-launch.

One script, seven layouts (4 ranks unless said otherwise; ``pp`` on 2 ranks has no
data-parallel peer):

* ``fsdp-tp``: FSDP2 (``fully_shard``) over ``dp`` x DTensor tensor parallel
  (``ColwiseParallel``/``RowwiseParallel``) over ``tp``: every rank holds a shard no other rank
  holds (FSDP shards what TP left whole), so a lost rank is recovered from its in-memory
  snapshot on the next node (from the checkpoint with snapshots off).
* ``ddp-tp``: tensor parallel over ``tp``, gradients all-reduced over ``dp`` (DDP-style
  replicate): rank r's replica is the ``dp`` peer with the same ``tp`` coordinate.
* ``hsdp``: FSDP2 on a 2-d ``(replicate, shard)`` mesh: shards replicated across ``replicate``.
* ``pp``: 2 pipeline stages x 2 data-parallel replicas, stages talk point-to-point
  (``dist.send``/``dist.recv`` on the ``pp`` group), each stage's gradients all-reduced over ``dp``;
  the state is registered with ``replicas=`` the stage's ``dp`` group.
* ``fsdp``: FSDP2 over the whole world, no replica at all: a lost rank's shard exists nowhere
  else but in its in-memory snapshot (on the next node); with snapshots off, the job falls back
  to its newest checkpoint (``--ckpt-dir``, written with ``torch.distributed.checkpoint``) and
  says which steps were lost.
* ``zero``: data parallel with ``ZeroRedundancyOptimizer`` (ZeRO-1): the parameters are
  replicated, each rank's optimizer state is its own partition.
* ``tp-plain``: a ``(dp, tp)`` mesh whose ``tp`` positions hold different plain tensors (each
  position's model seeded by its ``tp`` coordinate, as scripts that shard by hand do), gradients
  all-reduced over ``dp``, registered without ``replicas=``: tm-launch must find that rank r's
  replica is its ``dp`` peer. Its checkpoint is one ``torch.save`` per rank (DCP would save one
  copy of a plain tensor for every rank).

Runs unchanged under ``torchrun`` (``tm_launch.init`` is then ``init_process_group``). Everything
rank-dependent is built after ``tm_launch.init()`` from ``job.rank``: a spare promoted to a rank
it did not warm up as runs this script again from the top for the rank it got.

Deterministic on CPU: the model is seeded and each step's batch is seeded by (step, data-parallel
index), so a run with failures ends with exactly the state of a run without, on every rank
(``--out PREFIX`` writes each rank's local shards of the parameters and optimizer state to
``PREFIX.rank<r>``). The loss is all-reduced after the optimizer step, as loops log it.

Fault injection: ``--kill-rank R --kill-step S --kill-phase PHASE`` once
(``tests/scripts/faults.py``); repeatedly for the chaos soak (``bench/chaos.py --layout``),
``--chaos-dir DIR`` (``faults.ChaosDir``, as ``tests/scripts/train.py``): ``DIR/kill.<rank>``
holding "<phase> <step>" with this script's phases (``forward``, ``backward``, ``optimizer``,
``logging``, ``logged``) or a runtime point (``vote``, ``snapshot``...), ``DIR/slow.<node>`` (a
straggler: ``--slow-factor`` x ``--step-sleep`` more), ``DIR/hold``, ``DIR/fast``, ``DIR/end``.
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
from faults import ChaosDir, Faults  # noqa: E402  (tests/scripts/faults.py, beside this script)

import tm_launch  # noqa: E402

LAYOUTS = ("fsdp-tp", "ddp-tp", "hsdp", "pp", "fsdp", "zero", "tp-plain")


class Block(nn.Module):
    def __init__(self, d: int, h: int, dropout: float = 0.0):
        super().__init__()
        self.w1 = nn.Linear(d, h)
        self.w2 = nn.Linear(h, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.w2(self.drop(torch.tanh(self.w1(x))))


class Net(nn.Module):
    def __init__(self, d: int = 32, h: int = 64, depth: int = 2, dropout: float = 0.0):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.blocks = nn.ModuleList(Block(d, h, dropout) for _ in range(depth))
        self.out = nn.Linear(d, 8)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--layout", choices=LAYOUTS, default="fsdp-tp")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (stands in for compute)")
    p.add_argument("--out", default=None, help="each rank writes its local state to OUT.rank<r>")
    p.add_argument("--step-log", default=None, help="append 'time rank step generation pid' per finished step")
    p.add_argument("--ckpt-dir", default=None, help="checkpoint with torch.distributed.checkpoint and resume from it")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cuda: the mesh, model, batches and optimizer state on cuda:LOCAL_RANK (modulo the visible devices)",
    )
    p.add_argument("--backend", default=None, help="tm_launch.init(backend=...): gloo runs several ranks on one GPU (ddp-tp, hsdp, fsdp*)")
    p.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        help="dropout in every block, each rank drawing from its own generator: per-rank state (job.register(per_rank=True))",
    )
    p.add_argument("--width", type=int, default=64, help="hidden width of the blocks (the state grows with it)")
    p.add_argument(
        "--log-per-replica",
        action="store_true",
        help="hsdp: after the world's, all-reduce the logged loss over each replicate group too (a collective after the "
        "commit in a group that a substitution can keep)",
    )
    Faults.add_arguments(p)
    p.add_argument("--chaos-dir", default=None, help="repeatable fault triggers (faults.ChaosDir, the chaos soak)")
    p.add_argument("--slow-factor", type=float, default=0.5, help="a straggler (DIR/slow.<node>) sleeps this x --step-sleep more")
    return p.parse_args()


def batch(step: int, dp_index: int):
    g = torch.Generator().manual_seed(step * 1000 + dp_index)
    return torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)


def build(layout: str, rank: int, world: int, device: torch.device = torch.device("cpu"), dropout: float = 0.0, width: int = 64):
    """The model, what to train and how, for ``rank``: (modules to register, the step function's
    pieces, the data-parallel index of this rank, the ``replicas`` declaration)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    net = Net(h=width, dropout=dropout).to(device)  # initialised on the CPU: the same weights on every device
    if layout == "zero":  # data parallel, every rank's optimizer state its own partition (ZeRO-1)
        return net, dist.group.WORLD, rank, None, None
    if layout == "tp-plain":  # each tp position its own plain tensors, nothing declared
        mesh = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(mesh["tp"].get_local_rank())
        net = Net(h=width, dropout=dropout).to(device)
        return net, mesh["dp"].get_group(), mesh["dp"].get_local_rank(), None, mesh
    if layout in ("fsdp-tp", "ddp-tp"):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("dp", "tp"))
        for block in net.blocks:
            parallelize_module(block, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        if layout == "fsdp-tp":
            from torch.distributed.fsdp import fully_shard

            for block in net.blocks:
                fully_shard(block, mesh=mesh["dp"])
            model = fully_shard(net, mesh=mesh["dp"])
            sync = None
        else:
            model, sync = net, mesh["dp"].get_group()
        return model, sync, mesh["dp"].get_local_rank(), None, mesh
    if layout in ("hsdp", "fsdp"):
        from torch.distributed.fsdp import fully_shard

        if layout == "hsdp":
            mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
        for block in net.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(net, mesh=mesh), None, rank, None, mesh
    # pp: stage s of 2 holds half of the network; dp replicas of each stage
    mesh = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("dp", "pp"))
    stage = mesh["pp"].get_local_rank()
    part = nn.Sequential(net.inp, net.blocks[0]) if stage == 0 else nn.Sequential(net.blocks[1], net.out)
    return part, mesh["dp"].get_group(), mesh["dp"].get_local_rank(), mesh["dp"].get_group(), mesh


def local_state(model, opt) -> dict:
    """This rank's shards of the parameters and optimizer state, as plain tensors (a ZeRO
    optimizer's: its own partition)."""
    from torch.distributed.tensor import DTensor

    opt = getattr(opt, "optim", opt)

    def plain(t):
        return (t.to_local() if isinstance(t, DTensor) else t).detach().cpu().clone()

    out = {f"param/{k}": plain(v) for k, v in model.named_parameters()}
    for i, (p, s) in enumerate(
        zip((p for g in opt.param_groups for p in g["params"]), (opt.state[p] for g in opt.param_groups for p in g["params"]))
    ):
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                out[f"opt/{i}/{k}"] = plain(v)
    return out


def checkpoint(args, model, opt, sched, step: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if args.layout == "tp-plain":
        os.makedirs(args.ckpt_dir, exist_ok=True)
        own = {"model": model.state_dict(), "optim": opt.state_dict()}
        torch.save(own, os.path.join(args.ckpt_dir, f"step{step}.rank{dist.get_rank()}"))
        dist.barrier()  # every rank's file is complete before "latest" names the step
    else:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(args.ckpt_dir, f"step{step}"))
    if dist.get_rank() == 0:
        with open(os.path.join(args.ckpt_dir, "latest.tmp"), "w") as f:
            f.write(f"{step} {sched.last_epoch}\n")
        os.replace(os.path.join(args.ckpt_dir, "latest.tmp"), os.path.join(args.ckpt_dir, "latest"))


def resume(args, model, opt, sched) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    try:
        with open(os.path.join(args.ckpt_dir, "latest")) as f:
            step, epoch = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return 0
    if args.layout == "tp-plain":
        own = torch.load(os.path.join(args.ckpt_dir, f"step{step}.rank{dist.get_rank()}"))
        model.load_state_dict(own["model"])
        opt.load_state_dict(own["optim"])
    else:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=os.path.join(args.ckpt_dir, f"step{step}"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sched.last_epoch = epoch
    sched._last_lr = [g["lr"] for g in opt.param_groups]
    print(f"[hybrid] rank {dist.get_rank()}: resumed from the checkpoint of step {step}", flush=True)
    return step


def main():
    args = parse()
    chaos = ChaosDir(args.chaos_dir, "hybrid")
    faults = Faults(args, chaos)
    job = tm_launch.init(args.backend)
    rank, world = job.rank, job.world_size
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    model, sync, dp_index, replicas, mesh = build(args.layout, rank, world, device, args.dropout, args.width)
    # foreach=False: on CUDA, AdamW's default multi-tensor path refuses a list that mixes DTensors
    # (the TP-sharded blocks) with plain tensors (ddp-tp's input and output layers); the CPU
    # default is this per-tensor path already.
    if args.layout == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2, weight_decay=0.01, foreach=False)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
    # A spare's sandbox and a joining rank have no peers before steps(), and their state comes
    # from a live replica: only ranks that start the generation together load the checkpoint.
    start = resume(args, model, opt, sched) if args.ckpt_dir and not job.in_sandbox else 0
    job.register(model=model, optimizer=opt, scheduler=sched, replicas=replicas)
    if args.dropout:  # each rank's own dropout masks: its generator is per-rank state
        torch.manual_seed(1000 + rank)
        job.register(per_rank=True, rng=tm_launch.RNGState())
    faults.arm_backward(model, job)
    stepping = opt.optim if args.layout == "zero" else opt  # ZeRO steps its inner optimizer over its partition
    stepping.register_step_pre_hook(lambda *a: faults.at(job, "optimizer"))
    pp = mesh["pp"].get_group() if args.layout == "pp" else None
    stage = mesh["pp"].get_local_rank() if pp is not None else 0
    # gloo's point-to-point reads host memory only (a CUDA tensor's pointer fails in writev):
    # pipeline activations and their gradients cross stages through the host when on gloo.
    wire = torch.device("cpu") if args.backend == "gloo" else device

    def send(t, stage_to):
        dist.send(t.to(wire), dst=dist.get_global_rank(pp, stage_to), group=pp)

    def recv(stage_from):
        buf = torch.empty(8, 32, device=wire)
        dist.recv(buf, src=dist.get_global_rank(pp, stage_from), group=pp)
        return buf.to(device)

    for step in job.steps(args.steps, start=start):
        if chaos.over(step):  # the soak is over: the loop ends here, on every rank at this step
            job.end_loop()
            break
        chaos.hold(job)
        chaos.start_step(job, step)
        faults.step = step
        if args.ckpt_dir and step > start and step % args.ckpt_every == 0 and not job.in_sandbox:
            checkpoint(args, model, opt, sched, step)  # at the top: the state after step - 1
        x, y = (t.to(device) for t in batch(step, dp_index))
        faults.at(job, "forward")
        if args.step_sleep and not chaos.fast():
            # stands in for the compute, before the gradients are reduced
            time.sleep(args.step_sleep * (1 + args.slow_factor if chaos.slow() else 1))
        opt.zero_grad(set_to_none=True)
        if pp is None:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
        elif stage == 0:
            act = model(x)
            send(act.detach(), 1)
            act.backward(recv(1))
            loss = torch.zeros((), device=device)
        else:
            act = recv(0).requires_grad_(True)
            loss = nn.functional.mse_loss(model(act), y)
            loss.backward()
            send(act.grad, 0)
        if sync is not None:  # data-parallel gradient averaging over the replicas
            for p in model.parameters():
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                dist.all_reduce(g, group=sync)
                g.div_(sync.size())
        opt.step()
        sched.step()
        faults.at(job, "logging")
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        faults.at(job, "logged")
        if args.log_per_replica and args.layout == "hsdp":
            dist.all_reduce(logged, group=mesh["replicate"].get_group())
        if rank == 0 and not job.in_sandbox and step % 10 == 0 and job.step_ok:
            print(f"[hybrid] step {step}: loss {logged.item() / world:.5f}", flush=True)
        if args.step_log and not job.in_sandbox:
            faults.log_step(args.step_log, job, step)
    if args.out:
        torch.save(local_state(model, opt), f"{args.out}.rank{rank}")
    dist.barrier()


if __name__ == "__main__":
    main()
