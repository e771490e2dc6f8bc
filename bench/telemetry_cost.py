#!/usr/bin/env python3
"""What the collective telemetry (C4) costs: per collective in the worker, per read in the agent.

    .venv/bin/python bench/telemetry_cost.py            # a few seconds

* worker: ``collective_telemetry.entered`` + ``completed`` (what ``LiveGroup`` adds to every
  collective: a slot lookup, ``time.monotonic()`` twice, a handful of stores into the mapped
  page), against an empty Python call pair, median of 7 rounds of 200,000;
* agent: reading one worker's page and turning it into the exchanged record
  (``collective_page.read`` + ``collective_watch.record_from_page``), which it does once per loop
  iteration per local worker.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def per_call(fn, n: int) -> float:
    t0 = time.perf_counter()
    fn(n)
    return (time.perf_counter() - t0) / n


def main() -> int:
    workdir = tempfile.mkdtemp(prefix="tm-telemetry-")
    path = os.path.join(workdir, "collectives-0")
    os.environ["TM_TELEMETRY"] = path
    from tm_launch import collective_page
    from tm_launch.launcher.collective_watch import record_from_page
    from tm_launch.worker.comms import telemetry as ct

    groups = [types.SimpleNamespace(group_name=f"g{i}", member_ranks=(0, 1), generation=1) for i in range(8)]
    world = types.SimpleNamespace(group_name="tm-world", member_ranks=None, generation=1)

    def with_telemetry(n):
        entered, completed = ct.entered, ct.completed
        for _ in range(n):
            completed(entered(world, "allreduce"))

    def baseline(n):
        def entered(g, name):
            return None

        def completed(token):
            return None

        for _ in range(n):
            completed(entered(world, "allreduce"))

    for g in groups:
        ct.completed(ct.entered(g, "allreduce"))  # slots taken: the page looks like a hybrid job's
    rounds, n = 7, 200_000
    cost = statistics.median(per_call(with_telemetry, n) for _ in range(rounds))
    base = statistics.median(per_call(baseline, n) for _ in range(rounds))

    def agent_read(k):
        for _ in range(k):
            page = collective_page.read(path)
            record_from_page(page, "a", 0, time.monotonic(), False, 0.05)

    read = statistics.median(per_call(agent_read, 2000) for _ in range(5))
    added = cost - base
    lines = [
        "| what | cost |",
        "|---|---|",
        f"| worker: enter + complete one collective (telemetry on) | {cost * 1e9:.0f} ns |",
        f"| worker: the same two calls doing nothing | {base * 1e9:.0f} ns |",
        f"| worker: added per collective | {added * 1e9:.0f} ns |",
        f"| worker: added per step of the benchmark model (3 collectives: DDP all-reduce, commit vote, loss all-reduce) | {3 * added * 1e6:.2f} us ({3 * added / 0.05 * 100:.4f}% of a 50 ms step) |",
        f"| agent: read one worker's page ({len(groups) + 1} groups) and make its record | {read * 1e6:.0f} us |",
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
