"""A reader's copy of what it watches (``state/``, or a follower's plan feed), kept up to date
from its watch stream between reads.

The agents that plan (and group rank 0, and a live generation's joiners) read the whole of
``state/`` each time something in it changes: every node's record, O(N) bytes. While the first
generation forms, N nodes join one by one, so each of those readers reads O(N^2) bytes (881 MB
in all at 1,024 nodes), and every later event costs each of them O(N) again. Their watch
stream already carries every change with its value (v3), so ``StateMirror`` applies the changes
to the last whole read instead, and a read is needed only:

- when the mirror cannot be trusted: no stream open, a stream opened after the read (what
  happened in between is unknown), a change whose content is unknown (v2), too many changes
  buffered (see below);
- after the reader wrote under ``state/`` itself (``Membership`` says so: ``wrote``), so that
  it plans on a view that holds its own report or plan, not one its stream has yet to deliver;
- at least once a second (``MAX_AGE_S``), and after a read that failed (``forget``): reads are
  also how an agent learns that etcd answers (the fencing rule), and a silent stream (a network
  partition) ends only at its idle timeout.

A change can reach the stream before the read that already holds it is seeded, or after a read
that does not: ``seed`` replays the buffered changes newer than the read, so the mirror never
goes back in time. Each change applied moves the mirror's revision to the change's, which is
also the revision a caller then watches from.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from .kv import Change, Entry, Listing, WatchNews

MAX_AGE_S = 1.0  # a whole read at least this often while the mirror is used
RECENT_LIMIT = 4096  # changes buffered for a replay; beyond that, the next read must be newer


class StateMirror:
    def __init__(self, max_age_s: float | None = MAX_AGE_S, clock=time.monotonic):
        """``max_age_s``: None for a reader that reads only when woken anyway (a follower's plan
        feed: it learns whether etcd answers from those reads and its lease)."""
        self._lock = threading.Lock()
        self._max_age_s = max_age_s
        self._clock = clock
        self._entries: dict[str, Entry] | None = None  # None: nothing to trust
        self._read_revision = 0  # the last whole read's revision
        self._revision = 0  # the read's, or the newest change applied since
        self._read_at = 0.0  # when the last whole read was seeded
        self._stream_from: int | None = None  # the open stream's start revision; None: no stream
        self._recent: list[Change] = []  # changes since the last seed, for its replay
        self._dropped_up_to = 0  # the newest change dropped from ``_recent`` (a read must be newer)
        self.wrote = False  # the reader wrote under the prefix since its last read

    def listing(self) -> Listing | None:
        """What a read of the watched prefix would list now; None when a read is needed."""
        with self._lock:
            if (
                self._entries is None
                or self._stream_from is None
                or self.wrote
                or (self._max_age_s is not None and self._clock() - self._read_at > self._max_age_s)
            ):
                return None
            return Listing(sorted(self._entries.values(), key=lambda e: e.key), self._revision)

    def values(self, prefix: str) -> dict[str, str] | None:
        """The keys under ``prefix`` and their values as the stream has brought them (reads
        aside: no age limit); None when the copy cannot be trusted."""
        with self._lock:
            if self._entries is None or self._stream_from is None:
                return None
            return {k: e.value for k, e in self._entries.items() if k.startswith(prefix)}

    def forget(self) -> None:
        """A read failed: the next view must come from a read that gets through."""
        with self._lock:
            self._entries = None

    def seed(self, listing: Listing) -> None:
        """A read of the watched prefix; changes the stream delivered that are newer are kept."""
        with self._lock:
            self.wrote = False
            read = listing.revision
            self._recent = [c for c in self._recent if c.revision > read]
            if read < self._dropped_up_to or (self._stream_from is not None and read < self._stream_from):
                self._entries = None  # changes between the read and the stream are unknown
                return
            self._entries = {e.key: e for e in listing}
            self._read_revision = self._revision = read
            self._read_at = self._clock()
            for change in self._recent:
                self._apply(change)

    def follow(self, stream: Iterator[WatchNews]) -> Iterator[WatchNews]:
        """``stream`` (of the watched prefix), passed through after each message is applied."""
        try:
            for news in stream:
                self._on_news(news)
                yield news
        finally:
            with self._lock:
                self._stream_from, self._entries, self._recent = None, None, []

    def _on_news(self, news: WatchNews) -> None:
        with self._lock:
            if news.kind == "created":
                self._stream_from, self._recent = news.revision, []
                if self._entries is not None and self._revision < news.revision:
                    self._entries = None
                return
            if news.changes is None:
                self._entries = None
                return
            for change in news.changes:
                self._recent.append(change)
                if self._entries is not None:
                    self._apply(change)
            if len(self._recent) > RECENT_LIMIT:
                self._dropped_up_to = max(self._dropped_up_to, self._recent[-1].revision)
                self._recent = []

    def _apply(self, change: Change) -> None:
        """Changes come in revision order (a transaction's several at one revision); applying
        one again (the replay) sets the same value."""
        if change.revision <= self._read_revision:
            return  # the read already has it
        if change.value is None:
            self._entries.pop(change.key, None)
        else:
            self._entries[change.key] = Entry(change.key, change.value, change.revision)
        self._revision = max(self._revision, change.revision)
