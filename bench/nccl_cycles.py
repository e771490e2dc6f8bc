#!/usr/bin/env python3
"""Generation cycles in one process: build a communicator on a fresh store prefix, one
allreduce, abort, build again; N times. Time per cycle and what the process keeps.

    python3 bench/nccl_cycles.py --cycles 50             # NCCL (one GPU) and gloo
    python3 bench/nccl_cycles.py --cycles 50 --only gloo  # CPU machine

World size 1 (NCCL refuses two ranks on one GPU), through ``tm_launch.worker.comms.communicators.build``
(the runtime's one builder: gloo for CPU tensors, non-blocking NCCL for CUDA tensors) on a
real TCPStore, each cycle under its own ``tm/g<N>/`` prefix as the runtime does. A cycle is:
build, allreduce a 1 MiB tensor (CUDA for nccl, CPU for gloo) and synchronise, abort the
group's NCCL communicators (``communicators.abort``), drop the group; abort and drop are timed
apart. NCCL runs a second time with the group handed to ``communicators.release``
(abort and destruction on a thread per group), as the runtime should do it; "after" is read
once those threads are done. The first cycle (CUDA
context, NCCL's first init) is reported apart and left out of the statistics. Before/after:
GPU memory in use on the device (``cudaMemGetInfo``: NCCL's buffers are outside torch's
allocator), the allocator's reserved bytes, and the process's OS threads (/proc/self/task).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# as the agent sets it for live workers: an aborted communicator must not end the process
os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tm_launch.worker.comms import communicators  # noqa: E402


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def snapshot(cuda: bool) -> dict:
    gc.collect()
    s = {"threads": threads()}
    if cuda:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        s.update(device_used_mib=round((total - free) / 2**20, 1), reserved_mib=round(torch.cuda.memory_reserved() / 2**20, 1))
    return s


def cycle(store, gen: int, backend: str, release: bool) -> dict:
    cuda = backend == "nccl"
    devices = ["cpu", "cuda:0"] if cuda else ["cpu"]
    t0 = time.perf_counter()
    pg = communicators.build(dist.PrefixStore(f"tm/g{gen}/world/", store), 0, 1, devices=devices, timeout_s=30, setup_timeout_s=60)
    t_built = time.perf_counter()
    x = torch.ones(1 << 18, device="cuda" if cuda else "cpu")
    pg.allreduce([x]).wait()
    if cuda:
        torch.cuda.synchronize()
    assert x[0].item() == 1.0
    t_reduced = time.perf_counter()
    del x
    if release:
        aborted = communicators.release(pg)
        del pg
        t_aborted = t_done = time.perf_counter()
    else:
        aborted = communicators.abort(pg)
        t_aborted = time.perf_counter()
        del pg
        t_done = time.perf_counter()
    return {
        "build": t_built - t0,
        "first_allreduce": t_reduced - t_built,
        "abort": t_aborted - t_reduced,
        "drop": t_done - t_aborted,
        "cycle": t_done - t0,
        "aborted": aborted,
    }


def stats(values: list[float]) -> dict:
    values = sorted(values)
    return {
        "median_ms": round(1000 * statistics.median(values), 2),
        "p90_ms": round(1000 * values[int(0.9 * (len(values) - 1))], 2),
        "max_ms": round(1000 * values[-1], 2),
    }


def run(backend: str, cycles: int, release: bool) -> dict:
    cuda = backend == "nccl"
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
    if cuda:
        torch.ones(1, device="cuda")  # the CUDA context exists before "before"
    first = cycle(store, 0, backend, release)
    before = snapshot(cuda)
    rounds = [cycle(store, g, backend, release) for g in range(1, cycles + 1)]
    if release:
        assert communicators.wait_released(120)
    after = snapshot(cuda)
    out = {
        "backend": backend,
        "release": release,
        "cycles": cycles,
        "first_cycle_ms": round(1000 * first["cycle"], 1),
        "aborted": rounds[0]["aborted"],
        "before": before,
        "after": after,
    }
    for key in ("cycle", "build", "first_allreduce", "abort", "drop"):
        out[key] = stats([r[key] for r in rounds])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cycles", type=int, default=50)
    p.add_argument("--only", choices=["nccl", "gloo"], default=None)
    args = p.parse_args()
    backends = [args.only] if args.only else ["nccl", "gloo"]
    if "nccl" in backends and not (torch.cuda.is_available() and dist.is_nccl_available()):
        print("no CUDA/NCCL here: gloo only", file=sys.stderr)
        backends = ["gloo"]
    env = {
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    print(json.dumps(env), flush=True)
    for b in backends:
        print(json.dumps(run(b, args.cycles, release=False)), flush=True)
        if b == "nccl":  # abort and destroy on the reaper thread instead (communicators.release)
            print(json.dumps(run(b, args.cycles, release=True)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
