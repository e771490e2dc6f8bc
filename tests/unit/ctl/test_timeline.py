"""`ctl timeline`'s picture and data (tm_launch.ctl.timeline): pure, table-tested.

The end-to-end check (a real failover's `ctl timeline` PNG and JSON) is
tests/e2e/test_ops.py::test_failover_timeline_and_metrics.
"""

import json

import pytest

from tm_launch.ctl.timeline import build, by_generation, label_rows


@pytest.mark.parametrize(
    "xs, gap, rows",
    [
        ([], 1.0, []),
        ([0, 5, 10], 1.0, [0, 0, 0]),
        ([0, 0.5, 0.7, 5], 1.0, [0, 1, 2, 0]),
        ([0, 0.5, 1.2, 1.3], 1.0, [0, 1, 0, 2]),
    ],
)
def test_label_rows_never_put_close_labels_on_one_row(xs, gap, rows):
    assert label_rows(xs, gap) == rows


@pytest.mark.parametrize(
    "gens, runs",
    [
        ([], []),
        ([0, 0, 0], [[0, 0, 0]]),
        ([0, 0, 1, 1, 2], [[0, 0], [1, 1], [2]]),  # no line drawn across a generation change
    ],
)
def test_by_generation_cuts_a_ranks_samples_at_each_generation_change(gens, runs):
    samples = [{"generation": g, "step": i} for i, g in enumerate(gens)]
    assert [[s["generation"] for s in run] for run in by_generation(samples)] == runs
    assert [s for run in by_generation(samples) for s in run] == samples


def test_build_downtime_from_fault_to_entry():
    t0 = 1000.0
    history = [
        {"generation": 0, "created": t0, "cause": "initial rendezvous", "state": "running", "nodes": ["a", "b"]},
        {
            "generation": 1,
            "created": t0 + 10.5,
            "cause": "b: worker 0 killed by SIGKILL",
            "state": "running",
            "live": True,
            "replaced": {"c": "b"},
            "nodes": ["a", "c"],
        },
        {"generation": 2, "created": t0 + 20.0, "cause": "a: drain (operator)", "state": "running", "live": True, "planned": True},
        {"generation": 3, "created": t0 + 30.0, "cause": "all workers finished", "state": "succeeded"},
    ]
    reports = {0: {"b": {"kind": "signal", "time": t0 + 10.0}, "a": {"kind": "exit", "time": t0 + 10.2}}}
    events = [
        {"kind": "entered", "generation": 1, "after_plan_s": 0.5},
        {"kind": "entered", "generation": 1, "after_plan_s": 1.5},
        {"kind": "entered", "generation": 2, "after_plan_s": 0.25},
    ]
    steps = {"a": [[t0 + 1, 0, 0, 10, 0.1, "running"], [t0 + 2, 0, 0, 20, 0.1, "parked"], [t0 + 13, 1, 0, 30, 0.1, "running"]]}
    data = build("r", history, reports, events, steps)
    by_gen = {g["generation"]: g for g in data["generations"]}
    assert by_gen[1]["kind"] == "signal" and by_gen[1]["fault_time"] == 10.0 and by_gen[1]["downtime_s"] == 2.0
    assert by_gen[2]["kind"] == "drain" and by_gen[2]["downtime_s"] == 0.25  # planned: from the plan itself
    assert by_gen[0]["downtime_s"] is None and by_gen[3]["downtime_s"] is None
    assert [s["step"] for s in data["series"]["0"]] == [10, 30]  # parked samples are not training
    json.dumps(data)  # `ctl timeline --json` prints exactly this


def test_build_restart_mode_downtime_from_the_step_series():
    """Restart mode has no ``entered`` events: the workers run again at the first sample of the
    new generation that ran a step (the step count starts again from the checkpoint)."""
    t0 = 1000.0
    history = [
        {"generation": 0, "created": t0, "state": "running"},
        {"generation": 1, "created": t0 + 10.1, "cause": "b: worker 0 killed by SIGKILL", "state": "running"},
    ]
    reports = {0: {"b": {"kind": "signal", "time": t0 + 10.0}}}
    steps = {
        "a": [[t0 + 9, 0, 0, 42, 0.02, "running"], [t0 + 16, 1, 0, 41, None, "running"], [t0 + 17, 1, 0, 80, 0.02, "running"]],
        "b": [[t0 + 9, 0, 1, 43, 0.02, "running"], [t0 + 16.5, 1, 1, 41, None, "running"]],
    }
    data = build("r", history, reports, [], steps)
    change = data["generations"][1]
    assert (change["live"], change["kind"], change["downtime_s"]) == (False, "signal", 6.0)
    assert [s["step"] for s in data["series"]["0"]] == [42, 41, 80]
