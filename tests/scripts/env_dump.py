"""Dump what a launcher gives a worker: torchrun's env vars, argv and one gloo allreduce.

Each worker writes ``<outdir>/rank<RANK>.json``; tests/e2e/test_torchrun_compat.py runs it under
torchrun and tm-launch and compares. Any extra arguments are accepted and recorded in argv.
With ``--fail-rank R`` no group is formed: each worker writes its env to
``<outdir>/attempt<N>/rank<RANK>.json`` (N = ``TORCHELASTIC_RESTART_COUNT``), rank R raises
(``main`` is torch's ``@record``, so the traceback lands in the error file) and the others wait
to be stopped by the launcher: the failure report and the restart layout can be compared.

    torchrun --standalone --nproc-per-node 2 tests/scripts/env_dump.py --out DIR [--foo bar ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

# Every variable torchrun's agent defines for a worker (torch/distributed/elastic/agent/server/
# local_elastic_agent.py and torch/distributed/run.py).
TORCHRUN_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "OMP_NUM_THREADS",
    "TORCHELASTIC_SIGNALS_TO_HANDLE",
    "TORCHELASTIC_ERROR_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)


@record
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="directory for rank<RANK>.json")
    parser.add_argument("--fail-rank", type=int, default=None, help="this rank raises before any group forms, in every attempt")
    args, _ = parser.parse_known_args()
    env = {k: os.environ[k] for k in TORCHRUN_ENV if k in os.environ}
    if args.fail_rank is not None:
        fail(args.out, args.fail_rank, env)
    # Anything else launcher-ish, for information (compared by the tests only where stated).
    other = {k: v for k, v in os.environ.items() if k not in env and (k.startswith(("TORCHELASTIC_", "PET_", "TORCH_NCCL_", "TM_")))}
    dist.init_process_group("gloo")  # env:// with the launcher's MASTER_ADDR/PORT, RANK, WORLD_SIZE
    rank, world = dist.get_rank(), dist.get_world_size()
    value = torch.tensor([float(rank + 1)], dtype=torch.float64)
    dist.all_reduce(value)
    gathered = [None] * world
    dist.all_gather_object(gathered, os.environ.get("LOCAL_RANK"))
    result = {
        "env": env,
        "other_env": other,
        "argv": sys.argv,
        "rank": rank,
        "world_size": world,
        "allreduce": value.item(),
        "local_ranks": gathered,
        "pid": os.getpid(),
    }
    write(os.path.join(args.out, f"rank{os.environ.get('RANK', rank)}.json"), result)
    dist.barrier()
    dist.destroy_process_group()


def write(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


def fail(out: str, fail_rank: int, env: dict) -> None:
    rank = int(os.environ["RANK"])
    write(os.path.join(out, f"attempt{os.environ['TORCHELASTIC_RESTART_COUNT']}", f"rank{rank}.json"), {"env": env})
    if rank == fail_rank:
        raise ValueError(f"env_dump: rank {rank} fails on purpose")
    time.sleep(120)  # the launcher stops this worker when its peer fails
    sys.exit(f"rank {rank}: the launcher did not stop this worker after rank {fail_rank} failed")


if __name__ == "__main__":
    main()
