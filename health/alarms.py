"""Alarms and the anti-flap filter every alarm passes before it reaches the planner.

Severities: ``fatal`` (fail over now), ``degraded`` (planned migration to a spare),
``info`` (logged).  There is no "clear" alarm: once raised, a node/gpu/signal stays at its
highest severity for ``alarm_hold`` seconds, so the planner never sees a signal come and go.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from dataclasses import dataclass

FATAL, DEGRADED, INFO = "fatal", "degraded", "info"
SEVERITIES = (INFO, DEGRADED, FATAL)
_RANK = {INFO: 0, DEGRADED: 1, FATAL: 2}


def severity_rank(severity: str) -> int:
    """info < degraded < fatal."""
    return _RANK[severity]


def _jsonable(value):
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value) if isinstance(value, (set, frozenset)) else value
        return [_jsonable(v) for v in items]
    return str(value)


@dataclass(frozen=True)
class Alarm:
    node: str
    gpu: int | None  # local GPU: index into the agent's gpus list (= LOCAL_RANK)
    signal: str  # e.g. "xid", "ecc_dbe", "nvml_hang", "straggler", "hang"
    value: object  # JSON-able reading (XID number, temperature, delta, ...)
    severity: str  # FATAL, DEGRADED or INFO
    message: str
    time: float  # wall-clock seconds (time.time())

    def __post_init__(self):
        if self.severity not in _RANK:
            raise ValueError(f"Alarm.severity must be one of {SEVERITIES}, got {self.severity!r}")

    def to_json(self) -> dict:
        return {
            "node": self.node,
            "gpu": self.gpu,
            "signal": self.signal,
            "value": _jsonable(self.value),
            "severity": self.severity,
            "message": self.message,
            "time": self.time,
        }

    @staticmethod
    def from_json(d: dict) -> Alarm:
        missing = [k for k in ("node", "signal", "severity", "time") if k not in d]
        if missing:
            raise ValueError(f"alarm JSON lacks {', '.join(missing)}: {d!r}")
        gpu = d.get("gpu")
        return Alarm(
            node=str(d["node"]),
            gpu=None if gpu is None else int(gpu),
            signal=str(d["signal"]),
            value=d.get("value"),
            severity=str(d["severity"]),
            message=str(d.get("message", "")),
            time=float(d["time"]),
        )


class AlarmFilter:
    """De-duplicates and escalates alarms so that the planner never flaps.

    * Escalation: an ``info`` alarm whose node/gpu/signal occurs ``repeat_count`` times within
      ``repeat_window`` seconds is raised as ``degraded`` (e.g. NVLink errors growing in three
      polls, an unknown XID repeating, NVML calls failing again and again).
    * Latching: an alarm passes only if its severity is higher than the highest one already
      passed for the same node/gpu/signal within ``alarm_hold`` seconds (0 = forever).
      Info alarms latch per value too, so distinct info events (XID 13, then XID 31) are each
      logged once.  Severity never goes down and nothing is ever "cleared".

    Pure: time comes from ``alarm.time``.  Not thread-safe; callers serialize.
    """

    def __init__(self, cfg):
        self.repeat_count = cfg.repeat_count
        self.repeat_window = cfg.repeat_window
        self.hold = cfg.alarm_hold
        self._info_times: dict[tuple, collections.deque] = {}
        self._passed: dict[tuple, tuple[int, float]] = {}
        self.suppressed = 0

    def admit(self, alarm: Alarm) -> Alarm | None:
        key = (alarm.node, alarm.gpu, alarm.signal)
        now = alarm.time
        if alarm.severity == INFO:
            times = self._info_times.setdefault(key, collections.deque())
            times.append(now)
            while times and now - times[0] > self.repeat_window:
                times.popleft()
            if len(times) >= self.repeat_count:
                alarm = dataclasses.replace(
                    alarm, severity=DEGRADED, message=f"{alarm.message} (repeated {len(times)} times within {self.repeat_window:g} s)"
                )
        rank = _RANK[alarm.severity]
        latch_key = key if alarm.severity != INFO else key + (repr(alarm.value),)
        for k in {key, latch_key}:
            prev = self._passed.get(k)
            if prev is not None and rank <= prev[0] and (self.hold <= 0 or now - prev[1] < self.hold):
                self.suppressed += 1
                return None
        self._passed[latch_key] = (rank, now)
        if latch_key != key:
            # an info alarm never masks a later degraded/fatal one of the same signal
            self._passed.setdefault(key, (-1, now))
        return alarm
