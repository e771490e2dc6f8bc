"""bench/compile_cost.py's reading of a run (``summarize``, a table of runs written by hand) and
the per-step compile records it reads (``tests/scripts/compile_records.py``: a recompile is one
more graph, each process's records apart)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
sys.path.append(os.path.join(os.path.dirname(__file__), "..", "scripts"))

from compile_cost import fault_time, summarize  # noqa: E402
from compile_records import append, by_process, compile_record, last_graphs, read  # noqa: E402

KILL = 6.5  # the kill's time: right after step 6 (each step below takes 0.1 s, ending at step + 0.1)


def rec(pid, rank, step, start, graphs=4, compile_s=5.0, sandbox=False, took=0.1):
    return {
        "pid": pid,
        "rank": rank,
        "step": step,
        "sandbox": sandbox,
        "graphs": graphs,
        "compile_s": compile_s,
        "start": start,
        "end": start + took,
    }


def job(joiner, survivor_after=(4, 5.0), slow_first=0.1):
    """A survivor (pid 10, rank 0) through steps 1-10, the victim (pid 11, rank 1) until step 6,
    then the joiner's records (pid 12) and the survivor's re-run of step 7 after the kill."""
    survivor = [rec(10, 0, s, float(s)) for s in range(1, 7)]
    survivor += [rec(10, 0, s, 10.0 + s, *survivor_after, took=slow_first if s == 7 else 0.1) for s in range(7, 11)]
    victim = [rec(11, 1, s, float(s)) for s in range(1, 7)]
    return survivor + victim + joiner


WARM = [rec(12, 1, 1, 0.0, 0, 0.0, True, took=3.0), rec(12, 1, 2, 3.0, 4, 5.0, True, took=0.2)]
TRAINED = [rec(12, 1, s, 10.0 + s, took=0.4 if s == 7 else 0.1) for s in range(7, 11)]
AGAIN = [rec(12, 0, 1, 8.0, 6, 7.5, True, took=1.5)]  # promoted to rank 0: the script again
TRAINED_AS_0 = [rec(12, 0, s, 10.0 + s, 6, 7.5, took=0.4 if s == 7 else 0.1) for s in range(7, 11)]


@pytest.mark.parametrize(
    "records, want",
    [
        (  # the spare keeps its warm-up rank: everything compiled in the warm-up
            job(WARM + TRAINED),
            {
                "warmup_s": 3.2,
                "warmup_compile_s": 5.0,
                "warmup_graphs": 4,
                "again_s": None,
                "again_compile_s": None,
                "joiner_first_step": 7,
                "joiner_first_step_s": 0.4,
                "survivor_same_step_s": 0.1,
                "median_step_after_s": 0.1,
                "joiner_compiled_after_s": 0.0,
                "joiner_graphs_after": 0,
                "survivor_compiled_after_s": 0.0,
                "survivor_graphs_after": 0,
            },
        ),
        (  # promoted to another rank: the script again compiles after the promotion, before the job's step
            job(WARM + AGAIN + TRAINED_AS_0),
            {"again_s": 1.5, "again_compile_s": 2.5, "again_graphs": 2, "joiner_compiled_after_s": 0.0, "joiner_graphs_after": 0},
        ),
        (  # a survivor that recompiled after the kill, and a joiner that compiled in the job's first step
            job(WARM + [rec(12, 1, 7, 17.0, 5, 6.0, took=1.0)], survivor_after=(5, 5.75), slow_first=1.0),
            {
                "joiner_first_step_s": 1.0,
                "survivor_same_step_s": 1.0,
                "joiner_compiled_after_s": 1.0,
                "joiner_graphs_after": 1,
                "survivor_compiled_after_s": 0.75,
                "survivor_graphs_after": 1,
            },
        ),
    ],
    ids=["keeps-its-rank", "another-rank", "recompiled"],
)
def test_summarize_reads_the_joiners_and_survivors_costs(records, want):
    got = summarize(records, KILL)
    for key, value in want.items():
        assert got[key] == (pytest.approx(value) if isinstance(value, float) else value), key


def test_summarize_needs_exactly_one_joiner_that_ran_a_step():
    with pytest.raises(ValueError, match="one process that warmed up"):
        summarize(job([]), KILL)
    with pytest.raises(ValueError, match="no step of the job"):
        summarize(job(WARM), KILL)


def test_a_recompile_is_one_more_graph_and_each_process_is_kept_apart(tmp_path):
    torch = pytest.importorskip("torch")
    fn = torch.compile(lambda x: x * 2 + 1, backend="eager")
    path = str(tmp_path / "compile.jsonl")
    before = compile_record(0, 0, False, 0.0)["graphs"]
    fn(torch.ones(3))
    append(path, compile_record(0, 1, False, 0.0))
    fn(torch.ones(3))  # the same guards: nothing compiled
    append(path, compile_record(0, 2, False, 0.0))
    fn(torch.ones(3, dtype=torch.float64))  # a guard fails: a recompile
    append(path, {**compile_record(1, 3, True, 0.0), "pid": -1})
    records = read(path)
    assert [r["graphs"] - before for r in records] == [1, 1, 2]
    assert records[0]["compile_s"] > 0 and records[1]["compile_s"] == records[0]["compile_s"] < records[2]["compile_s"]
    assert [len(rs) for rs in by_process(records).values()] == [2, 1]
    assert last_graphs(records) == {0: records[1]["graphs"], 1: records[2]["graphs"]}


def test_the_fault_time_is_never_before_the_victims_last_step():
    # (time, rank, step, generation, pid): the victim (pid 11) logged step 11 at 5.5257, the
    # marker's coarse mtime says 5.5242; the survivor (10) and the joiner (12) reach step 14.
    steps = [(5.4996, 0, 10, 0, 10), (5.4933, 1, 10, 0, 11), (5.5257, 1, 11, 0, 11), (5.5313, 0, 11, 0, 10)]
    steps += [(5.885, 0, 12, 1, 10), (5.889, 1, 12, 1, 12), (5.99, 0, 14, 1, 10), (5.995, 1, 14, 1, 12)]
    assert fault_time(5.5242, steps) == 5.5257
    assert fault_time(5.6, steps) == 5.6  # a marker after the victim's last record: the marker
