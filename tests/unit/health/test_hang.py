"""Hang timeout (pure): the limit the agent's watchdog (``WorkerSupervisor.watch_hangs``) applies."""

import pytest

from health.config import HealthConfig
from health.hang import hang_timeout

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
