"""StateMirror: when a whole reader's copy of state/ stands in for a read (table tests, no etcd;
the agents' use of it runs in test_rendezvous_scale.py and every multi-node test)."""

from __future__ import annotations

import pytest

from rendezvous.kv import Change, Entry, Listing, WatchNews
from rendezvous.state_mirror import RECENT_LIMIT, StateMirror


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def listing(revision: int, **values: str) -> Listing:
    return Listing([Entry(f"state/{k}", v, revision) for k, v in sorted(values.items())], revision)


def as_dict(lst: Listing | None) -> dict | None:
    return None if lst is None else {e.key[len("state/") :]: (e.value, e.revision) for e in lst}


def event(*changes: tuple) -> WatchNews:
    cs = tuple(Change(f"state/{k}", v, r) for k, v, r in changes)
    return WatchNews("event", max(c.revision for c in cs), cs)


def mirror_at(revision: int = 10, clock: Clock | None = None, **values):
    """A mirror seeded at ``revision`` whose stream opened at the same revision, that stream
    (``follow``) and its messages: ``push`` appends one and lets the mirror take it."""
    m = StateMirror(clock=clock or Clock())
    m.seed(listing(revision, **values))
    feed = [WatchNews("created", revision)]
    stream = m.follow(iter(feed))
    next(stream)
    return m, stream, feed


def push(stream, feed, news):
    feed.append(news)
    next(stream)


def test_changes_after_the_read_are_applied_in_order():
    m, stream, feed = mirror_at(a="1", b="1")
    push(stream, feed, event(("a", "2", 11)))
    push(stream, feed, event(("plan", "p", 12), ("plan-feed/delta", "d", 12)))  # one transaction
    push(stream, feed, event(("b", None, 13)))
    lst = m.listing()
    assert as_dict(lst) == {"a": ("2", 11), "plan": ("p", 12), "plan-feed/delta": ("d", 12)}
    assert lst.revision == 13
    assert [e.key for e in lst] == sorted(e.key for e in lst)


@pytest.mark.parametrize(
    "case, setup",
    [
        ("its own write not yet read back", lambda m, clock: setattr(m, "wrote", True)),
        ("the read is over a second old", lambda m, clock: setattr(clock, "now", clock.now + 1.5)),
        ("a read failed since", lambda m, clock: m.forget()),
    ],
)
def test_a_read_is_needed(case, setup):
    clock = Clock()
    m, stream, feed = mirror_at(clock=clock, a="1")
    assert m.listing() is not None
    setup(m, clock)
    assert m.listing() is None, case
    m.seed(listing(10, a="1"))
    assert m.listing() is not None, case


def test_a_stream_opened_after_the_read_or_ended_or_blind_is_not_trusted():
    m = StateMirror(clock=Clock())
    m.seed(listing(10, a="1"))
    assert m.listing() is None  # no stream open
    feed = [WatchNews("created", 12)]  # 11 happened in between: unknown
    stream = m.follow(iter(feed))
    next(stream)
    assert m.listing() is None
    m.seed(listing(12, a="2"))
    assert as_dict(m.listing()) == {"a": ("2", 12)}
    push(stream, feed, WatchNews("event", 13))  # v2: something changed, nobody says what
    assert m.listing() is None
    m.seed(listing(13, a="3"))
    assert m.listing() is not None
    stream.close()  # the stream ended (a dead member, the scope changed)
    assert m.listing() is None


def test_a_read_older_than_a_change_already_applied_does_not_go_back_in_time():
    m, stream, feed = mirror_at(a="1")
    push(stream, feed, event(("a", "2", 11)))
    push(stream, feed, event(("b", "1", 12)))
    m.seed(listing(11, a="2"))  # a read that was answered before 12 reached etcd's reply
    assert as_dict(m.listing()) == {"a": ("2", 11), "b": ("1", 12)}
    m.seed(listing(12, a="2", b="1"))
    push(stream, feed, event(("b", "0", 9)))  # never: but older than the read, it would be ignored
    assert as_dict(m.listing()) == {"a": ("2", 12), "b": ("1", 12)}


def test_too_many_changes_buffered_need_a_newer_read():
    m, stream, feed = mirror_at(a="0")
    for i in range(RECENT_LIMIT + 1):
        push(stream, feed, event(("a", str(i), 11 + i)))
    newest = 11 + RECENT_LIMIT
    assert as_dict(m.listing()) == {"a": (str(RECENT_LIMIT), newest)}  # applied: still exact
    m.seed(listing(newest - 1, a="x"))  # older than changes it can no longer replay
    assert m.listing() is None
    m.seed(listing(newest, a=str(RECENT_LIMIT)))
    assert as_dict(m.listing()) == {"a": (str(RECENT_LIMIT), newest)}
