"""``found_state.py``'s loop at module level, as short scripts write it: ``tokens_seen`` and the
EMA are globals of the script. Same arguments and output as ``found_state.py`` (``--ema``,
``--tokens``, ``--log-loss``, ``--out``, the fault points of ``tests/scripts/faults.py``)."""

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

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=24)
p.add_argument("--ema", action="store_true")
p.add_argument("--tokens", action="store_true")
p.add_argument("--log-loss", action="store_true")
p.add_argument("--out", required=True)
Faults.add_arguments(p)
args = p.parse_args()

job = tm_launch.init()
rank = job.rank
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9)) if args.ema else None
model = DDP(net, process_group=job.group)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
job.register(model=model, optimizer=opt)
tokens_seen = 0
faults = Faults(args)
faults.arm_backward(model, job)
for step in job.steps(args.steps):
    faults.step = step
    if args.tokens:
        for group in opt.param_groups:
            group["lr"] = 1e-2 * min(1.0, (tokens_seen + 1) / 400)
    g = torch.Generator().manual_seed(1 + step * 97 + rank)
    n = 8 + step % 5
    x = torch.randn(n, 8, generator=g)
    y = x[:, :1] * 0.5 + torch.randn(n, 1, generator=g) * 0.1
    faults.at(job, "forward")
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    faults.at(job, "logging")
    if ema is not None:
        ema.update_parameters(net)
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
state["tokens_seen"] = tokens_seen
os.makedirs(args.out, exist_ok=True)
torch.save(state, os.path.join(args.out, f"rank{rank}.pt"))
