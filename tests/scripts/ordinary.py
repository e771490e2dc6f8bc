"""A training script as a torchrun user writes it, plus ``tm_launch.init()``: nothing registered
beyond model, optimizer and scheduler, state the user never thinks of as state.

- BatchNorm (``--bn``): running statistics are buffers every rank updates from its own batch;
  under DDP with ``--broadcast-buffers`` (torch's default) rank 0's are broadcast each forward,
  with ``--no-broadcast-buffers`` each rank keeps its own; under ``--layout fsdp`` nobody syncs them.
- ``--layout ddp-tp``: a 2-D ``DeviceMesh`` (dp x tp, 4 ranks or any multiple of 2), an MLP
  block after the BatchNorm split Megatron-style with ``parallelize_module`` (``ColwiseParallel``
  / ``RowwiseParallel``) over ``tp``, and torch's DDP over the ``dp`` dimension
  (``DDP(model, device_mesh=mesh["dp"])``, which localizes the DTensor parameters for its
  buckets). Both ranks of a tp pair train on the same batch (seeded by the dp index).
- Dropout (``--dropout``) drawn from torch's global RNG, seeded per rank, never registered.
- A forward counter (``--counter``): a buffer every rank bumps identically in its forward.
- ``--hidden``: a counter the script keeps in a closure and folds into the weights after each
  step: state nothing can find (neither an object with ``state_dict()`` nor a variable of the
  loop's frame; a joiner starts it at 0).

Each rank writes its whole state at the end, ``--out DIR/rank<r>.pt``: the model's
``state_dict()`` (buffers included; a DTensor as its local shard), the optimizer's, the
scheduler's, and the tensors the optimizer trains. With ``--compile`` each process also appends
one JSON line per step it runs, a spare's warm-up steps included, to ``DIR/compile.jsonl``
(``tests/scripts/compile_records.py``, as the torchtitan harness's ``TT_COMPILE_LOG``): the graphs Dynamo
has compiled so far (the recompiles a test counts), the seconds spent compiling them, and when
the step started and ended (what ``bench/compile_cost.py`` reads). ``--step-log FILE``: ``time
rank step generation pid`` per step of the job. Fault points: ``tests/scripts/faults.py`` (``--kill-rank``, ``--kill-phase`` ...).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
from compile_records import append, compile_record  # noqa: E402  (beside this script)
from faults import BetweenSteps, ChaosDir, Faults  # noqa: E402  (tests/scripts/faults.py, beside this script)

import tm_launch  # noqa: E402


class Net(nn.Module):
    def __init__(self, width: int, bn: bool, dropout: float, counter: bool, mlp: bool = False):
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.bn = nn.BatchNorm1d(width) if bn else nn.Identity()
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        if mlp:  # the block tensor parallelism splits (--layout ddp-tp)
            self.up = nn.Linear(width, 2 * width)
            self.down = nn.Linear(2 * width, width)
        self.mlp = mlp
        self.out = nn.Linear(width, 1)
        if counter:
            self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.counter = counter

    def forward(self, x):
        if self.counter:
            self.calls += 1
        h = self.drop(torch.relu(self.bn(self.inp(x))))
        if self.mlp:
            h = h + self.down(torch.relu(self.up(h)))
        return self.out(h)


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def flat(prefix: str, obj, out: dict) -> None:
    if isinstance(obj, torch.Tensor):
        out[prefix] = local(obj).detach().clone()
    elif isinstance(obj, dict):
        for k, v in obj.items():
            flat(f"{prefix}/{k}", v, out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            flat(f"{prefix}/{i}", v, out)
    elif isinstance(obj, (int, float, bool, str)) or obj is None:
        out[prefix] = obj


def counter():
    """A count in a closure's cell: state no frame variable or object of the script shows."""
    count = 0

    def bump() -> int:
        nonlocal count
        count += 1
        return count

    return bump


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--layout", choices=["ddp", "fsdp", "ddp-tp"], default="ddp")
    p.add_argument("--bn", action="store_true")
    p.add_argument("--broadcast-buffers", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--counter", action="store_true")
    p.add_argument("--hidden", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile: the DDP model, or each FSDP2 block")
    p.add_argument("--log-loss", action="store_true", help="all-reduce the loss after the optimizer step")
    p.add_argument("--out", required=True)
    p.add_argument("--step-log", default=None, help="append 'time rank step generation pid' per step of the job")
    p.add_argument("--step-sleep", type=float, default=0.0, help="every rank sleeps this long in each step's compute (a longer run)")
    p.add_argument("--timeout", type=float, default=0.0, help="tm_launch.init(timeout=timedelta(seconds=...)), as torch takes it")
    p.add_argument("--chaos-dir", default=None, help="several kills: DIR/kill.<rank> holding '<phase> <step>' (faults.ChaosDir)")
    Faults.add_arguments(p)
    BetweenSteps.add_arguments(p)
    args = p.parse_args()

    job = tm_launch.init(timeout=datetime.timedelta(seconds=args.timeout) if args.timeout else None)
    rank, world = job.rank, job.world_size
    torch.manual_seed(0)
    model = Net(args.width, args.bn, args.dropout, args.counter, mlp=args.layout == "ddp-tp")
    data_rank = rank  # whose batch this rank trains on
    if args.layout == "ddp":
        model = DDP(model, process_group=job.group, broadcast_buffers=args.broadcast_buffers)
        if args.compile:
            model = torch.compile(model)
    elif args.layout == "ddp-tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        model = DDP(model, device_mesh=mesh["dp"], broadcast_buffers=args.broadcast_buffers)
        data_rank = mesh["dp"].get_local_rank()
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        if args.compile:  # per-block compile, as torchtitan does: each block compiled, then the compiled one sharded
            for name in ("inp", "out"):  # (block.compile() would compile Module._call_impl, a frame Dynamo skips: nothing)
                block = torch.compile(getattr(model, name))
                model.register_module(name, block)
                fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
    job.register(model=model, optimizer=opt, scheduler=sched)
    torch.manual_seed(1000 + rank)  # dropout: each rank its own stream, as scripts seed it
    hidden = counter()
    faults = Faults(args, ChaosDir(args.chaos_dir))
    faults.arm_backward(model, job)
    between = BetweenSteps(args)
    os.makedirs(args.out, exist_ok=True)
    for step in job.steps(args.steps):
        faults.step = step
        started = time.time()
        g = torch.Generator().manual_seed(1 + step * 97 + data_rank)
        x = torch.randn(16, 8, generator=g)
        y = x[:, :1] * 0.5 + torch.randn(16, 1, generator=g) * 0.1
        faults.at(job, "forward")
        if args.step_sleep:
            time.sleep(args.step_sleep)  # stands in for compute, on every rank alike
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        faults.at(job, "optimizer")
        opt.step()
        sched.step()
        opt.zero_grad()
        if args.hidden:
            bump = hidden() * 1e-4
            with torch.no_grad():
                for param in model.parameters():
                    local(param).add_(bump)
        faults.at(job, "logging")
        if args.log_loss:
            dist.all_reduce(loss.detach(), group=job.group)
        faults.at(job, "logged")
        between.after_step(job, step, model)
        if args.compile:
            append(os.path.join(args.out, "compile.jsonl"), compile_record(rank, step, job.in_sandbox, started))
        if args.step_log and not job.in_sandbox:
            faults.log_step(args.step_log, job, step)
    state: dict = {}
    flat("model", model.state_dict(), state)
    flat("optimizer", opt.state_dict(), state)
    # What the optimizer trains, by position: DDP x TP's wrapper (torch's _pre_dp_module_transform)
    # leaves the tensor-parallel weights as plain attributes after the first forward, outside
    # state_dict().
    flat("trained", [p for group in opt.param_groups for p in group["params"]], state)
    flat("scheduler", sched.state_dict(), state)
    os.makedirs(args.out, exist_ok=True)
    torch.save(state, os.path.join(args.out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
