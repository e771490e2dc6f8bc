"""A bug or a transient (rendezvous/script_errors.py), and the planner acting on it."""

import pytest

from rendezvous.plan import FAILED, NodeInfo, Plan
from rendezvous.planner import Limits, View, next_plan
from rendezvous.script_errors import FAIL, FAULT, GRACE, WAIT, decide

E = "script error: ValueError: bad batch at step 30"
OTHER = "script error: KeyError: 'x' at step 12"
RANKS = {"a": [0], "b": [1]}


@pytest.mark.parametrize(
    "reports, times, cordoned, cause, now, want",
    [
        # rank 1 raised alone, just now: the other node may be raising too
        ({"b": E}, {"b": 100.0}, set(), "", 100.5, (WAIT, "")),
        # ... and after the grace it is replaced like any failure, once
        ({"b": E}, {"b": 100.0}, set(), "", 100.0 + GRACE + 0.1, (FAULT, "")),
        # every node raised the same: a bug, no spare spent
        (
            {"a": E, "b": E},
            {"a": 100.0, "b": 100.01},
            set(),
            "",
            100.02,
            (FAIL, "ValueError: bad batch at step 30 (ranks 0, 1 on a, b), raised on every node: a bug in the script"),
        ),
        # every node raised, different errors
        (
            {"a": OTHER, "b": E},
            {"a": 1.0, "b": 1.0},
            set(),
            "",
            1.0,
            (FAIL, "every node's script raised: KeyError: 'x' at step 12 (rank 0 on a); ValueError: bad batch at step 30 (rank 1 on b)"),
        ),
        # the generation was made for this error, and it came back: a bug
        (
            {"b": E},
            {"b": 200.0},
            set(),
            f"b0: {E}",
            200.0,
            (FAIL, "ValueError: bad batch at step 30 (rank 1 on b), raised again after a replacement: a bug in the script"),
        ),
        # a different error after a replacement: one attempt again
        ({"b": OTHER}, {"b": 200.0}, set(), f"b0: {E}", 203.0, (FAULT, "")),
        # a node cordoned by a health alarm (an XID) raised: a fault, whatever it raised
        ({"a": E, "b": E}, {"a": 1.0, "b": 1.0}, {"b"}, "", 5.0, (FAULT, "")),
        ({"b": E}, {"b": 1.0}, {"b"}, f"b0: {E}", 1.0, (FAULT, "")),
    ],
)
def test_decide(reports, times, cordoned, cause, now, want):
    assert decide(("a", "b"), reports, times, cordoned, cause, now, RANKS) == want


def node(name):
    return NodeInfo(id=name, host=name, addr="127.0.0.1", store_port=1000, nproc=1, pid=1, joined={"a": 1.0, "b": 2.0}.get(name, 3.0))


def view(plan, reports, now, alive=("a", "b", "s"), failed=None):
    return View(
        plan,
        {n: node(n) for n in alive},
        failed=failed or {},
        reports=reports,
        report_kinds={n: "script" for n in reports},
        report_times={n: 100.0 for n in reports},
        now=now,
        live=True,
        warm=frozenset({"s"}),
    )


LIMITS = Limits(min_nodes=2, max_nodes=2, nproc=1, max_restarts=3)
PLAN = Plan(generation=3, nodes=("a", "b"), nproc=1, live=True)


def test_the_planner_fails_the_job_when_every_rank_raised_and_keeps_the_spare():
    nxt = next_plan(view(PLAN, {"a": E, "b": E}, 100.1), LIMITS)
    assert nxt.state == FAILED and "raised on every node" in nxt.reason and nxt.replaced == {} and nxt.restarts == PLAN.restarts


def test_the_planner_replaces_a_lone_raise_once_then_fails_when_it_comes_back():
    assert next_plan(view(PLAN, {"b": E}, 100.5), LIMITS) is None  # the grace
    replaced = next_plan(view(PLAN, {"b": E}, 100.0 + GRACE + 0.5), LIMITS)
    assert replaced.state != FAILED and replaced.replaced == {"s": "b"} and E in replaced.cause
    again = next_plan(view(replaced, {"s": E}, 200.0, alive=("a", "s")), LIMITS)
    assert again.state == FAILED and "raised again after a replacement" in again.reason
