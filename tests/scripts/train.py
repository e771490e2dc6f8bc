"""A small deterministic DDP job: the demo's, the tests' and the benchmarks' training script.

Runs unchanged under torchrun, tm-launch restart mode and tm-launch live mode. Deterministic on
CPU: the model is seeded, each step's batch is seeded by (step, rank), so a run with failures
must end with exactly the parameters of a run without. With ``--random`` the model has dropout
and each rank draws its batches from its own random stream: both are per-rank state
(``job.register(per_rank=True, ...)``) that a re-run step and a joiner must get exactly.
``--device cuda`` puts the model, the batches and the optimizer state on the GPU (initialised on
the CPU first, so the weights do not depend on the device); ``--backend gloo`` then runs two
ranks on one GPU, which NCCL refuses.

Fault injection (a real SIGKILL of this worker, once: a marker file remembers it happened):
``--kill-rank R --kill-step S --kill-phase PHASE`` (``tests/scripts/faults.py``; here ``allreduce`` is
inside the gradient allreduce, ``checkpoint`` mid-write with --ckpt-dir, ``logging``/``logged``
around the loss allreduce of --log-loss).

Repeated fault injection for a long run (the chaos soak, bench/chaos.py): ``--chaos-dir DIR``
(``faults.ChaosDir``, shared with ``tests/scripts/hybrid.py``). A file ``DIR/kill.<rank>`` holding
"<phase> <step>" arms one SIGKILL of the rank's worker at that phase of the first step >= <step>;
it fires once however many processes hold the rank. ``DIR/slow.<node>`` makes that node's
workers slower (a straggler) while it exists; ``DIR/hold`` holds training at the top of the next
step while it exists; ``DIR/fast`` drops --step-sleep; ``DIR/end`` holding N ends the run after N
steps.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
from faults import ChaosDir, Faults  # noqa: E402  (tests/scripts/faults.py, beside this script)

import tm_launch  # noqa: E402


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (stands in for compute)")
    p.add_argument("--out", default=None, help="rank 0 saves the final parameters here")
    p.add_argument("--env-out", default=None, help="rank 0 writes what torch will read for its groups here, after init()")
    p.add_argument("--step-log", default=None, help="append 'time rank step generation' per finished step")
    p.add_argument("--ckpt-dir", default=None, help="restart mode: checkpoint here and resume from it")
    p.add_argument("--ckpt-every", type=int, default=10)
    Faults.add_arguments(p)  # --kill-*, --pause-step, --pause-file
    p.add_argument(
        "--crash-node", default=None, help="workers on this tm-launch node (TM_NODE_ID) SIGKILL themselves at --crash-step, every time"
    )
    p.add_argument("--crash-step", type=int, default=5)
    p.add_argument("--log-loss", action="store_true", help="all-reduce the loss after the optimizer step, as training loops log it")
    p.add_argument("--subgroups", type=int, default=0, help="also allreduce in subgroups of this many consecutive ranks (TP-style)")
    p.add_argument("--subgroup-log", default=None, help="append 'rank step generation communicator-id' per step")
    p.add_argument(
        "--fake-group",
        action="store_true",
        help="also all-reduce in a group of every rank made with torch's 'fake' backend (as torchtitan does)",
    )
    p.add_argument("--slow-node", default=None, help="workers on this tm-launch node (TM_NODE_ID) sleep --slow-factor x step-sleep more")
    p.add_argument("--slow-factor", type=float, default=0.5)
    p.add_argument("--long-every", type=int, default=0, help="every rank's step N x this is --long-factor x --step-sleep long")
    p.add_argument("--long-factor", type=float, default=20.0)
    p.add_argument(
        "--stall-rank", type=int, default=-1, help="this rank sleeps --stall-seconds at the top of --stall-step (a slow checkpoint)"
    )
    p.add_argument("--stall-step", type=int, default=-1)
    p.add_argument("--stall-seconds", type=float, default=0.0)
    p.add_argument("--stall-saving", action="store_true", help="the stall is marked as a checkpoint save (job.checkpointing())")
    p.add_argument(
        "--ballast-mb",
        type=int,
        default=0,
        help="host memory the process holds and has touched, as a trainer holds its data and buffers (its exit takes longer)",
    )
    p.add_argument("--chaos-dir", default=None, help="repeatable fault triggers (see the module docstring)")
    p.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cuda: the model, batches and optimizer state on cuda:LOCAL_RANK (modulo the visible devices)",
    )
    p.add_argument(
        "--backend",
        default=None,
        help="tm_launch.init(backend=...): torch's spellings; gloo carries CUDA tensors through host memory "
        "(two ranks on one GPU: NCCL refuses that)",
    )
    p.add_argument(
        "--random",
        action="store_true",
        help="dropout and a per-rank random data stream, registered as per-rank state (RNG and data position)",
    )
    return p.parse_args()


class RandomBatches:
    """A per-rank data stream whose position is its generator's state (what a stateful
    sampler or loader keeps in its state_dict)."""

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)

    def next(self):
        return torch.randn(16, 32, generator=self.gen), torch.randn(16, 8, generator=self.gen)

    def state_dict(self) -> dict:
        return {"generator": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["generator"])


def kill_now(faults, job, step, phase):
    faults.step = step
    faults.at(job, phase)


def main():
    args = parse()
    chaos = ChaosDir(args.chaos_dir, "train")
    faults = Faults(args, chaos)  # fires chaos triggers too
    ballast = torch.ones(args.ballast_mb * 2**20 // 4) if args.ballast_mb else None  # noqa: F841 -- held for the process's life
    job = tm_launch.init(args.backend)
    if args.env_out and job.rank == 0:
        with open(args.env_out, "w") as f:
            json.dump({k: os.environ.get(k) for k in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_GLOO_LAZY_INIT")}, f)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, args.width),
        torch.nn.Tanh(),
        torch.nn.Linear(args.width, args.width),
        torch.nn.Tanh(),
        torch.nn.Linear(args.width, 8),
    )
    data = None
    if args.random:
        model.insert(2, torch.nn.Dropout(0.2))
        torch.manual_seed(1000 + job.rank)  # dropout masks differ per rank
        data = RandomBatches(seed=2000 + job.rank)
    model.to(device)  # initialised on the CPU first: the same weights on every device
    ddp = DDP(model, process_group=job.group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    start = 0
    if args.ckpt_dir:
        path = os.path.join(args.ckpt_dir, "ckpt.pt")
        if os.path.exists(path):
            state = torch.load(path, map_location=device)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            start = state["step"]
            print(f"[train] rank {job.rank}: resumed from checkpoint at step {start}", flush=True)
    job.register(model=model, optimizer=opt)
    if data is not None:
        job.register(per_rank=True, rng=tm_launch.RNGState(), data=data)
    world = job.world_size
    subgroups = [job.new_group(range(i, i + args.subgroups)) for i in range(0, world, args.subgroups)] if args.subgroups else []
    if args.fake_group:
        importlib.import_module("torch.testing._internal.distributed.fake_pg")  # registers the "fake" backend

        fake = dist.new_group(backend="fake")
    state = {"step": None}

    def on_grad(grad):
        kill_now(faults, job, state["step"], "allreduce")
        return grad

    model[0].weight.register_hook(on_grad)
    opt.register_step_pre_hook(lambda *a: kill_now(faults, job, state["step"], "optimizer"))

    for step in job.steps(args.steps, start=start):
        state["step"] = step
        if data is not None:
            x, y = data.next()
        else:
            g = torch.Generator().manual_seed(step * 1000 + job.rank)
            x = torch.randn(16, 32, generator=g)
            y = torch.randn(16, 8, generator=g)
        x, y = x.to(device), y.to(device)
        if chaos.over(step):  # the soak is over: the loop ends here, on every rank at this step
            job.end_loop()
            break
        chaos.hold(job)
        chaos.start_step(job, step)
        if args.ckpt_dir and job.rank == 0 and step > start and step % args.ckpt_every == 0 and not job.in_sandbox:
            # At the top of the step: the state after step - 1, which every rank completed. (At
            # the end of a live step it could be a step whose collectives failed and runs again.)
            os.makedirs(args.ckpt_dir, exist_ok=True)
            tmp = os.path.join(args.ckpt_dir, "ckpt.pt.tmp")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            kill_now(faults, job, step, "checkpoint")  # dies with the new checkpoint half-written
            os.replace(tmp, os.path.join(args.ckpt_dir, "ckpt.pt"))
        if not job.in_sandbox and step == args.stall_step and job.rank == args.stall_rank:
            with job.checkpointing() if args.stall_saving else contextlib.nullcontext():
                time.sleep(args.stall_seconds)  # its peers wait for it in the step's first collective
        if args.long_every and step % args.long_every == 0 and not job.in_sandbox:
            time.sleep(max(args.step_sleep, 0.01) * (args.long_factor - 1))  # a long step on every rank
        kill_now(faults, job, step, "forward")
        if args.crash_node and os.environ.get("TM_NODE_ID") == args.crash_node and step == args.crash_step and not job.in_sandbox:
            os.kill(os.getpid(), signal.SIGKILL)
        if args.step_sleep and not chaos.fast():
            # The stand-in for compute sits where a step computes, before its gradients are
            # reduced: a rank that fails there is found at the collective, as in real training.
            slow = args.slow_node is not None and os.environ.get("TM_NODE_ID") == args.slow_node
            slow = slow or chaos.slow()
            time.sleep(args.step_sleep * (1 + args.slow_factor if slow else 1))
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if args.log_loss:
            kill_now(faults, job, step, "logging")
            logged = loss.detach().clone()
            dist.all_reduce(logged, group=job.group)
            kill_now(faults, job, step, "logged")
            if job.rank == 0 and not job.in_sandbox and step % 20 == 0 and getattr(job, "step_ok", True):
                print(f"[train] step {step}: mean loss {logged.item() / job.world_size:.5f}", flush=True)
        if subgroups:
            mine = subgroups[job.rank // args.subgroups]
            check = torch.tensor([float(step)], device=device)
            dist.all_reduce(check, group=mine)
            if check.item() != step * args.subgroups:
                raise RuntimeError(f"rank {job.rank} step {step}: its subgroup's sum is {check.item()}, not {step * args.subgroups}")
            if args.subgroup_log and not job.in_sandbox:
                inner = getattr(mine, "inner", mine)
                with open(args.subgroup_log, "a") as f:
                    f.write(f"{job.rank} {step} {getattr(job, 'generation', 0)} {os.getpid()}:{id(inner)}\n")
        if args.fake_group:
            check = torch.tensor([float(step)], device=device)
            dist.all_reduce(check, group=fake)  # torch's fake backend: nothing is sent, nothing changes
            if check.item() != step:
                raise RuntimeError(f"rank {job.rank} step {step}: a 'fake' group's all-reduce gave {check.item()}, not {step}")
        if job.in_sandbox:
            continue
        if args.step_log:
            with open(args.step_log, "a") as f:
                f.write(f"{time.time():.6f} {job.rank} {step} {getattr(job, 'generation', 0)} {os.getpid()}\n")
    if job.rank == 0 and args.out:
        torch.save({k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, args.out)
        print(
            f"[train] finished {min(args.steps, chaos.end(args.steps))} steps; parameters saved to {args.out}",
            flush=True,
        )
    dist.barrier(group=job.group) if dist.is_initialized() else None


if __name__ == "__main__":
    main()
