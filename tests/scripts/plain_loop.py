"""A training loop of its own that calls ``tm_launch.init()`` but never ``job.steps()``: the shape
of a framework's loop (Lightning, Hugging Face) or of a script that only swapped
``init_process_group()`` for ``tm_launch.init()``.

tm-launch cannot repair such a loop in place (it does not know where a step begins or ends), so
the job runs in restart mode: a failure restarts every worker, which resumes from the script's
own checkpoint, here ``--ckpt-dir`` (or from scratch without one). Spares never run it in a
sandbox. Deterministic on CPU: a run with a failure ends with exactly the parameters of a run
without, as under torchrun.

``job.report_step(step)`` after each step tells the agent how far the loop got: ``ctl status``
and ``ctl timeline`` show it, and the hang watchdog watches the worker (nothing under torchrun).

``--unmodified``: a torchrun script that knows nothing of tm-launch (``init_process_group``, no
report): tm-launch counts its steps from its optimizer (``tm_launch.worker.job.optimizer_steps``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
import tm_launch  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", default=None, help="rank 0 saves the final parameters here")
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--kill-marker", default=None, help="kill once: this file records that it happened")
    p.add_argument("--step-sleep", type=float, default=0.02)
    p.add_argument("--unmodified", action="store_true", help="never touch tm_launch: a plain torchrun script")
    args = p.parse_args()

    if args.unmodified:
        dist.init_process_group("gloo")
        report_step = None
    else:
        report_step = tm_launch.init().report_step  # = init_process_group(); no job.steps() below
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = 0
    ckpt = os.path.join(args.ckpt_dir, "ckpt.pt") if args.ckpt_dir else None
    if ckpt and os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    ddp = DDP(model)
    for step in range(start, args.steps):
        if ckpt and rank == 0 and step > start and step % 10 == 0:
            os.makedirs(args.ckpt_dir, exist_ok=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        if rank == args.kill_rank and step == args.kill_step and args.kill_marker and not os.path.exists(args.kill_marker):
            open(args.kill_marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(step * 100 + rank)
        loss = torch.nn.functional.mse_loss(ddp(torch.randn(8, 16, generator=g)), torch.randn(8, 4, generator=g))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if report_step is not None:
            report_step(step + 1)  # the global step count: steps finished
        time.sleep(args.step_sleep)
    if rank == 0 and args.out:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.out)
    dist.barrier()


if __name__ == "__main__":
    main()
