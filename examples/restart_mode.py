"""Any training script under tm-launch: restart mode, with its progress reported.

    torchrun --standalone --nproc-per-node 2 examples/restart_mode.py --ckpt ckpt.pt
    tm-launch --standalone --nproc-per-node 2 examples/restart_mode.py --ckpt ckpt.pt
    tm-launch --nnodes 2 --nproc-per-node 8 --rdzv-backend etcd-v3 \\
        --rdzv-endpoint ETCD_HOST:2379 --rdzv-id my-run examples/restart_mode.py --ckpt /shared/ckpt.pt

A script that does not use the live API (here plain ``init_process_group`` and DDP) runs in
restart mode: when a worker fails, a spare takes its node's place and every worker restarts,
resuming from the script's own checkpoint, as after a torchrun restart. The one addition is
``tm_launch.report_step(step)`` after each step: the agents then show the step in
``tm-launch ctl status``, draw it in ``ctl timeline``, and their hang watchdog kills a worker
that stops making progress. Under torchrun the call does nothing.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import tm_launch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ckpt", default=None, help="checkpoint file: saved every 50 steps, resumed from")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = 0
    if args.ckpt and os.path.exists(args.ckpt):
        saved = torch.load(args.ckpt)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        step = saved["step"]
    ddp = DDP(model)

    while step < args.steps:
        g = torch.Generator().manual_seed(7919 * step + rank)
        x = torch.randn(32, 20, generator=g)
        loss = F.mse_loss(ddp(x), x[:, :4].sum(dim=1, keepdim=True).sin())
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        tm_launch.report_step(step)  # steps finished so far (a resumed run goes on counting)
        if rank == 0 and step % 50 == 0:
            print(f"step {step}: loss {loss.item():.6f}", flush=True)
            if args.ckpt:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, args.ckpt + ".tmp")
                os.replace(args.ckpt + ".tmp", args.ckpt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
