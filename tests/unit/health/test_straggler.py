"""Straggler statistic: robust z, MAD floor, the 3-of-5 rule."""

import math

import pytest

from health.alarms import DEGRADED
from health.config import HealthConfig
from health.straggler import StragglerDetector, robust_z


def test_robust_z_by_hand():
    # median 10, |dev| = [0,0,0,1,10] -> MAD 0 -> floored at 1% of 10 = 0.1
    z = robust_z([10, 10, 10, 11, 20])
    assert z[:3] == [0.0, 0.0, 0.0]
    assert z[3] == pytest.approx(0.6745 * 1 / 0.1)
    assert z[4] == pytest.approx(0.6745 * 10 / 0.1)
    # median 10, deviations [2,1,0,1,2] -> MAD 1
    assert robust_z([8, 9, 10, 11, 12]) == pytest.approx([-1.349, -0.6745, 0, 0.6745, 1.349])


@pytest.mark.parametrize(
    "values, mad_floor, expected_mad",
    [
        ([100, 100, 100, 100], 0.01, 1.0),  # MAD 0 -> 1% of 100
        ([100, 100, 100, 130], 0.01, 1.0),  # MAD 0 (median of [0,0,0,30]) -> floor
        ([90, 100, 110, 100], 0.01, 5.0),  # MAD 5 > floor
        ([100, 100, 100, 130], 0.05, 5.0),  # a bigger floor
    ],
)
def test_mad_floor(values, mad_floor, expected_mad):
    z = robust_z(values, mad_floor)
    med = sorted(values)[len(values) // 2 - 1 : len(values) // 2 + 1]
    med = sum(med) / 2
    for v, zi in zip(values, z):
        assert zi == pytest.approx(0.6745 * (v - med) / expected_mad)


def test_zero_median_and_empty():
    assert robust_z([]) == []
    assert robust_z([0, 0, 0]) == [0.0, 0.0, 0.0]
    z = robust_z([0, 0, 0, 1])
    assert z[:3] == [0.0, 0.0, 0.0] and math.isinf(z[3])


def window(slow_rank=None, slow=1.5, n=8, base=1.0):
    return {r: (base * slow if r == slow_rank else base) for r in range(n)}


CFG = HealthConfig()


@pytest.mark.parametrize(
    "pattern, flagged_after",
    [
        # 1 = rank 3 slow in that window; flagged when slow in 3 of the last 5
        ("111", [False, False, True]),
        ("11011", [False, False, False, True, True]),
        ("10101", [False, False, False, False, True]),
        ("1001001", [False] * 7),
        ("11100", [False, False, True, True, True]),
        ("111000", [False, False, True, True, True, False]),
        ("0000011", [False] * 7),
    ],
)
def test_three_of_five(pattern, flagged_after):
    det = StragglerDetector(CFG)
    out = [3 in det.add_window(window(3 if c == "1" else None)) for c in pattern]
    assert out == flagged_after


@pytest.mark.parametrize(
    "values, expected",
    [
        # z huge (MAD floored) but only 1.1x the median: not slow (ratio rule)
        ({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.1}, []),
        ({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.21}, [3]),
        # noisy ranks: 1.3x the median but within the spread (z < 3.5)
        ({0: 0.8, 1: 1.2, 2: 1.0, 3: 0.9, 4: 1.1, 5: 1.3}, []),
        # two slow ranks out of eight
        ({**{r: 1.0 for r in range(8)}, 2: 2.0, 6: 1.9}, [2, 6]),
        # fast ranks are never stragglers
        ({0: 1.0, 1: 1.0, 2: 1.0, 3: 0.2}, []),
    ],
)
def test_both_conditions(values, expected):
    det = StragglerDetector(HealthConfig(straggler_need=1, straggler_of=1))
    assert det.add_window(values) == expected


def test_two_ranks_never_flag():
    det = StragglerDetector(HealthConfig(straggler_need=1, straggler_of=1))
    assert det.add_window({0: 1.0, 1: 10.0}) == []


def test_replaced_rank_forgets_history():
    det = StragglerDetector(CFG)
    det.add_window(window(3))
    det.add_window(window(3))
    det.add_window({r: 1.0 for r in range(8) if r != 3})  # rank 3 left
    assert det.add_window(window(3)) == []  # history restarted
    det.add_window(window(3))
    det.reset(3)
    assert det.add_window(window(3)) == []
    det.add_window(window(3))
    det.reset()  # everyone forgets
    assert det.add_window(window(3)) == []


def test_alarm_for():
    det = StragglerDetector(CFG)
    for _ in range(3):
        flagged = det.add_window(window(5, slow=2.0))
    assert flagged == [5]
    a = det.alarm_for(5, "node-b", gpu=1, now=100.0)
    assert (a.node, a.gpu, a.signal, a.value, a.severity, a.time) == ("node-b", 1, "straggler", 5, DEGRADED, 100.0)
    assert "2.00x median" in a.message and "3 of the last 5" in a.message
