"""Which changes to the plan feed a node that only follows plans must read etcd for.

A follower watches ``state/plan-feed/``: the plan's delta and the planners' leased markers.
When a planner dies, the markers change two to four times (its marker expires, the survivors
name the next planner in theirs, that node writes its own), at the very moment the survivors
plan. Reading the feed on each of those costs every follower one request each time: at 1,024
nodes, thousands of requests that etcd serves while the replacement plan waits in its queue.

A follower needs a read for only three things: a new delta (a new plan), a marker that names it
(it must start planning), and no marker left (someone must take over). ``MarkerWatch`` tells
them apart from the changes the watch stream carries (v3 events hold the key and the value), so
that the rest of the markers' churn costs a follower no request at all.

It knows the markers from the follower's last read (``seed``) and the changes since. A change
can reach the stream's thread before the read that already contains it is seeded, or after a
read that does not: ``seed`` replays the changes newer than the read on the read's markers and
says when one of them matters, so that the caller reads again. A change whose content is not
known (the v2 API), or a marker that cannot be parsed, always matters: the read judges it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Callable

from .kv import Change, WatchNews

RECENT_LIMIT = 256  # changes kept for the replay; beyond that, every change matters until a read


class MarkerWatch:
    def __init__(self, markers_prefix: str, names: Callable[[str], tuple[str, ...]]):
        """``names`` parses a marker's value (the planners it names), raising ValueError."""
        self._prefix = markers_prefix
        self._names = names
        self._lock = threading.Lock()
        self._node: str | None = None
        self._markers: dict[str, tuple[str, ...]] | None = None  # None: unknown, every change matters
        self._seeded = 0  # the revision of the read the markers come from
        self._recent: list[Change] = []  # changes newer than that read, in order

    def seed(self, node: str, markers: dict[str, tuple[str, ...]], revision: int) -> bool:
        """``node`` read ``markers`` (key -> names, the readable ones) at ``revision``. True when a
        change newer than the read, already seen by the stream, matters on them: read again."""
        with self._lock:
            self._node, self._markers, self._seeded = node, dict(markers), revision
            self._recent = [c for c in self._recent if c.revision > revision]
            return any([self._apply(c) for c in self._recent])

    def matters(self, changes: Iterable[Change] | None) -> bool:
        """Whether a message of the stream calls for a read (None: what changed is unknown)."""
        if changes is None:
            return True
        with self._lock:
            relevant = False
            for change in changes:
                if change.revision <= self._seeded:
                    continue  # the last read has it
                self._recent.append(change)
                if len(self._recent) > RECENT_LIMIT:
                    self._markers, self._recent = None, []
                relevant = self._apply(change) or relevant
            return relevant

    def filter(self, stream: Iterator[WatchNews]) -> Iterator[WatchNews]:
        """``stream`` less the events no read is needed for."""
        for news in stream:
            if news.kind != "event" or self.matters(news.changes):
                yield news

    def _apply(self, change: Change) -> bool:
        if not change.key.startswith(self._prefix) or self._markers is None:
            return True  # the delta (a new plan), or markers not known
        if change.value is None:
            self._markers.pop(change.key, None)
            return not self._markers  # no planner left: someone must take over
        try:
            names = self._names(change.value)
        except ValueError:
            self._markers.pop(change.key, None)
            return True
        self._markers[change.key] = names
        return self._node in names
