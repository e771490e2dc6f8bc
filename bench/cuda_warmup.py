#!/usr/bin/env python3
"""What a spare's sandbox warm-up costs on a GPU, and what it leaves behind.

    python3 bench/cuda_warmup.py --layers 8 --width 4096 --steps 5

In a fresh process: CUDA context creation; model + AdamW allocation (an MLP of ``layers``
``width`` x ``width`` linear layers, fp32); ``steps`` real forward/backward/optimizer steps
(the first one creates cuBLAS handles and workspaces and grows the allocator's pool); then
``tm_launch.worker.spare.cuda_warmup.leave_no_trace`` twice: once with the model and optimizer still held
(a parked spare) and once after dropping them. Memory is read three ways: torch's allocated
and reserved bytes, and the device's used memory (``cudaMemGetInfo``, every process on the
GPU, the CUDA context included). The check: after dropping, allocated and reserved return to
their values right after context creation, and the device's used memory to within a few MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def mib(m: dict) -> dict:
    return {k: round(v / 2**20, 1) for k, v in m.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    t = time.perf_counter()
    import torch

    from tm_launch.worker.spare.cuda_warmup import gpu_memory, leave_no_trace

    t_import = time.perf_counter() - t
    if not torch.cuda.is_available():
        print("no CUDA here", file=sys.stderr)
        return 2
    threads = lambda: len(os.listdir("/proc/self/task"))  # noqa: E731
    before_ctx = threads()
    t = time.perf_counter()
    torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    t_context = time.perf_counter() - t
    base = leave_no_trace()
    t = time.perf_counter()
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    torch.cuda.synchronize()
    t_alloc = time.perf_counter() - t
    step_times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        x = torch.randn(args.batch, args.width, device="cuda")
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        step_times.append(time.perf_counter() - t)
    del x
    peak = torch.cuda.max_memory_reserved()
    after_steps = gpu_memory()
    t = time.perf_counter()
    parked = leave_no_trace()
    t_release = time.perf_counter() - t
    del model, opt
    dropped = leave_no_trace()
    params = args.layers * (args.width * args.width + args.width)
    out = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "params_m": round(params / 1e6, 1),
        "model_plus_adam_mib": round(params * 4 * 3 / 2**20, 1),
        "import_torch_s": round(t_import, 2),
        "cuda_context_s": round(t_context, 3),
        "alloc_model_optimizer_s": round(t_alloc, 3),
        "first_step_s": round(step_times[0], 3),
        "later_steps_median_s": round(statistics.median(step_times[1:]), 4) if len(step_times) > 1 else None,
        "leave_no_trace_s": round(t_release, 4),
        "mib": {
            "context_baseline": mib(base),
            "after_steps": mib(after_steps),
            "peak_reserved": round(peak / 2**20, 1),
            "parked_model_kept": mib(parked),
            "dropped": mib(dropped),
        },
        "dropped_minus_baseline_mib": mib({k: dropped[k] - base[k] for k in base}),
        "threads": {"before_context": before_ctx, "end": threads()},
    }
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
