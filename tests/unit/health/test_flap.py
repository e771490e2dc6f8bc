"""Alarm JSON and the anti-flap filter."""

import json

import pytest

from health.alarms import DEGRADED, FATAL, INFO, Alarm, AlarmFilter, severity_rank
from health.config import HealthConfig


def alarm(sev, t, signal="temperature", value=88, node="n0", gpu=0):
    return Alarm(node, gpu, signal, value, sev, f"{signal} {value}", t)


def test_json_round_trip():
    a = Alarm("n1", None, "nvlink_down", [1, 2], FATAL, "links down", 12.5)
    d = a.to_json()
    assert json.loads(json.dumps(d)) == d
    assert Alarm.from_json(d) == a
    odd = Alarm("n1", 3, "nvlink_errors", {"replay": 2}, INFO, "m", 1.0).to_json()
    assert odd["value"] == {"replay": 2}
    weird = Alarm("n", 0, "s", float("inf"), INFO, "", 0.0).to_json()
    assert json.dumps(weird)


def test_bad_alarms():
    with pytest.raises(ValueError, match="severity"):
        alarm("warning", 0.0)
    with pytest.raises(ValueError, match="lacks"):
        Alarm.from_json({"node": "n"})


def test_severity_order():
    assert severity_rank(INFO) < severity_rank(DEGRADED) < severity_rank(FATAL)


def run(filter_, seq):
    """seq of (severity, t[, signal, value]) -> list of (severity, t) that passed"""
    out = []
    for item in seq:
        sev, t, *rest = item
        a = alarm(sev, t, *rest)
        passed = filter_.admit(a)
        if passed is not None:
            out.append((passed.severity, passed.time))
    return out


CFG = HealthConfig(alarm_hold=600, repeat_count=3, repeat_window=300)


@pytest.mark.parametrize(
    "seq, expected",
    [
        # the same degraded condition, polled every 5 s: one alarm
        ([(DEGRADED, 0), (DEGRADED, 5), (DEGRADED, 10)], [(DEGRADED, 0)]),
        # a condition that flaps (hot, cool, hot, cool, hot): one alarm, no clear
        ([(DEGRADED, 0), (DEGRADED, 20), (DEGRADED, 40)], [(DEGRADED, 0)]),
        # escalation passes, de-escalation never does
        ([(DEGRADED, 0), (FATAL, 5), (DEGRADED, 10), (FATAL, 15)], [(DEGRADED, 0), (FATAL, 5)]),
        ([(FATAL, 0), (DEGRADED, 5)], [(FATAL, 0)]),
        # after the hold, a condition still present is raised again (a reminder, not a flap)
        ([(DEGRADED, 0), (DEGRADED, 599), (DEGRADED, 600)], [(DEGRADED, 0), (DEGRADED, 600)]),
        # info events are escalated when they keep happening
        (
            [(INFO, 0, "nvlink_errors", 1), (INFO, 5, "nvlink_errors", 2), (INFO, 10, "nvlink_errors", 3), (INFO, 15, "nvlink_errors", 4)],
            [(INFO, 0), (INFO, 5), (DEGRADED, 10)],
        ),
        # ... but not when spread over more than repeat_window
        ([(INFO, 0, "xid", 13), (INFO, 200, "xid", 31), (INFO, 400, "xid", 43)], [(INFO, 0), (INFO, 200), (INFO, 400)]),
        # identical info events are logged once, but still count towards escalation
        ([(INFO, 0, "nvml_error", "x"), (INFO, 1, "nvml_error", "x"), (INFO, 2, "nvml_error", "x")], [(INFO, 0), (DEGRADED, 2)]),
        # an info alarm never masks a later degraded one of the same signal
        ([(INFO, 0, "xid", 13), (DEGRADED, 1, "xid", 63)], [(INFO, 0), (DEGRADED, 1)]),
        # info after degraded of the same signal: suppressed
        ([(DEGRADED, 0, "xid", 63), (INFO, 1, "xid", 13)], [(DEGRADED, 0)]),
    ],
)
def test_filter_table(seq, expected):
    assert run(AlarmFilter(CFG), seq) == expected


def test_keys_are_node_gpu_signal():
    f = AlarmFilter(CFG)
    assert f.admit(alarm(DEGRADED, 0, gpu=0)) is not None
    assert f.admit(alarm(DEGRADED, 0, gpu=1)) is not None
    assert f.admit(alarm(DEGRADED, 0, node="n1")) is not None
    assert f.admit(alarm(DEGRADED, 0, signal="clocks")) is not None
    assert f.admit(alarm(DEGRADED, 1, gpu=0)) is None
    assert f.suppressed == 1


def test_hold_zero_latches_forever():
    f = AlarmFilter(HealthConfig(alarm_hold=0))
    assert run(f, [(DEGRADED, 0), (DEGRADED, 1e6)]) == [(DEGRADED, 0)]


def test_escalated_message_says_why():
    f = AlarmFilter(HealthConfig(repeat_count=2))
    f.admit(alarm(INFO, 0, "xid", 999))
    out = f.admit(alarm(INFO, 1, "xid", 999))
    assert out.severity == DEGRADED and "repeated 2 times within 300 s" in out.message
