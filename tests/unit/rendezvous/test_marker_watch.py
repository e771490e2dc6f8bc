"""marker_watch.matters: which plan-feed changes wake a follower (table tests, no etcd; the
stream it filters runs in test_membership.py and test_rendezvous_scale.py)."""

from __future__ import annotations

import json

import pytest

from rendezvous.kv import Change
from rendezvous.marker_watch import matters
from rendezvous.membership import DELTA, PLANNER_MARKERS, _marker_names


def marker(node: str) -> str:
    return PLANNER_MARKERS + node


def names(*nodes: str) -> str:
    return json.dumps({"planners": list(nodes)})


ABC = {marker(n): names(*"abc") for n in "abc"}


@pytest.mark.parametrize(
    "change, after, expected",
    [
        (Change(DELTA, "{}", 11), ABC, True),  # a new plan
        (Change(marker("a"), None, 11), {k: v for k, v in ABC.items() if "a" not in k[-1]}, False),  # a planner died, two are left
        (Change(marker("b"), names("b", "c", "e"), 11), ABC, False),  # the survivors name e, not d
        (Change(marker("e"), names("b", "c", "e"), 11), ABC, False),  # e's own marker
        (Change(marker("b"), names("b", "c", "d"), 11), ABC, True),  # d is named: it must plan
        (Change(marker("c"), None, 13), {}, True),  # no planner left
        (Change(marker("c"), None, 13), {marker("x"): "garbage {"}, True),  # ... but an unreadable one
        (Change(marker("a"), "garbage {", 11), ABC, True),  # unreadable: the read judges it
        (Change(marker("a"), None, 11), None, True),  # the copy of the feed is not trusted
    ],
)
def test_what_wakes_a_follower(change, after, expected):
    assert matters("d", change, PLANNER_MARKERS, after, _marker_names) is expected
