"""MarkerWatch: which plan-feed changes a follower reads etcd for (table tests, no etcd)."""

from __future__ import annotations

import json

import pytest

from rendezvous.kv import Change, WatchNews
from rendezvous.marker_watch import RECENT_LIMIT, MarkerWatch
from rendezvous.membership import DELTA, PLANNER_MARKERS, _marker_names


def marker(node: str) -> str:
    return PLANNER_MARKERS + node


def names(*nodes: str) -> str:
    return json.dumps({"planners": list(nodes)})


def seeded(revision: int = 10) -> MarkerWatch:
    """Follower d knows planners a, b, c, each marker naming all three, as read at ``revision``."""
    watch = MarkerWatch(PLANNER_MARKERS, _marker_names)
    assert watch.seed("d", {marker(n): tuple("abc") for n in "abc"}, revision) is False
    return watch


@pytest.mark.parametrize("changes, expected", [
    ([Change(DELTA, "{}", 11)], True),                                      # a new plan
    ([Change(marker("a"), None, 11)], False),                               # a planner died, two are left
    ([Change(marker("b"), names("b", "c", "e"), 11)], False),               # the survivors name e, not d
    ([Change(marker("e"), names("b", "c", "e"), 11)], False),               # e's own marker
    ([Change(marker("b"), names("b", "c", "d"), 11)], True),                # d is named: it must plan
    ([Change(marker(n), None, 11 + i) for i, n in enumerate("abc")], True),  # no planner left
    ([Change(marker("a"), "garbage {", 11)], True),                         # unreadable: the read judges it
    ([Change(marker("a"), None, 9), Change(marker("b"), None, 10), Change(marker("c"), None, 10)], False),  # the read had them
    (None, True),                                                           # v2: what changed is unknown
])
def test_what_a_follower_reads_for(changes, expected):
    assert seeded().matters(changes) is expected


def test_a_planners_death_and_its_replacement_cost_a_follower_no_read():
    watch = seeded()
    churn = [
        Change(marker("a"), None, 11),                       # a's lease expired
        Change(marker("b"), names("b", "c", "e"), 12),       # the survivors name the next planner
        Change(marker("c"), names("b", "c", "e"), 13),
        Change(marker("e"), names("b", "c", "e"), 14),       # which marks itself
    ]
    assert [watch.matters([c]) for c in churn] == [False] * 4
    assert watch.matters([Change(DELTA, "{}", 15)]) is True  # the replacement plan
    # ... and now the markers it tracked say how many planners are left
    assert watch.matters([Change(marker(n), None, 16 + i) for i, n in enumerate("bc")]) is False
    assert watch.matters([Change(marker("e"), None, 20)]) is True


def test_a_change_seen_before_the_read_is_seeded_is_judged_again_on_the_read():
    watch = seeded(revision=10)
    # The stream sees b's marker go at 12 while d's markers say a, b, c: two are left ...
    assert watch.matters([Change(marker("b"), None, 12)]) is False
    # ... but d's read, at 11, had only b left (a and c went at 11): on it, none is left now.
    assert watch.seed("d", {marker("b"): tuple("abc")}, 11) is True
    # A read at 12 has the change: nothing to replay.
    assert watch.seed("d", {}, 12) is False
    # Changes the read already holds are never replayed.
    watch = seeded(revision=10)
    assert watch.matters([Change(marker("a"), None, 11)]) is False
    assert watch.seed("d", {marker("b"): tuple("abc")}, 11) is False


def test_unseeded_or_overflowing_everything_matters():
    fresh = MarkerWatch(PLANNER_MARKERS, _marker_names)
    assert fresh.matters([Change(marker("a"), names("a"), 1)]) is True  # nothing read yet
    watch = seeded()
    for i in range(RECENT_LIMIT):
        assert watch.matters([Change(marker("b"), names("b", "c"), 11 + i)]) is False
    assert watch.matters([Change(marker("b"), names("b", "c"), 11 + RECENT_LIMIT)]) is True
    assert watch.matters([Change(marker("b"), names("b", "c"), 12 + RECENT_LIMIT)]) is True  # until a read
    assert watch.seed("d", {marker("b"): tuple("bc")}, 12 + RECENT_LIMIT) is False
    assert watch.matters([Change(marker("b"), names("b", "c"), 13 + RECENT_LIMIT)]) is False


def test_the_filter_keeps_created_and_the_events_that_matter():
    watch = seeded()
    stream = [
        WatchNews("created", 10),
        WatchNews("event", 11, (Change(marker("a"), None, 11),)),
        WatchNews("event", 12, (Change(DELTA, "{}", 12),)),
        WatchNews("event", 13),
    ]
    assert [n.revision for n in watch.filter(iter(stream))] == [10, 12, 13]
