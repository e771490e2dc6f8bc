"""Hang detection (pure): how long may a worker go without finishing a step?"""

from __future__ import annotations

import collections
from collections.abc import Sequence


def hang_timeout(cfg, recent_step_seconds: Sequence[float], steps_done: int, in_checkpoint: bool) -> float:
    """Seconds without step progress after which a worker counts as hung.

    * ``cfg.hang_timeout > 0``: that fixed value; else ``hang_multiplier`` x the slowest of the
      recent step times, never below ``hang_floor`` (slowest, not median: a worker killed by
      mistake costs a failover, a hang found a little later costs seconds).
    * No step time known yet, or fewer than ``hang_warmup_steps`` steps done: at least
      ``hang_warmup_timeout`` (compilation, first collectives, data loader start).
    * While a checkpoint is being saved: at least ``hang_checkpoint_timeout``.
    """
    if cfg.hang_timeout > 0:
        timeout = cfg.hang_timeout
    elif recent_step_seconds:
        timeout = max(cfg.hang_floor, cfg.hang_multiplier * max(recent_step_seconds))
    else:
        timeout = max(cfg.hang_floor, cfg.hang_warmup_timeout)
    if steps_done < cfg.hang_warmup_steps:
        timeout = max(timeout, cfg.hang_warmup_timeout)
    if in_checkpoint:
        timeout = max(timeout, cfg.hang_checkpoint_timeout)
    return timeout


class HangWatch:
    """Tracks one worker's step progress; ``hung(now)`` says when to kill it.

    Feed ``step(n, now)`` whenever the worker reports its step counter and
    ``checkpoint(active, now)`` around checkpoint saves.  Time is passed in (monotonic).
    """

    def __init__(self, cfg, now: float):
        self.cfg = cfg
        self.last_step: int | None = None
        self.steps_done = 0
        self.last_progress = now
        self.in_checkpoint = False
        self.recent: collections.deque = collections.deque(maxlen=cfg.hang_history)

    def step(self, step: int, now: float) -> None:
        if self.last_step is not None and step <= self.last_step:
            return  # a repeated report is not progress
        if self.last_step is not None and not self.in_checkpoint:
            # time per step since the previous report; a checkpoint save is not a step
            self.recent.append((now - self.last_progress) / (step - self.last_step))
        self.steps_done += 1 if self.last_step is None else step - self.last_step
        self.last_step = step
        self.last_progress = now

    def checkpoint(self, active: bool, now: float) -> None:
        if self.in_checkpoint and not active:
            self.last_progress = now  # the save finished: the next step starts now
        self.in_checkpoint = active

    def timeout(self) -> float:
        return hang_timeout(self.cfg, list(self.recent), self.steps_done, self.in_checkpoint)

    def overdue(self, now: float) -> float:
        """Seconds past the timeout (<= 0: not hung)."""
        return now - self.last_progress - self.timeout()

    def hung(self, now: float) -> bool:
        return self.overdue(now) > 0
