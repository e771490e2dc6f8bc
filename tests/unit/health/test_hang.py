"""Hang timeout (pure) and the per-worker HangWatch."""

import pytest

from health.config import HealthConfig
from health.hang import HangWatch, hang_timeout

AUTO = HealthConfig(
    hang_timeout=0, hang_multiplier=10, hang_floor=60, hang_warmup_steps=3, hang_warmup_timeout=600, hang_checkpoint_timeout=900
)


@pytest.mark.parametrize(
    "cfg_kw, recent, steps, ckpt, expected",
    [
        ({}, [1.0, 1.2, 0.9], 100, False, 60.0),  # 10 x 1.2 = 12 < floor 60
        ({}, [10.0, 12.0, 11.0], 100, False, 120.0),  # 10 x slowest (12)
        ({}, [10.0, 30.0, 11.0], 100, False, 300.0),  # slowest, not median
        ({}, [], 100, False, 600.0),  # nothing observed yet
        ({}, [1.0], 0, False, 600.0),  # warm-up steps
        ({}, [1.0], 2, False, 600.0),
        ({}, [1.0], 3, False, 60.0),  # warm-up over
        ({}, [100.0], 1, False, 1000.0),  # warm-up never shortens
        ({}, [1.0], 100, True, 900.0),  # checkpoint save
        ({}, [200.0], 100, True, 2000.0),  # checkpoint never shortens
        ({"hang_timeout": 30}, [10.0, 50.0], 100, False, 30.0),  # fixed
        ({"hang_timeout": 30}, [], 0, False, 600.0),  # fixed, but warm-up
        ({"hang_timeout": 30}, [1.0], 100, True, 900.0),  # fixed, but checkpoint
        ({"hang_multiplier": 3, "hang_floor": 5}, [2.0], 10, False, 6.0),
        ({"hang_floor": 0, "hang_multiplier": 2}, [0.5], 10, False, 1.0),
    ],
)
def test_hang_timeout_table(cfg_kw, recent, steps, ckpt, expected):
    cfg = HealthConfig(**{**AUTO.to_dict(), **cfg_kw})
    assert hang_timeout(cfg, recent, steps, ckpt) == pytest.approx(expected)


FAST = HealthConfig(
    hang_multiplier=4, hang_floor=1, hang_warmup_steps=2, hang_warmup_timeout=10, hang_checkpoint_timeout=20, hang_history=5
)


def test_watch_learns_step_time_and_detects_hang():
    w = HangWatch(FAST, now=0.0)
    assert w.timeout() == 10 and not w.hung(9.9) and w.hung(10.1)
    for i, t in enumerate([5.0, 5.5, 6.0, 6.5]):  # steps every 0.5 s after a slow first
        w.step(i, t)
    assert w.steps_done == 4
    assert w.timeout() == pytest.approx(max(1, 4 * 0.5))
    assert not w.hung(6.5 + 1.9)
    assert w.hung(6.5 + 2.1)
    assert w.overdue(6.5 + 3.0) == pytest.approx(1.0)


def test_repeated_report_is_not_progress_and_skipped_steps_count():
    w = HangWatch(FAST, now=0.0)
    w.step(10, 1.0)
    w.step(10, 5.0)
    assert w.last_progress == 1.0
    w.step(14, 3.0 + 1.0)  # 4 steps in 3 s: 0.75 s per step
    assert w.steps_done == 5
    assert list(w.recent) == [pytest.approx(0.75)]


def test_checkpoint_extends_and_is_not_a_step_time():
    w = HangWatch(FAST, now=0.0)
    for i in range(4):
        w.step(i, float(i))
    assert w.timeout() == 4.0
    w.checkpoint(True, 3.5)
    assert w.timeout() == 20 and not w.hung(3.0 + 19.0)
    w.checkpoint(False, 15.0)  # save took 11.5 s
    assert w.timeout() == 4.0
    assert not w.hung(18.9) and w.hung(19.1)  # counted from the end of the save
    w.step(4, 16.0)
    assert max(w.recent) == 1.0  # the save did not pollute step times


def test_history_is_bounded():
    w = HangWatch(FAST, now=0.0)
    w.step(0, 0.0)
    w.step(1, 100.0)  # one very slow step ...
    for i in range(2, 8):
        w.step(i, 100.0 + (i - 1))  # ... then five 1 s steps push it out
    assert len(w.recent) == 5 and w.timeout() == 4.0
