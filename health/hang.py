"""Hang detection (pure): how long may a worker go without finishing a step?"""

from __future__ import annotations

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
