"""What the state found without registration, and the loop's variables, cost (issue 57, parts 2 and 3).

* **per step, an EMA** (``AveragedModel`` of an MLP of ``--layers`` Linear layers of ``--width``):
  the rollback's bookkeeping (``state.discovered.Rollback``: the version signature of its tensors
  at the step's start, at its vote and at its end) once a step showed that the EMA changes only
  after the commit, against the copy at every step's start that an object changing before the
  vote needs (and every object gets until its first step has shown when it changes).
* **per step, the loop's variables**: a live rank's per-rank bookkeeping (``PerRankState``: the
  snapshot at the step's start, the mirror at the vote) with the global RNGs only, and with the
  loop frame's ``--variables`` plain values as well (``state.loop_variables``).
* **once, at the first step**: ``state.discovered.find`` in this process (a full collection,
  then the collector's objects searched for modules, optimizers, schedulers and scalers).

    .venv/bin/python bench/found_state_cost.py [--layers 24] [--width 1024] [--variables 12]

Medians of ``--repeat`` timings, in one process, on the CPU, one intra-op thread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tm_launch.worker.state.discovered import Rollback, find, frame_variables  # noqa: E402
from tm_launch.worker.state.loop_variables import LoopVariables  # noqa: E402
from tm_launch.worker.state.per_rank import PerRankState  # noqa: E402
from tm_launch.worker.state.transfer import cpu_copy  # noqa: E402


def median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def rollback_ms(ema, model, repeat: int) -> float:
    """One committed step's rollback bookkeeping (the EMA's update itself not counted)."""
    frame_vars = {"ema": ema}
    rollback = Rollback(find(frame_vars, registered=[model]))
    rollback.begin_step()  # one step that showed the EMA changes after the vote only
    rollback.at_decision(True)
    ema.update_parameters(model)
    rollback.end_step(True)

    def step():
        rollback.begin_step()
        rollback.at_decision(True)
        rollback.end_step(True)

    return median_ms(step, repeat)


def per_rank_ms(frame, repeat: int) -> float:
    per_rank = PerRankState(rng=True)
    if frame is not None:
        per_rank.objects["tm:loop"] = LoopVariables(frame, skip=set())
    counter = [0]

    def step():
        per_rank.begin_step(counter[0], lambda *a: True)
        per_rank.vote_mirror(counter[0])
        counter[0] += 1

    return median_ms(step, repeat)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--variables", type=int, default=12)
    p.add_argument("--repeat", type=int, default=100)
    a = p.parse_args()
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(a.width, a.width) for _ in range(a.layers)])
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))
    mib = sum(t.numel() * t.element_size() for t in ema.state_dict().values()) / 2**20
    print(f"load average {os.getloadavg()[0]:.1f}; EMA of {a.layers} x Linear({a.width}): {mib:.0f} MiB, {len(ema.state_dict())} tensors")
    print(f"rollback per step, learned (changes after the commit only): {rollback_ms(ema, model, a.repeat):.3f} ms")
    copy_ms = median_ms(lambda: cpu_copy(ema.state_dict()), max(5, a.repeat // 10))
    print(f"the copy at each step's start an object changing before the vote needs: {copy_ms:.1f} ms")
    loop = {f"v{i}": (i if i % 3 else float(i)) for i in range(a.variables)}
    loop["best"], loop["history"] = torch.tensor(0.5), [0.1] * 16
    globals().update(loop)  # a module-level loop's variables
    here = sys._getframe()
    for _ in range(2):  # interleaved: the machine's load moves between measurements
        print(f"per-rank bookkeeping per step, the RNGs only: {per_rank_ms(None, a.repeat):.3f} ms")
        print(f"the same with the loop's {len(loop)} plain variables: {per_rank_ms(here, a.repeat):.3f} ms")
    t0 = time.perf_counter()
    found = find(frame_variables(here), registered=[model])
    print(f"find at the first step: {(time.perf_counter() - t0) * 1000:.0f} ms ({[f.name for f in found]})")


if __name__ == "__main__":
    main()
