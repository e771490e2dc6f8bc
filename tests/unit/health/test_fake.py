"""The scripted fake NVML: pynvml's real classes and structures, a timeline, validation."""

import ctypes
import threading
import time

import pynvml
import pytest

from tests.doubles.fake_nvml import FakeNvml


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def fake(spec, clock=None):
    f = FakeNvml(spec, clock=clock or Clock())
    return f


def test_structures_and_handles_are_pynvml_ones():
    clock = Clock()
    f = fake({"gpus": 2, "events": [{"at": 1, "gpu": 1, "xid": 79}]}, clock)
    f.nvmlInit()
    h = f.nvmlDeviceGetHandleByIndex(1)
    assert isinstance(h, pynvml.c_nvmlDevice_t)
    assert f.nvmlDeviceGetHandleByUUID(f.nvmlDeviceGetUUID(h)) is h
    assert f.nvmlDeviceGetIndex(h) == 1 and f.nvmlDeviceGetCount() == 2
    values = f.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL, pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, 9999])
    assert isinstance(values[0], pynvml.c_nvmlFieldValue_t)
    assert (values[0].nvmlReturn, values[0].valueType, values[0].value.ullVal) == (
        pynvml.NVML_SUCCESS,
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG,
        0,
    )
    assert values[1].valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    assert values[2].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
    es = f.nvmlEventSetCreate()
    assert isinstance(es, pynvml.c_nvmlEventSet_t)
    f.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
    with pytest.raises(pynvml.NVMLError_Timeout):
        f.nvmlEventSetWait_v2(es, 10)
    clock.t = 1.0
    data = f.nvmlEventSetWait_v2(es, 10)
    assert isinstance(data, pynvml.c_nvmlEventData_t)
    assert data.eventType == pynvml.nvmlEventTypeXidCriticalError and data.eventData == 79
    assert ctypes.cast(data.device, ctypes.c_void_p).value == ctypes.cast(h, ctypes.c_void_p).value
    f.nvmlEventSetFree(es)
    f.nvmlShutdown()


def test_uninitialized_and_constants_and_unimplemented():
    f = fake({"gpus": 1})
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        f.nvmlDeviceGetCount()
    assert f.NVML_FI_DEV_ECC_DBE_VOL_TOTAL == 4
    assert f.NVMLError_GpuIsLost is pynvml.NVMLError_GpuIsLost
    assert f.c_nvmlEventData_t is pynvml.c_nvmlEventData_t
    with pytest.raises(AttributeError, match="does not implement pynvml.nvmlDeviceGetPowerUsage"):
        f.nvmlDeviceGetPowerUsage


def test_spec_example_timeline():
    clock = Clock()
    f = fake(
        {
            "gpus": 1,
            "events": [
                {"at": 5.0, "gpu": 0, "xid": 79},
                {"at": 6.0, "gpu": 0, "field": "NVML_FI_DEV_ECC_DBE_VOL_TOTAL", "value": 1},
                {"at": 7.0, "gpu": 0, "raise": "NVMLError_GpuIsLost"},
            ],
        },
        clock,
    )
    f.nvmlInit()
    h = f.nvmlDeviceGetHandleByIndex(0)
    dbe = [pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL]
    clock.t = 5.9
    assert f.nvmlDeviceGetFieldValues(h, dbe)[0].value.ullVal == 0
    clock.t = 6.0
    assert f.nvmlDeviceGetFieldValues(h, dbe)[0].value.ullVal == 1
    clock.t = 7.0
    for _ in range(3):  # persistent: a lost GPU stays lost
        with pytest.raises(pynvml.NVMLError_GpuIsLost) as e:
            f.nvmlDeviceGetTemperatureV(h, pynvml.NVML_TEMPERATURE_GPU)
        assert isinstance(e.value, pynvml.NVMLError) and e.value.value == pynvml.NVML_ERROR_GPU_IS_LOST
    f.nvmlDeviceGetCount()  # device-less calls are not affected by a per-GPU rule


def test_raise_forms_call_count_and_clear():
    clock = Clock()
    f = fake(
        {
            "gpus": 2,
            "events": [
                {"at": 1, "gpu": 0, "raise": "NVML_ERROR_UNKNOWN", "call": "nvmlDeviceGetRemappedRows", "count": 2},
                {"at": 1, "gpu": 1, "raise": 3},
                {"at": 2, "gpu": 1, "raise": None},
                {"at": 3, "raise": "NVMLError_DriverNotLoaded"},
            ],
        },
        clock,
    )
    f.nvmlInit()
    h0, h1 = f.nvmlDeviceGetHandleByIndex(0), f.nvmlDeviceGetHandleByIndex(1)
    clock.t = 1
    f.nvmlDeviceGetPcieReplayCounter(h0)  # other calls fine
    for _ in range(2):
        with pytest.raises(pynvml.NVMLError_Unknown):
            f.nvmlDeviceGetRemappedRows(h0)
    assert f.nvmlDeviceGetRemappedRows(h0) == (0, 0, 0, 0)  # count used up
    with pytest.raises(pynvml.NVMLError_NotSupported):
        f.nvmlDeviceGetPcieReplayCounter(h1)
    clock.t = 2
    assert f.nvmlDeviceGetPcieReplayCounter(h1) == 0  # cleared
    clock.t = 3
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):  # no gpu: every call
        f.nvmlDeviceGetCount()


def test_hang_blocks_once_and_release():
    clock = Clock()
    f = fake(
        {
            "gpus": 1,
            "events": [
                {"at": 0, "gpu": 0, "hang": 0.2, "call": "nvmlDeviceGetCurrPcieLinkWidth"},
                {"at": 0, "gpu": 0, "hang": 30, "call": "nvmlDeviceGetMaxPcieLinkWidth"},
            ],
        },
        clock,
    )
    f.nvmlInit()
    h = f.nvmlDeviceGetHandleByIndex(0)
    t0 = time.monotonic()
    assert f.nvmlDeviceGetCurrPcieLinkWidth(h) == 16
    assert 0.18 < time.monotonic() - t0 < 1.0
    t0 = time.monotonic()
    f.nvmlDeviceGetCurrPcieLinkWidth(h)
    assert time.monotonic() - t0 < 0.1  # count 1 by default
    threading.Timer(0.1, f.release).start()
    t0 = time.monotonic()
    f.nvmlDeviceGetMaxPcieLinkWidth(h)
    assert time.monotonic() - t0 < 2.0


def test_state_keys():
    clock = Clock()
    f = fake(
        {
            "gpus": [{"nvlinks": 4, "uuid": "GPU-abc"}, {}],
            "init": {"temperature": 50},
            "events": [
                {
                    "at": 1,
                    "gpu": "all",
                    "temperature": 91,
                    "clocks": ["HwSlowdown", "SwPowerCap"],
                    "recovery_action": "drain_p2p",
                    "ecc_dbe": 2,
                    "remap_pending": True,
                    "remap_failure": 1,
                    "remap_corr": 3,
                    "remap_unc": 4,
                    "pcie_replay": 7,
                    "pcie_width": 8,
                    "pcie_max_width": 16,
                    "temp_slowdown": 80,
                    "temp_shutdown": None,
                },
                {"at": 1, "gpu": 0, "nvlink_down": [1, 3], "nvlink_errors": {"replay": 5, "crc_flit": 1}},
            ],
        },
        clock,
    )
    f.nvmlInit()
    h0, h1 = f.nvmlDeviceGetHandleByIndex(0), f.nvmlDeviceGetHandleByIndex(1)
    assert f.nvmlDeviceGetUUID(h0) == "GPU-abc"
    assert f.nvmlDeviceGetTemperatureV(h1, pynvml.NVML_TEMPERATURE_GPU) == 50
    assert [f.nvmlDeviceGetNvLinkState(h0, i) for i in range(4)] == [1, 1, 1, 1]
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        f.nvmlDeviceGetNvLinkState(h0, 4)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        f.nvmlDeviceGetNvLinkState(h1, 0)
    clock.t = 1
    for h in (h0, h1):
        assert f.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU) == 91
        assert (
            f.nvmlDeviceGetCurrentClocksEventReasons(h) == pynvml.nvmlClocksEventReasonHwSlowdown | pynvml.nvmlClocksEventReasonSwPowerCap
        )
        vals = f.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL])
        assert (vals[0].value.uiVal, vals[1].value.ullVal) == (pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_P2P, 2)
        assert f.nvmlDeviceGetRemappedRows(h) == (3, 4, 1, 1)
        assert f.nvmlDeviceGetPcieReplayCounter(h) == 7
        assert (f.nvmlDeviceGetCurrPcieLinkWidth(h), f.nvmlDeviceGetMaxPcieLinkWidth(h)) == (8, 16)
        assert f.nvmlDeviceGetTemperatureThreshold(h, pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN) == 80
        with pytest.raises(pynvml.NVMLError_NotSupported):
            f.nvmlDeviceGetTemperatureThreshold(h, pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN)
    assert [f.nvmlDeviceGetNvLinkState(h0, i) for i in range(4)] == [1, 0, 1, 0]
    vals = f.nvmlDeviceGetFieldValues(
        h0, [pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL, pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL]
    )
    assert [v.value.ullVal for v in vals] == [5, 1]
    vals = f.nvmlDeviceGetFieldValues(h1, [pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL])
    assert vals[0].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED  # no NVLink on GPU 1


@pytest.mark.parametrize(
    "spec, message",
    [
        ([], "expected a mapping with gpus and events"),
        ({"gpu": 1}, r"unknown top-level key\(s\) \['gpu'\]"),
        ({"gpus": "two"}, "gpus: expected a count or a list of mappings"),
        ({"init": {"temp": 3}}, "init: unknown key 'temp'"),
        ({"events": [{"at": 1, "gpu": 0, "xid": 79, "foo": 1}]}, r"events\[0\]: unknown key\(s\) \['foo'\]"),
        ({"events": [{"at": -1, "xid": 79}]}, r"events\[0\]: at: expected seconds >= 0"),
        ({"events": [{"at": 1}]}, r"events\[0\]: nothing to do"),
        ({"events": [{"gpu": 3, "xid": 79}]}, r"events\[0\]: gpu: expected 0..0 or 'all', got 3"),
        ({"events": [{"xid": "79"}]}, "xid: expected an integer"),
        ({"events": [{"field": "NVML_FI_NOPE", "value": 1}]}, "unknown field 'NVML_FI_NOPE'"),
        ({"events": [{"field": 4}]}, "field needs a value"),
        ({"events": [{"value": 4}]}, "value without field"),
        ({"events": [{"raise": "GpuIsLost"}]}, "unknown pynvml error 'GpuIsLost'"),
        ({"events": [{"raise": 4242}]}, "unknown NVML error code 4242"),
        ({"events": [{"hang": 0}]}, "hang: expected seconds > 0"),
        ({"events": [{"hang": 1, "call": "nvmlDeviceGetPowerUsage"}]}, "is not a function the fake"),
        ({"events": [{"xid": 1, "call": "nvmlInit"}]}, "call/count only go with raise or hang"),
        ({"events": [{"raise": "NVMLError_Unknown", "count": 0}]}, "count: expected an integer >= 1"),
        ({"events": [{"clocks": ["HwSlow"]}]}, "unknown clock event reason 'HwSlow'"),
        ({"events": [{"recovery_action": "REBOOT"}]}, "unknown recovery action 'REBOOT'"),
        ({"events": [{"nvlink_down": 0}]}, "GPU 0 has no link 0"),
        ({"gpus": [{"nvlinks": 2}], "events": [{"nvlink_down": 2}]}, "GPU 0 has no link 2"),
        ({"events": [{"nvlink_errors": {"bogus": 1}}]}, "expected a mapping of crc_flit"),
        ({"events": [{"temperature": "hot"}]}, "temperature: expected an integer >= 0"),
    ],
)
def test_validation(spec, message):
    with pytest.raises(ValueError, match=message):
        FakeNvml(spec, source="t.yaml")


def test_from_file_yaml_and_json(tmp_path):
    y = tmp_path / "t.yaml"
    y.write_text("gpus: 1\nevents:\n  - {at: 0, gpu: 0, temperature: 70}\n")
    j = tmp_path / "t.json"
    j.write_text('{"gpus": 1, "events": [{"at": 0, "gpu": 0, "temperature": 71}]}')
    for path, temp in ((y, 70), (j, 71)):
        f = FakeNvml.from_file(str(path))
        f.nvmlInit()
        h = f.nvmlDeviceGetHandleByIndex(0)
        assert f.nvmlDeviceGetTemperatureV(h, pynvml.NVML_TEMPERATURE_GPU) == temp
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpus: 1\nevents: [{at: 1, xid: 79, gpu: 5}]\n")
    with pytest.raises(ValueError, match=r"bad.yaml: events\[0\]: gpu"):
        FakeNvml.from_file(str(bad))


def test_init_error_and_shutdown():
    f = fake({"events": [{"at": 0, "call": "nvmlInit", "raise": "NVMLError_LibraryNotFound"}]})
    with pytest.raises(pynvml.NVMLError_LibraryNotFound):
        f.nvmlInit()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        f.nvmlDeviceGetCount()
    g = fake({"gpus": 1})
    g.nvmlInit()
    g.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        g.nvmlDeviceGetCount()


def test_event_wait_wakes_on_a_timed_xid_in_real_time():
    f = FakeNvml({"gpus": 1, "events": [{"at": 0.15, "gpu": 0, "xid": 48}]})
    f.nvmlInit()
    es = f.nvmlEventSetCreate()
    f.nvmlDeviceRegisterEvents(f.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlEventTypeXidCriticalError, es)
    t0 = time.monotonic()
    data = f.nvmlEventSetWait_v2(es, 5000)
    assert data.eventData == 48 and 0.1 < time.monotonic() - t0 < 1.0


def test_format_md_documents_every_key():
    import dataclasses
    import pathlib
    import re

    from health.config import HealthConfig
    from tests.doubles.fake_nvml import EVENT_KEYS, STATE_KEYS

    text = (pathlib.Path(__file__).resolve().parents[3] / "health" / "FORMAT.md").read_text()
    documented = set(re.findall(r"`([a-z_]+)`", text))
    for key in [f.name for f in dataclasses.fields(HealthConfig)] + list(EVENT_KEYS) + list(STATE_KEYS):
        assert key in documented, key
