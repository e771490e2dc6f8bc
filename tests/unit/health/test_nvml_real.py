"""The monitor against the real NVML of this machine's driver (skipped where there is none),
and ``python -m health`` where there is no driver."""

import json
import time

import pytest

from health import __main__ as health_main
from health.alarms import INFO
from health.config import HealthConfig
from health.nvml_monitor import NvmlMonitor, gpus_for_local_ranks


def _driver():
    """(pynvml, GPU count), or None when no NVML driver answers here."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 -- ImportError, NVMLError_LibraryNotFound, DriverNotLoaded...
        return None
    try:
        return pynvml, pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()


DRIVER = _driver()
needs_driver = pytest.mark.skipif(DRIVER is None, reason="no NVIDIA driver (NVML) on this machine")


@needs_driver
def test_real_nvml_watches_every_gpu_quietly():
    pynvml, count = DRIVER
    got = []
    cfg = HealthConfig(poll_interval=0.2)
    mon = NvmlMonitor("node", gpus_for_local_ranks(count, None), cfg, got.append, nvml=pynvml)
    t0 = time.perf_counter()
    assert mon.start() is True
    started = time.perf_counter() - t0
    try:
        time.sleep(2.0)  # about 10 background polls, XID thread blocked in the event wait
        assert mon.poll_once() == []
    finally:
        mon.stop()
    assert started < 5.0
    assert len(mon.unsupported()) == count
    # a healthy idle GPU: nothing above info (info: e.g. an NVLink down since before start-up)
    assert [a for a in got if a.severity != INFO] == [], [a.to_json() for a in got]


@needs_driver
def test_python_m_health_bench_on_the_real_driver(capsys, monkeypatch):
    monkeypatch.delenv("TM_FAKE_NVML", raising=False)
    assert health_main.main(["--bench", "20"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["gpus"] == DRIVER[1] and out["cpu_ms_per_poll"] > 0 and out["start_ms"] > 0


@pytest.mark.skipif(DRIVER is not None, reason="an NVIDIA driver is present")
def test_python_m_health_without_nvml_exits_2(monkeypatch):
    monkeypatch.delenv("TM_FAKE_NVML", raising=False)
    assert health_main.main(["--bench", "1"]) == 2
