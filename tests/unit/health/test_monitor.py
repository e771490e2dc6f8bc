"""NvmlMonitor driven through the scripted fake at the pynvml boundary, with real threads."""

import json
import logging
import sys
import textwrap
import threading
import time

import pytest
from test_nvml_real import DRIVER

from health import __main__ as health_main
from health.alarms import DEGRADED, FATAL, INFO
from health.config import HealthConfig
from health.nvml_monitor import NvmlMonitor, gpus_for_local_ranks
from tests.doubles.fake_nvml import FakeNvml


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class Sink(list):
    def __call__(self, alarm):
        self.append(alarm)

    def triples(self):
        return [(a.signal, a.severity, a.value) for a in self]


def wait_for(pred, timeout=3.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def write(tmp_path, text):
    path = tmp_path / "timeline.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.fixture
def monitors():
    made = []
    yield made
    for mon, fake in made:
        if fake is not None:
            fake.release()
        mon.stop()


REALTIME = dict(poll_interval=0.1, event_wait_ms=50, nvml_timeout=2.0)


# ---------------------------------------------------------------------- real time, real files
def test_issue_timeline_from_env_file(tmp_path, monkeypatch, monitors):
    path = write(
        tmp_path,
        """\
        gpus: 1
        events:
          - {at: 0.2, gpu: 0, xid: 79}
          - {at: 0.3, gpu: 0, field: NVML_FI_DEV_ECC_DBE_VOL_TOTAL, value: 1}
          - {at: 0.4, gpu: 0, raise: NVMLError_GpuIsLost}
        """,
    )
    monkeypatch.setenv("TM_FAKE_NVML", path)
    got = Sink()
    mon = NvmlMonitor("node-a", ["0"], HealthConfig(**REALTIME), got)
    monitors.append((mon, None))
    t0 = time.monotonic()
    assert mon.start() is True
    assert wait_for(lambda: len(got) >= 3)
    assert time.monotonic() - t0 < 2.0
    assert got.triples() == [("xid", FATAL, 79), ("ecc_dbe", FATAL, 1), ("gpu_lost", FATAL, "nvmlDeviceGetFieldValues")]
    assert all(a.node == "node-a" and a.gpu == 0 for a in got)
    assert "XID 79 (GPU has fallen off the bus)" in got[0].message
    time.sleep(0.3)
    assert len(got) == 3  # a lost GPU is reported once, not every poll
    mon.stop()
    assert not any(t.name.startswith("tm-health") and t.is_alive() and "call" not in t.name for t in threading.enumerate())


@pytest.mark.skipif(DRIVER is not None, reason="an NVIDIA driver is present")
def test_real_pynvml_without_driver_is_one_info_line(monkeypatch, caplog):
    monkeypatch.delenv("TM_FAKE_NVML", raising=False)
    got = Sink()
    mon = NvmlMonitor("n", ["0", "1"], HealthConfig(), got)
    before = threading.active_count()
    with caplog.at_level(logging.DEBUG, logger="health"):
        assert mon.start() is False
    records = [r for r in caplog.records if r.name.startswith("health")]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert "NVMLError_LibraryNotFound" in records[0].getMessage()
    assert got == [] and threading.active_count() == before
    assert mon.poll_once() == []
    mon.stop()


def test_pynvml_not_importable(monkeypatch, caplog):
    monkeypatch.delenv("TM_FAKE_NVML", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with caplog.at_level(logging.DEBUG, logger="health"):
        assert NvmlMonitor("n", ["0"], HealthConfig(), Sink()).start() is False
    assert len(caplog.records) == 1 and "pynvml not importable" in caplog.records[0].getMessage()


@pytest.mark.parametrize(
    "gpus, cfg, text",
    [
        (["0"], HealthConfig(nvml=False), "health.nvml is false"),
        ([], HealthConfig(), "no GPU visible"),
    ],
)
def test_off_by_config_or_no_gpu(gpus, cfg, text, caplog):
    fake = FakeNvml({"gpus": 1})
    with caplog.at_level(logging.DEBUG, logger="health"):
        assert NvmlMonitor("n", gpus, cfg, Sink(), nvml=fake).start() is False
    assert len(caplog.records) == 1 and text in caplog.records[0].getMessage()
    assert fake.calls == {}


def test_init_error_is_one_info_line(caplog):
    fake = FakeNvml({"events": [{"at": 0, "call": "nvmlInit", "raise": "NVMLError_DriverNotLoaded"}]})
    got = Sink()
    with caplog.at_level(logging.DEBUG, logger="health"):
        assert NvmlMonitor("n", ["0"], HealthConfig(), got, nvml=fake).start() is False
    assert len(caplog.records) == 1 and "NVMLError_DriverNotLoaded" in caplog.records[0].getMessage()
    assert got == []


def test_hung_poll_is_fatal_and_monitor_stops_touching_nvml(monitors):
    fake = FakeNvml({"gpus": 2, "events": [{"at": 0.2, "gpu": 1, "hang": 5, "call": "nvmlDeviceGetCurrentClocksEventReasons"}]})
    got = Sink()
    mon = NvmlMonitor("n", ["0", "1"], HealthConfig(**{**REALTIME, "nvml_timeout": 0.3}), got, nvml=fake)
    monitors.append((mon, fake))
    assert mon.start()
    assert wait_for(lambda: got)
    assert got.triples() == [("nvml_hang", FATAL, "nvmlDeviceGetCurrentClocksEventReasons")]
    assert got[0].gpu == 1 and "did not return within 0.3 s" in got[0].message
    assert mon.wedged and mon.poll_once() == []
    calls = dict(fake.calls)
    time.sleep(0.3)
    assert fake.calls.get("nvmlDeviceGetFieldValues") == calls.get("nvmlDeviceGetFieldValues")
    t0 = time.monotonic()
    mon.stop()
    assert time.monotonic() - t0 < 1.0
    assert "nvmlShutdown" not in fake.calls  # never call into a hung library


def test_hung_event_wait_is_fatal(monitors):
    fake = FakeNvml({"gpus": 1, "events": [{"at": 0.2, "hang": 5, "call": "nvmlEventSetWait_v2"}]})
    got = Sink()
    cfg = HealthConfig(**{**REALTIME, "nvml_timeout": 0.3})
    mon = NvmlMonitor("n", ["0"], cfg, got, nvml=fake)
    monitors.append((mon, fake))
    assert mon.start()
    assert wait_for(lambda: got)
    assert got.triples() == [("nvml_hang", FATAL, "nvmlEventSetWait_v2")]
    assert got[0].gpu is None


def test_hung_start_is_fatal(monitors):
    fake = FakeNvml({"gpus": 1, "events": [{"at": 0, "gpu": 0, "hang": 5, "call": "nvmlDeviceGetHandleByIndex"}]})
    got = Sink()
    mon = NvmlMonitor("n", ["0"], HealthConfig(nvml_start_timeout=0.3), got, nvml=fake)
    monitors.append((mon, fake))
    assert mon.start() is True  # NVML is there, and it raised an alarm
    assert got.triples() == [("nvml_hang", FATAL, "nvmlDeviceGetHandleByIndex")]
    assert mon.wedged and mon.poll_once() == []


def test_gpu_lost_in_event_wait(monitors):
    fake = FakeNvml({"gpus": 1, "events": [{"at": 0.2, "call": "nvmlEventSetWait_v2", "raise": "NVMLError_GpuIsLost"}]})
    got = Sink()
    mon = NvmlMonitor("n", ["0"], HealthConfig(**REALTIME), got, nvml=fake)
    monitors.append((mon, fake))
    assert mon.start()
    assert wait_for(lambda: got)
    assert got.triples() == [("gpu_lost", FATAL, "nvmlEventSetWait_v2")] and got[0].gpu is None


def test_stop_releases_nvml_and_is_idempotent():
    fake = FakeNvml({"gpus": 2})
    mon = NvmlMonitor("n", ["0", "1"], HealthConfig(**REALTIME), Sink(), nvml=fake)
    assert mon.start()
    time.sleep(0.25)
    assert fake.calls["nvmlDeviceGetFieldValues"] >= 4  # baseline + a few polls
    mon.stop()
    mon.stop()
    assert fake.calls["nvmlEventSetFree"] == 1 and fake.calls["nvmlShutdown"] == 1
    assert not mon.started


def test_callback_errors_do_not_stop_the_monitor(monitors):
    fake = FakeNvml({"gpus": 1, "events": [{"at": 0.1, "gpu": 0, "xid": 13}, {"at": 0.2, "gpu": 0, "xid": 79}]})
    seen = []

    def bad(alarm):
        seen.append(alarm)
        raise RuntimeError("planner down")

    mon = NvmlMonitor("n", ["0"], HealthConfig(**REALTIME), bad, nvml=fake)
    monitors.append((mon, fake))
    assert mon.start()
    assert wait_for(lambda: len(seen) == 2)
    assert [a.value for a in seen] == [13, 79]


# ------------------------------------------------------------- controlled clock, poll_once
def controlled(spec, gpus=("0",), **cfg_kw):
    clock = Clock()
    fake = FakeNvml(spec, clock=clock)
    got = Sink()
    cfg = HealthConfig(**{"poll_interval": 3600.0, "event_wait_ms": 20, **cfg_kw})
    mon = NvmlMonitor("n", list(gpus), cfg, got, nvml=fake)
    return mon, fake, clock, got


@pytest.mark.parametrize(
    "init, change, polls, expected",
    [
        ({}, {}, 2, []),
        ({}, {"recovery_action": "GPU_RESET"}, 1, [("recovery_action", FATAL, 1)]),
        ({}, {"recovery_action": "NODE_REBOOT"}, 1, [("recovery_action", FATAL, 2)]),
        ({}, {"recovery_action": "DRAIN_P2P"}, 1, [("recovery_action", DEGRADED, 3)]),
        ({"nvlinks": 2}, {"recovery_action": "DRAIN_P2P"}, 1, [("recovery_action", FATAL, 3)]),
        ({}, {"field": "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", "value": 4}, 1, [("recovery_action", FATAL, 4)]),
        ({}, {"field": "NVML_FI_DEV_ECC_DBE_VOL_TOTAL", "value": 2}, 1, [("ecc_dbe", FATAL, 2)]),
        ({}, {"ecc_dbe": 1}, 3, [("ecc_dbe", FATAL, 1)]),  # latched: once
        ({}, {"remap_pending": True}, 1, [("remap_pending", DEGRADED, True)]),
        ({}, {"remap_failure": True}, 1, [("remap_failure", FATAL, True)]),
        ({}, {"clocks": ["HwSlowdown"]}, 2, []),
        ({}, {"clocks": ["HwSlowdown"]}, 3, [("clocks", DEGRADED, ["HwSlowdown"])]),
        ({}, {"clocks": ["HwPowerBrakeSlowdown"]}, 5, [("clocks", DEGRADED, ["HwPowerBrakeSlowdown"])]),
        ({}, {"clocks": ["SwThermalSlowdown"]}, 2, [("clocks_sw_thermal", INFO, ["SwThermalSlowdown"])]),
        ({}, {"clocks": ["SwPowerCap"]}, 3, []),
        ({}, {"temperature": 88}, 1, [("temperature", DEGRADED, 88)]),
        ({}, {"temperature": 90}, 1, [("temperature", FATAL, 90)]),
        ({"temp_slowdown": None, "temp_shutdown": None}, {"temperature": 120}, 1, []),
        ({"nvlinks": 4}, {"nvlink_down": [1, 2]}, 1, [("nvlink_down", FATAL, [1, 2])]),
        ({"nvlinks": 2}, {"nvlink_errors": {"replay": 3}}, 1, [("nvlink_errors", INFO, {"replay": 3})]),
        ({}, {"pcie_replay": 100}, 1, [("pcie_replay", DEGRADED, 100.0)]),
        ({}, {"pcie_width": 8}, 1, [("pcie_width", DEGRADED, 8)]),
        ({}, {"raise": "NVMLError_GpuIsLost"}, 3, [("gpu_lost", FATAL, "nvmlDeviceGetFieldValues")]),
        (
            {},
            {"raise": "NVMLError_ResetRequired", "call": "nvmlDeviceGetRemappedRows"},
            1,
            [("reset_required", FATAL, "nvmlDeviceGetRemappedRows")],
        ),
        ({}, {"raise": "NVMLError_GpuNotFound"}, 1, [("gpu_lost", FATAL, "nvmlDeviceGetFieldValues")]),
        (
            {},
            {"raise": "NVMLError_Unknown", "call": "nvmlDeviceGetRemappedRows"},
            3,
            [
                ("nvml_error", INFO, "nvmlDeviceGetRemappedRows: NVMLError_Unknown"),
                ("nvml_error", DEGRADED, "nvmlDeviceGetRemappedRows: NVMLError_Unknown"),
            ],
        ),
        ({}, {"raise": "NVMLError_NotSupported", "call": "nvmlDeviceGetPcieReplayCounter"}, 1, []),
    ],
)
def test_monitor_signal_table(init, change, polls, expected, monitors):
    events = [{"at": 1, "gpu": 0, **change}] if change else []
    mon, fake, clock, got = controlled({"gpus": [init], "events": events})
    monitors.append((mon, fake))
    assert mon.start()
    assert got == []  # a healthy baseline raises nothing
    clock.t = 1.0
    returned = []
    for _ in range(polls):
        returned += mon.poll_once()
    assert got.triples() == expected
    assert returned == list(got)
    assert all(a.gpu == 0 and a.node == "n" for a in got)


def test_not_supported_readings_are_skipped_quietly(monitors):
    mon, fake, clock, got = controlled(
        {
            "gpus": 1,
            "events": [
                {"at": 0, "gpu": 0, "raise": "NVMLError_NotSupported", "call": "nvmlDeviceGetPcieReplayCounter"},
                {"at": 0, "gpu": 0, "field": "NVML_FI_DEV_ECC_DBE_VOL_TOTAL", "value": None},
                {"at": 0, "gpu": 0, "raise": "NVMLError_FunctionNotFound", "call": "nvmlDeviceGetTemperatureV"},
                {"at": 1, "gpu": 0, "temperature": 89, "pcie_replay": 999, "field": "NVML_FI_DEV_ECC_DBE_VOL_TOTAL", "value": 3},
            ],
        }
    )
    monitors.append((mon, fake))
    assert mon.start()
    clock.t = 1
    mon.poll_once()
    before = fake.calls.get("nvmlDeviceGetPcieReplayCounter")
    mon.poll_once()
    # temperature fell back to the deprecated call; the replay counter is no longer asked;
    # ECC stays unwatched (unsupported at start-up: no reference)
    assert got.triples() == [("temperature", DEGRADED, 89)]
    assert fake.calls.get("nvmlDeviceGetPcieReplayCounter") == before == 1
    assert fake.calls["nvmlDeviceGetTemperature"] >= 2


def test_baseline_separates_old_faults_from_new(monitors):
    mon, fake, clock, got = controlled(
        {
            "gpus": [{"ecc_dbe": 5, "remap_pending": True, "recovery_action": "GPU_RESET", "nvlinks": 3, "pcie_width": 8}],
            "events": [{"at": 0, "gpu": 0, "nvlink_down": 2}, {"at": 2, "gpu": 0, "ecc_dbe": 6}],
        }
    )
    monitors.append((mon, fake))
    assert mon.start()
    assert got.triples() == [
        ("recovery_action", DEGRADED, 1),
        ("remap_pending", INFO, True),
        ("nvlink_down", INFO, [2]),
        ("pcie_width", INFO, 8),
    ]
    got.clear()
    clock.t = 1
    assert mon.poll_once() == []  # old faults are not raised again
    clock.t = 2
    assert [(a.signal, a.severity, a.value) for a in mon.poll_once()] == [("ecc_dbe", FATAL, 1)]


def test_xid_classes_through_the_event_thread(monitors):
    mon, fake, clock, got = controlled(
        {"gpus": 2, "events": [{"at": 1, "gpu": 0, "xid": [13, 13, 13]}, {"at": 1, "gpu": 1, "xid": [45, 999, 63]}]}, gpus=("0", "1")
    )
    monitors.append((mon, fake))
    assert mon.start()
    clock.t = 1
    assert wait_for(lambda: len(got) >= 4)
    time.sleep(0.1)
    by_gpu = {g: [(a.signal, a.severity, a.value) for a in got if a.gpu == g] for g in (0, 1)}
    assert by_gpu[0] == [("xid", INFO, 13), ("xid", DEGRADED, 13)]  # 3rd repeat escalates
    assert by_gpu[1] == [("xid", INFO, 999), ("xid", DEGRADED, 63)]  # 45 ignored
    assert "(3 within 300 s)" in got[1].message


def test_xid_triggers_an_early_poll(monitors):
    mon, fake, clock, got = controlled({"gpus": 1, "events": [{"at": 1, "gpu": 0, "xid": 154, "recovery_action": "GPU_RESET"}]})
    monitors.append((mon, fake))
    assert mon.start()
    clock.t = 1
    assert wait_for(lambda: len(got) >= 2, timeout=3)  # poll_interval is an hour
    assert got.triples() == [("xid", INFO, 154), ("recovery_action", FATAL, 1)]


def test_uuids_prefixes_and_shared_gpus(monitors):
    spec = {"gpus": 3, "events": [{"at": 1, "gpu": 1, "temperature": 88}, {"at": 1, "gpu": 2, "temperature": 88}]}
    mon, fake, clock, got = controlled(spec, gpus=("GPU-00000001-fa4e-4000-8000-000000000001", "GPU-00000002", "2", "GPU-ffff"))
    monitors.append((mon, fake))
    assert mon.start()
    # the unknown UUID is reported once and not watched
    assert got.triples() == [("nvml_error", INFO, "lookup: Not Found")]
    assert got[0].gpu == 3
    got.clear()
    clock.t = 1
    mon.poll_once()
    assert [(a.gpu, a.signal) for a in got] == [(0, "temperature"), (1, "temperature")]
    assert "NVML 1" in got[0].message and "local rank 0" in got[0].message
    assert "NVML 2" in got[1].message and "local ranks 1,2" in got[1].message


@pytest.mark.parametrize(
    "nproc, cvd, expected",
    [
        (2, None, ["0", "1"]),
        (0, None, []),
        (2, "", []),
        (2, "3,1", ["3", "1"]),
        (3, " 3 , 1 ", ["3", "1", "3"]),  # fewer devices than ranks: shared
        (2, "GPU-abc,MIG-def", ["GPU-abc", "MIG-def"]),
        (3, "0,-1,2", ["0", "0", "0"]),  # CUDA stops at the first invalid entry
        (2, "2,foo,3", ["2", "2"]),
        (2, "-1", []),
        (1, "07", ["7"]),
    ],
)
def test_gpus_for_local_ranks(nproc, cvd, expected):
    assert gpus_for_local_ranks(nproc, cvd) == expected


# ---------------------------------------------------------------------- python -m health
def test_main_bench_with_fake(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TM_FAKE_NVML", write(tmp_path, "gpus: 4\ninit: {nvlinks: 18}\n"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert health_main.main(["--bench", "20"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["gpus"] == 4 and out["polls"] == 20 and out["cpu_ms_per_poll"] > 0
    assert out["start_ms"] > 0 and len(out["unsupported"]) == 4


def test_hung_init_names_the_call(monitors):
    fake = FakeNvml({"gpus": 1, "events": [{"at": 0, "hang": 5, "call": "nvmlInit"}]})
    got = Sink()
    mon = NvmlMonitor("n", ["0"], HealthConfig(nvml_start_timeout=0.2), got, nvml=fake)
    monitors.append((mon, fake))
    assert mon.start() is True
    assert got.triples() == [("nvml_hang", FATAL, "nvmlInit")] and got[0].gpu is None
    assert mon.start() is True and len(got) == 1  # never retried


def test_a_process_computing_on_its_gpu_is_seen_at_each_poll_and_only_while_it_computes(tmp_path, monkeypatch, monitors):
    """The progress evidence NVML gives (``NvmlMonitor.gpu_activity``, read by the agent's
    progress probe): a pid with SM samples at the last poll; none once it stops, and none when
    the polls stop answering (a look older than two polls stands for nothing)."""
    pids = tmp_path / "pids"
    path = write(tmp_path, f"gpus: 1\ninit: {{compute_pids_file: {pids}, compute_sm: 85}}\n")
    monkeypatch.setenv("TM_FAKE_NVML", path)
    mon = NvmlMonitor("n", ["0"], HealthConfig(**REALTIME), Sink())
    monitors.append((mon, None))
    assert mon.start() is True
    pids.write_text("4242\n")
    assert wait_for(lambda: mon.gpu_activity(4242) == 85.0)
    assert mon.gpu_activity(4243) == 0.0  # a process not on the GPU
    pids.write_text("")
    assert wait_for(lambda: mon.gpu_activity(4242) == 0.0)  # it stopped computing: the next poll says so
    pids.write_text("4242\n")
    assert wait_for(lambda: mon.gpu_activity(4242) == 85.0)
    mon.stop()
    time.sleep(3 * REALTIME["poll_interval"])
    assert mon.gpu_activity(4242) == 0.0  # no poll since: no evidence
