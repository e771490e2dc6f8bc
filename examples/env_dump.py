"""Dump what a launcher gives a worker: torchrun's env vars, argv and one gloo allreduce.

Each worker writes ``<outdir>/rank<RANK>.json``; tests/test_torchrun_compat.py runs it under
torchrun and tm-launch and compares. Any extra arguments are accepted and recorded in argv.

    torchrun --standalone --nproc-per-node 2 examples/env_dump.py --out DIR [--foo bar ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

# Every variable torchrun's agent defines for a worker (torch/distributed/elastic/agent/server/
# local_elastic_agent.py and torch/distributed/run.py).
TORCHRUN_ENV = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS",
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="directory for rank<RANK>.json")
    args, _ = parser.parse_known_args()
    env = {k: os.environ[k] for k in TORCHRUN_ENV if k in os.environ}
    # Anything else launcher-ish, for information (compared by the tests only where stated).
    other = {k: v for k, v in os.environ.items()
             if k not in env and (k.startswith(("TORCHELASTIC_", "PET_", "TORCH_NCCL_", "TM_")))}
    dist.init_process_group("gloo")  # env:// with the launcher's MASTER_ADDR/PORT, RANK, WORLD_SIZE
    rank, world = dist.get_rank(), dist.get_world_size()
    value = torch.tensor([float(rank + 1)], dtype=torch.float64)
    dist.all_reduce(value)
    gathered = [None] * world
    dist.all_gather_object(gathered, os.environ.get("LOCAL_RANK"))
    record = {
        "env": env, "other_env": other, "argv": sys.argv, "rank": rank, "world_size": world,
        "allreduce": value.item(), "local_ranks": gathered, "pid": os.getpid(),
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"rank{os.environ.get('RANK', rank)}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
