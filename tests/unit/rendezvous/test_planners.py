"""Table tests for ``planners(View)``: which agents run the planner and try the CAS, and for
``follows_only``: which of the others need nothing but the next plan.

Everyone computes the same answer from the same view, so there is no election: when a planner's
lease goes, the next node in join order is a planner at its next read."""

from __future__ import annotations

import pytest

from rendezvous.plan import NodeInfo, Plan
from rendezvous.planner import PLANNERS, View, follows_only, planners


def view(alive: list[tuple[str, float]], failed: str = "") -> View:
    return View(
        plan=None,
        alive={n: NodeInfo(id=n, host=n, addr="127.0.0.1", store_port=1, nproc=1, pid=1, joined=t) for n, t in alive},
        failed={n: "cordoned" for n in failed},
    )


@pytest.mark.parametrize(
    "alive, failed, expected",
    [
        # the first three in join order, whatever the ids
        ([("d", 1), ("c", 2), ("b", 3), ("a", 4), ("e", 5)], "", ("d", "c", "b")),
        # the same moment: ties broken by id, so every agent agrees
        ([("b", 1), ("a", 1), ("c", 1), ("d", 1)], "", ("a", "b", "c")),
        # a planner's lease expired: the next in join order takes over
        ([("c", 2), ("b", 3), ("a", 4), ("e", 5)], "", ("c", "b", "a")),
        # fewer nodes than planners: all of them
        ([("a", 1), ("b", 2)], "", ("a", "b")),
        ([], "", ()),
        # cordoned nodes go last, but still plan when nothing else is alive (the FAILED plan)
        ([("a", 1), ("b", 2), ("c", 3), ("d", 4)], "a", ("b", "c", "d")),
        ([("a", 1), ("b", 2)], "ab", ("a", "b")),
        # a cordoned node that is not alive changes nothing
        ([("a", 1), ("b", 2), ("c", 3), ("d", 4)], "z", ("a", "b", "c")),
    ],
)
def test_planners(alive, failed, expected):
    assert PLANNERS == 3
    assert planners(view(alive, failed)) == expected


def test_planners_independent_of_dict_order():
    nodes = [(f"n{i:03d}", float(i % 7)) for i in range(50)]
    assert planners(view(nodes)) == planners(view(list(reversed(nodes))))


LIVE = Plan(generation=4, nodes=("a", "b", "c"), nproc=1, live=True, joiners=("c",))
RESTART = Plan(generation=4, nodes=("a", "b", "c"), nproc=1, joiners=("a", "b", "c"))


@pytest.mark.parametrize(
    "plan, live, node, planning, expected",
    [
        (LIVE, True, "b", False, True),  # an active node that keeps its workers
        (LIVE, True, "b", True, False),  # a planner reads everything
        (LIVE, True, "a", False, False),  # group rank 0 reports drains waiting for a spare
        (LIVE, True, "c", False, False),  # a live joiner watches its keepers finish
        (LIVE, True, "s", False, True),  # a spare of a live job: warming up, nothing to watch
        (LIVE, False, "s", False, False),  # a spare must see the job turn live to warm up
        (RESTART, False, "c", False, True),  # restart mode: every node "joins", none watches keepers
        (None, False, "s", False, True),  # before the first plan: wait for it
    ],
)
def test_follows_only(plan, live, node, planning, expected):
    assert follows_only(View(plan=plan, alive={}, live=live), node, planning) is expected
