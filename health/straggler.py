"""Straggler detection, C4-style (pure).

Collectives equalise total step time across ranks, so the input is each rank's *compute*
time: step time minus the time blocked in the job's collectives.  Per window, every rank gets
a robust z-score (modified z of Iglewicz & Hoaglin, the statistic behind the 3.5 threshold):

    M = median(c),  MAD = max(median(|c - M|), floor * M),  z = 0.6745 (c - M) / MAD

A rank is slow in a window when z > straggler_z and c > straggler_ratio * M, and a straggler
when it was slow in straggler_need of its last straggler_of windows.  With fewer than three
ranks the median cannot single one out, so nothing is ever flagged there.
"""

from __future__ import annotations

import collections
import statistics
import time as _time
from collections.abc import Sequence

from .alarms import DEGRADED, Alarm

_Z_SCALE = 0.6745  # makes MAD comparable to a standard deviation for normal data


def robust_z(values: Sequence[float], mad_floor: float = 0.01) -> list[float]:
    """Modified z-score of each value: median/MAD, MAD floored at ``mad_floor`` x median."""
    if not values:
        return []
    med = statistics.median(values)
    mad = statistics.median(abs(v - med) for v in values)
    mad = max(mad, mad_floor * abs(med))
    if mad == 0:
        # all equal to a zero median: nobody deviates; anything above it deviates infinitely
        return [0.0 if v == med else (float("inf") if v > med else float("-inf")) for v in values]
    return [_Z_SCALE * (v - med) / mad for v in values]


class StragglerDetector:
    """Feed one window of per-rank compute seconds at a time; get the current stragglers."""

    def __init__(self, cfg):
        self.cfg = cfg
        self._slow: dict[int, collections.deque] = {}
        self.last_median: float | None = None
        self.last_z: dict[int, float] = {}
        self.last_values: dict[int, float] = {}

    def add_window(self, compute_seconds_by_rank: dict[int, float]) -> list[int]:
        ranks = sorted(compute_seconds_by_rank)
        values = [float(compute_seconds_by_rank[r]) for r in ranks]
        zs = robust_z(values, self.cfg.straggler_mad_floor) if len(values) >= 3 else [0.0] * len(values)
        med = statistics.median(values) if values else None
        self.last_median = med
        self.last_z = dict(zip(ranks, zs))
        self.last_values = dict(zip(ranks, values))
        for rank, value, z in zip(ranks, values, zs):
            slow = z > self.cfg.straggler_z and value > self.cfg.straggler_ratio * med
            hist = self._slow.setdefault(rank, collections.deque(maxlen=self.cfg.straggler_of))
            hist.append(slow)
        # a rank absent from this window (left the job) forgets its history
        for rank in [r for r in self._slow if r not in compute_seconds_by_rank]:
            del self._slow[rank]
        return [r for r in ranks if sum(self._slow[r]) >= self.cfg.straggler_need]

    def reset(self, rank: int | None = None) -> None:
        """Forget history: of one rank (its node was replaced) or of all."""
        if rank is None:
            self._slow.clear()
        else:
            self._slow.pop(rank, None)

    def alarm_for(self, rank: int, node: str, gpu: int | None = None, now: float | None = None) -> Alarm:
        """The degraded alarm for a straggler returned by the last ``add_window``."""
        value = self.last_values.get(rank)
        z = self.last_z.get(rank, 0.0)
        med = self.last_median or 0.0
        ratio = value / med if value is not None and med else float("inf")
        slow = sum(self._slow.get(rank, ()))
        return Alarm(
            node=node,
            gpu=gpu,
            signal="straggler",
            value=rank,
            severity=DEGRADED,
            message=(
                f"rank {rank} is a straggler: compute {value:.4g} s = "
                f"{ratio:.2f}x median, z {z:.1f}, slow in {slow} of the last "
                f"{self.cfg.straggler_of} windows"
            ),
            time=_time.time() if now is None else now,
        )
