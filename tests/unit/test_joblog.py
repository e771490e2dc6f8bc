"""What agents leave operators in etcd's log/ (tm_launch.joblog): the step samples' bound,
the kind of a generation change and its downtime breakdown; pure, table-tested.

The end-to-end check (a real failover's `ctl timeline --json` against its step log) is in
tests/e2e/test_live.py::test_node_loss_agent_sigkill.
"""

import json

import pytest

from tm_launch.ctl.timeline import build
from tm_launch.joblog import PHASES, append_samples, breakdown, cause_kind, node_stamps, plan_stamps
from tm_launch.protocol import EnteredRecord, FirstStepRecord

T = 1000.0
PLAN = {"planner": "a", "published": T + 0.07, "detected": T + 0.05, "detected_by": "b"}
SURVIVOR = {"last_step": T, "seen": T + 0.08, "directed": T + 0.085, "communicator": T + 0.2, "entered": T + 0.25, "first_step": T + 0.3}
JOINER = {"last_step": None, "seen": T + 0.09, "directed": T + 0.1, "communicator": T + 0.3, "entered": T + 0.32, "first_step": T + 0.4}


def phases(*seconds):
    return dict(zip(PHASES, seconds))


@pytest.mark.parametrize(
    "plan, nodes, total, critical, summary, per_node",
    [
        # An unplanned live failover: every phase from the agents' stamps; the joiner resumed last.
        (
            PLAN,
            {"a": SURVIVOR, "c": JOINER},
            0.4,
            "c",
            [
                ("detect", 0.05, "b"),
                ("plan", 0.02, "a"),
                ("seen", 0.02, "c"),
                ("directed", 0.01, "c"),
                ("communicator", 0.2, "c"),
                ("state", 0.05, "a"),
                ("first_step", 0.08, "c"),
            ],
            {"a": (phases(0.05, 0.02, 0.01, 0.005, 0.115, 0.05, 0.05), 0.3), "c": (phases(0.05, 0.02, 0.02, 0.01, 0.2, 0.02, 0.08), 0.4)},
        ),
        # A planned switch: plan, seen and directed happened while training went on (before the last
        # step): they cost nothing; no failure report, so no detect phase.
        (
            {"planner": "a", "published": T - 2.0, "detected": None, "detected_by": None},
            {
                "a": {
                    **SURVIVOR,
                    "seen": T - 1.9,
                    "directed": T - 1.8,
                    "communicator": T + 0.01,
                    "entered": T + 0.02,
                    "first_step": T + 0.07,
                }
            },
            0.07,
            "a",
            [
                ("detect", None, None),
                ("plan", 0.0, "a"),
                ("seen", 0.0, "a"),
                ("directed", 0.0, "a"),
                ("communicator", 0.01, "a"),
                ("state", 0.01, "a"),
                ("first_step", 0.05, "a"),
            ],
            {"a": (phases(None, 0.0, 0.0, 0.0, 0.01, 0.01, 0.05), 0.07)},
        ),
        # A cordon (fatal alarm): no report to time, the plan phase runs from the last step.
        (
            {**PLAN, "detected": None, "detected_by": None},
            {"a": SURVIVOR},
            0.3,
            "a",
            [
                ("detect", None, None),
                ("plan", 0.07, "a"),
                ("seen", 0.01, "a"),
                ("directed", 0.005, "a"),
                ("communicator", 0.115, "a"),
                ("state", 0.05, "a"),
                ("first_step", 0.05, "a"),
            ],
            {"a": (phases(None, 0.07, 0.01, 0.005, 0.115, 0.05, 0.05), 0.3)},
        ),
        # Restart mode: no node records and no last step known: the change starts at the report.
        (PLAN, {}, None, None, [("detect", None, None), ("plan", 0.02, "a")] + [(p, None, None) for p in PHASES[2:]], {}),
        # A node that never completed a step (superseded, or its record is junk) has no total; a stamp
        # that is not a finite number counts as missing and its time falls to the next phase.
        (
            PLAN,
            {"a": {**SURVIVOR, "directed": "soon", "first_step": float("nan")}, "c": JOINER},
            0.4,
            "c",
            [
                ("detect", 0.05, "b"),
                ("plan", 0.02, "a"),
                ("seen", 0.02, "c"),
                ("directed", 0.01, "c"),
                ("communicator", 0.2, "c"),
                ("state", 0.05, "a"),
                ("first_step", 0.08, "c"),
            ],
            {"a": (phases(0.05, 0.02, 0.01, None, 0.12, 0.05, None), None), "c": (phases(0.05, 0.02, 0.02, 0.01, 0.2, 0.02, 0.08), 0.4)},
        ),
        # Stamps out of order after the last step (a clock offset between machines) stay visible as a
        # negative phase instead of being hidden; the node's phases still add up to its total.
        (
            {**PLAN, "published": T + 0.1},
            {"c": {**JOINER, "last_step": T, "seen": T + 0.09}},
            0.4,
            "c",
            [
                ("detect", 0.05, "b"),
                ("plan", 0.05, "a"),
                ("seen", -0.01, "c"),
                ("directed", 0.01, "c"),
                ("communicator", 0.2, "c"),
                ("state", 0.02, "c"),
                ("first_step", 0.08, "c"),
            ],
            {"c": (phases(0.05, 0.05, -0.01, 0.01, 0.2, 0.02, 0.08), 0.4)},
        ),
    ],
)
def test_breakdown_names_every_phase(plan, nodes, total, critical, summary, per_node):
    b = breakdown(plan, nodes)
    assert b["total_s"] == total and b["critical_node"] == critical
    assert [(p["phase"], p["seconds"], p["node"]) for p in b["phases"]] == summary
    assert {n: (v["phases"], v["total_s"]) for n, v in b["nodes"].items()} == per_node
    for node, v in b["nodes"].items():  # a node's phases add up to its total: no unnamed time
        if v["total_s"] is not None:
            assert sum(s for s in v["phases"].values() if s is not None) == pytest.approx(v["total_s"], abs=0.002)
    json.dumps(b)


@pytest.mark.parametrize("plan, nodes", [(None, {}), ({"published": "x"}, {"a": "junk"}), ([1], {})])
def test_breakdown_of_nothing_is_none(plan, nodes):
    assert breakdown(plan, nodes) is None


def test_node_stamps_take_the_slowest_worker_at_each_stamp():
    entered = [
        EnteredRecord(began=T, communicator=0.1, state=0.05, last_step_at=T - 1.0, received=False, step=26),
        EnteredRecord(began=T + 0.01, communicator=0.05, state=0.2, last_step_at=None, received=True, step=26),
    ]
    firsts = [FirstStepRecord(time=T + 0.5, step=26), FirstStepRecord(time=T + 0.4, step=26)]
    assert node_stamps(T - 0.1, T - 0.05, entered, firsts) == {
        "seen": T - 0.1,
        "directed": T - 0.05,
        "last_step": T - 1.0,
        "communicator": T + 0.1,
        "entered": T + 0.26,
        "first_step": T + 0.5,
    }


@pytest.mark.parametrize(
    "reports, detected, by",
    [
        ({}, None, None),
        ({"b": T + 0.2, "a": T + 0.1}, T + 0.1, "a"),
    ],
)
def test_plan_stamps_name_the_first_report(reports, detected, by):
    assert plan_stamps("p", T + 1, reports) == {"planner": "p", "published": T + 1, "detected": detected, "detected_by": by}


def test_timeline_gives_each_change_its_breakdown():
    history = [
        {"generation": 0, "created": T - 10, "state": "running"},
        {"generation": 1, "created": T + 0.06, "state": "running", "live": True},
        {"generation": 2, "created": T + 5, "state": "succeeded"},
    ]
    data = build("r", history, {}, [], {}, {1: {"plan": PLAN, "nodes": {"a": SURVIVOR}}, 2: {"plan": PLAN, "nodes": {}}})
    by_gen = {g["generation"]: g["breakdown"] for g in data["generations"]}
    assert by_gen[0] is None and by_gen[2] is None  # no change to break down: the start, the end marker
    assert by_gen[1]["origin"] == 10.0 and by_gen[1]["total_s"] == 0.3 and by_gen[1]["critical_node"] == "a"


# -- step samples and the kind of a change ----------------------------------------------------------
@pytest.mark.parametrize(
    "before, add, cap, expect",
    [
        ([], [[1], [2]], 10, [[1], [2]]),
        ([[i] for i in range(8)], [[8], [9]], 10, [[i] for i in range(10)]),
        # over the cap: the older half is thinned by two, the recent half kept whole
        ([[i] for i in range(10)], [[10]], 10, [[0], [2], [4], [5], [6], [7], [8], [9], [10]]),
    ],
)
def test_append_samples_is_bounded_and_keeps_recent(before, add, cap, expect):
    assert append_samples(before, add, cap) == expect


def test_append_samples_stays_bounded_over_a_long_run():
    series = []
    for t in range(10_000):
        series = append_samples(series, [[t]], cap=100)
    assert len(series) <= 100 and series[0] == [0] and series[-1] == [9999]


@pytest.mark.parametrize(
    "plan, reports, kind",
    [
        ({"generation": 0}, {}, "start"),
        ({"generation": 3, "state": "succeeded"}, {}, "finished"),
        ({"generation": 2, "state": "failed", "cause": "x"}, {}, "failed"),
        ({"generation": 1, "planned": True, "cause": "a: drain (operator)"}, {}, "drain"),
        ({"generation": 1, "cause": "scale up: c joined"}, {}, "scale_up"),
        ({"generation": 1, "cause": "b: killed"}, {"a": {"kind": "exit"}, "b": {"kind": "signal"}}, "signal"),
        ({"generation": 1, "cause": "b: lost"}, {"b": {"kind": "lost"}, "a": {"kind": "exit"}}, "lost"),
        ({"generation": 1, "cause": "b: exit 1"}, {"b": {"kind": "exit"}}, "exit"),
        ({"generation": 1, "cause": "b: xid 79"}, {"b": {"kind": "alarm"}}, "alarm"),
        ({"generation": 1, "cause": "b: ?"}, {}, "failure"),
    ],
)
def test_cause_kind(plan, reports, kind):
    assert cause_kind(plan, reports) == kind
