"""What per-rank state found without registration, and the audit, cost (issue 52).

* **per step**: the work a live rank adds to every step for its module buffers and the global
  RNGs (``PerRankState.begin_step`` at the step's start, ``vote_mirror`` at the vote: host
  copies, a comparison, a pickle), for a model with BatchNorm layers, against the same model with
  none (only the RNGs).
* **per recovery**: the audit's exact digests of every registered tensor (``generation.audit``),
  per MiB of registered state (the all-gather of the digests is a few KB and not included).

    .venv/bin/python bench/per_rank_cost.py [--bn-layers 50] [--channels 256] [--state-mib 64 256]

Medians of ``--repeat`` timings, in one process, on the CPU.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tm_launch.worker.generation.audit import digests  # noqa: E402
from tm_launch.worker.state.per_rank import PerRankState, dumps_record  # noqa: E402


def bn_model(layers: int, channels: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Conv2d(channels, channels, 1), torch.nn.BatchNorm2d(channels)) for _ in range(layers)]
    )


def per_step_ms(model: torch.nn.Module | None, repeat: int) -> float:
    """One step's per-rank bookkeeping: begin_step, then the vote's mirror."""
    per_rank = PerRankState(rng=True)
    if model is not None:
        per_rank.add_buffers_of("model", model)
    times = []
    for step in range(repeat):
        t0 = time.perf_counter()
        per_rank.begin_step(step, lambda *a: True)
        per_rank.vote_mirror(step)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bn-layers", type=int, default=50)
    p.add_argument("--channels", type=int, default=256)
    p.add_argument("--state-mib", type=int, nargs="+", default=[64, 256])
    p.add_argument("--repeat", type=int, default=50)
    a = p.parse_args()
    torch.set_num_threads(1)
    model = bn_model(a.bn_layers, a.channels)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    base = per_step_ms(None, a.repeat)
    with_bn = per_step_ms(model, a.repeat)
    print(
        f"per step: RNGs only {base:.3f} ms; + {a.bn_layers} BatchNorm layers x {a.channels} channels ({buffers / 2**10:.0f} KiB of buffers) {with_bn:.3f} ms"
    )
    # The step's mirror record (written twice a step), torch's pickler against dumps_record,
    # interleaved so that a loaded machine slows both alike.
    per_rank = PerRankState(rng=True)
    per_rank.add_buffers_of("model", model)
    record = {"step": 1, "exact": True, "states": per_rank.states_now()}
    torch_ms, ours_ms = [], []
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        pickle.dumps(record)
        t1 = time.perf_counter()
        dumps_record(record)
        torch_ms.append((t1 - t0) * 1000)
        ours_ms.append((time.perf_counter() - t1) * 1000)
    t, o = statistics.median(torch_ms), statistics.median(ours_ms)
    print(f"the step's mirror record: torch's pickler {t:.3f} ms, dumps_record {o:.3f} ms ({t / o:.1f}x)")
    for mib in a.state_mib:
        state = {f"w{i}": torch.randn(mib * 2**20 // 4 // 16) for i in range(16)}
        times = []
        for _ in range(max(3, a.repeat // 10)):
            t0 = time.perf_counter()
            digests(state)
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times) * 1000
        print(f"audit digests: {mib} MiB of registered state in {ms:.1f} ms ({mib / (ms / 1000) / 1024:.2f} GiB/s)")


if __name__ == "__main__":
    main()
