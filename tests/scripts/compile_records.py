"""What torch.compile did in a process, step by step: the records the compiled scripts write
(``ordinary.py --compile``, the torchtitan harness's ``TT_COMPILE_LOG``) and the e2e tests and
``bench/compile_cost.py`` read. One JSON line per step a process ran, a spare's warm-up steps
included, appended at the step's end (a process killed later keeps what it wrote)."""

from __future__ import annotations

import json
import os
import time


def compile_record(rank: int, step: int, sandbox: bool, started: float) -> dict:
    """One step's record, at its end: the graphs Dynamo compiled in this process so far
    (``unique_graphs``: a recompile is one more) and the seconds it and the backend spent on them
    (Dynamo's own total: forward frames and the backward graphs AOT autograd compiles at the first
    backward), the step's start and end (wall clock) and whether it was a spare's warm-up step."""
    from torch._dynamo.utils import calculate_time_spent, counters

    return {
        "rank": rank,
        "step": step,
        "sandbox": sandbox,
        "graphs": counters["stats"]["unique_graphs"],
        "compile_s": round(calculate_time_spent()["total_wall_time"], 3),
        "start": round(started, 6),
        "end": round(time.time(), 6),
        "pid": os.getpid(),
    }


def append(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read(path: str) -> list[dict]:
    """Every record of ``path``, in the order written."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def by_process(records: list[dict]) -> dict[int, list[dict]]:
    """Each process's records (by pid), in the order it wrote them."""
    out: dict[int, list[dict]] = {}
    for record in records:
        out.setdefault(record["pid"], []).append(record)
    return out


def last_graphs(records: list[dict]) -> dict[int, int]:
    """Each rank's graphs at the end of the last step run as that rank (by wall clock)."""
    return {r["rank"]: r["graphs"] for r in sorted(records, key=lambda r: r["end"])}
