"""Which changes to the plan feed wake a node that only follows plans.

A follower watches ``state/plan-feed/``: the plan's delta and the planners' leased markers.
When a planner dies, the markers change two to four times (its marker expires, the survivors
name the next planner in theirs, that node writes its own), at the very moment the survivors
plan. Waking every follower for each of those, each reading the feed, costs one request per
follower each time: at 1,024 nodes, thousands of requests that etcd serves while the
replacement plan waits in its queue.

A follower needs to act on three things only: a new delta (a new plan), a marker that names it
(it must start planning), and no marker left (someone must take over). ``matters`` tells them
apart, for one change, from the markers its copy of the feed holds once the change is applied
(``rendezvous.state_mirror``, None when that copy cannot be trusted): the rest of the markers'
churn costs a follower neither a wake nor a request. A marker that cannot be parsed matters:
the read that follows judges it (and names the bad key).
"""

from __future__ import annotations

from collections.abc import Callable

from .kv import Change


def matters(
    node: str, change: Change, markers_prefix: str, markers: dict[str, str] | None, names: Callable[[str], tuple[str, ...]]
) -> bool:
    """Whether ``change`` calls for ``node`` to read the feed; ``markers``: key -> value of the
    markers after it (None: unknown), ``names`` parses a marker's value, raising ValueError."""
    if not change.key.startswith(markers_prefix) or markers is None:
        return True  # the delta (a new plan), or markers not known
    if change.value is None:
        return not any(_readable(names, value) for value in markers.values())  # no planner left
    try:
        return node in names(change.value)
    except ValueError:
        return True


def _readable(names: Callable[[str], tuple[str, ...]], value: str) -> bool:
    try:
        names(value)
        return True
    except ValueError:
        return False
