"""Say what a long wait is waiting for, every few seconds: not silence, and not a line per loop.

Why: a job that waits for a node, a spare or a store host looks exactly like a hung job unless it
says so. Every waiting loop in the agent and the worker runtime asks an ``Every`` whether it is
time to print its one line (what it waits for, how long so far, the limit).
"""

from __future__ import annotations

import time

INTERVAL = 5.0  # seconds between two progress lines of one wait


class Every:
    """``due()`` is True once ``first`` seconds after creation, then every ``interval`` seconds."""

    def __init__(self, interval: float = INTERVAL, first: float | None = None, clock=time.monotonic):
        self.interval, self.clock = interval, clock
        self.started = clock()
        self.next = self.started + (interval if first is None else first)

    def due(self) -> bool:
        now = self.clock()
        if now < self.next:
            return False
        self.next += self.interval
        if self.next <= now:  # a loop that stalled prints one line, not a burst of the missed ones
            self.next = now + self.interval
        return True

    @property
    def elapsed(self) -> float:
        return self.clock() - self.started
