"""Table tests of the NVML checks (pure): every reading, every threshold."""

import pynvml
import pytest

from health import checks
from health.alarms import DEGRADED, FATAL, INFO
from health.checks import CheckState, GpuSample, baseline_findings, evaluate
from health.config import HealthConfig

CFG = HealthConfig()


def sample(t=0.0, **kw):
    base = dict(
        recovery_action=0,
        ecc_dbe=0,
        remap_pending=False,
        remap_failure=False,
        clocks=0,
        temperature=40,
        nvlink_state={},
        nvlink_errors={},
        pcie_replay=0,
        pcie_width=16,
    )
    base.update(kw)
    return GpuSample(time=t, **base)


def baseline(**kw):
    kw.setdefault("temp_slowdown", 87)
    kw.setdefault("temp_shutdown", 95)
    kw.setdefault("pcie_max_width", 16)
    return sample(**kw)


def found(findings):
    return [(f.signal, f.severity, f.value) for f in findings]


def test_constants_match_pynvml():
    for value, name in checks.RECOVERY_NAMES.items():
        assert getattr(pynvml, f"NVML_GPU_RECOVERY_ACTION_{name}") == value
    for name, bit in checks.CLOCK_REASONS.items():
        assert getattr(pynvml, f"nvmlClocksEventReason{name}") == bit


# --- recovery action ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "action, links, expected",
    [
        (None, {}, []),
        (0, {}, []),
        (1, {}, [("recovery_action", FATAL, 1)]),  # GPU_RESET
        (2, {}, [("recovery_action", FATAL, 2)]),  # NODE_REBOOT
        (3, {}, [("recovery_action", DEGRADED, 3)]),  # DRAIN_P2P, no NVLink
        (3, {0: 0, 1: 0}, [("recovery_action", DEGRADED, 3)]),  # links exist but none active
        (3, {0: 1, 1: 1}, [("recovery_action", FATAL, 3)]),  # DRAIN_P2P with NVLink in use
        (4, {}, [("recovery_action", FATAL, 4)]),  # DRAIN_AND_RESET
        (5, {}, [("recovery_action", FATAL, 5)]),  # RECOVER_IMEX_DOMAIN
        (6, {}, [("recovery_action", FATAL, 6)]),  # BUS_RESET
        (7, {}, [("recovery_action", FATAL, 7)]),  # SYSTEM_REBOOT
        (42, {}, [("recovery_action", FATAL, 42)]),  # unknown future action
    ],
)
def test_recovery_action(action, links, expected):
    base = baseline(nvlink_state=links)
    assert found(checks.check_recovery_action(base, sample(recovery_action=action), CFG)) == expected


def test_recovery_action_present_at_start_is_old():
    base = baseline(recovery_action=1)
    assert found(baseline_findings(base, CFG)) == [("recovery_action", DEGRADED, 1)]
    assert checks.check_recovery_action(base, sample(recovery_action=1), CFG) == []
    # but a different action later is new
    assert found(checks.check_recovery_action(base, sample(recovery_action=2), CFG)) == [("recovery_action", FATAL, 2)]


# --- ECC -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "base_dbe, cur_dbe, expected",
    [
        (0, 0, []),
        (0, 1, [("ecc_dbe", FATAL, 1)]),
        (5, 5, []),
        (5, 8, [("ecc_dbe", FATAL, 3)]),
        (5, 0, []),  # counter reset (GPU reset): nothing new
        (None, 3, []),
        (0, None, []),
    ],
)
def test_ecc(base_dbe, cur_dbe, expected):
    assert found(checks.check_ecc(baseline(ecc_dbe=base_dbe), sample(ecc_dbe=cur_dbe), CFG)) == expected


# --- row remapping ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "base_kw, cur_kw, expected",
    [
        ({}, {}, []),
        ({}, {"remap_pending": True}, [("remap_pending", DEGRADED, True)]),
        ({}, {"remap_failure": True}, [("remap_failure", FATAL, True)]),
        ({}, {"remap_failure": True, "remap_pending": True}, [("remap_failure", FATAL, True), ("remap_pending", DEGRADED, True)]),
        ({"remap_pending": True}, {"remap_pending": True}, []),
        ({"remap_failure": True}, {"remap_failure": True}, []),
        ({}, {"remap_pending": None, "remap_failure": None}, []),
    ],
)
def test_remap(base_kw, cur_kw, expected):
    assert found(checks.check_remap(baseline(**base_kw), sample(**cur_kw), CFG)) == expected


# --- clocks ----------------------------------------------------------------------------------
HW = checks.CLOCK_REASONS["HwSlowdown"]
HWT = checks.CLOCK_REASONS["HwThermalSlowdown"]
BRAKE = checks.CLOCK_REASONS["HwPowerBrakeSlowdown"]
SWT = checks.CLOCK_REASONS["SwThermalSlowdown"]
SWP = checks.CLOCK_REASONS["SwPowerCap"]
IDLE = checks.CLOCK_REASONS["GpuIdle"]


@pytest.mark.parametrize(
    "masks, expected_last",
    [
        ([HW, HW], []),
        ([HW, HW, HW], [("clocks", DEGRADED, ["HwSlowdown"])]),
        ([HWT, HWT, HWT], [("clocks", DEGRADED, ["HwThermalSlowdown"])]),
        ([BRAKE, BRAKE, BRAKE], [("clocks", DEGRADED, ["HwPowerBrakeSlowdown"])]),
        ([HW, HWT, BRAKE | HW], [("clocks", DEGRADED, ["HwSlowdown", "HwPowerBrakeSlowdown"])]),
        ([HW, 0, HW, HW], []),  # not in a row
        ([HW, HW, HW, HW], [("clocks", DEGRADED, ["HwSlowdown"])]),
        ([SWP, SWP, SWP], []),  # power capping is normal under load
        ([IDLE, IDLE, IDLE], []),
        ([SWP, HW | SWP, HW, HW], [("clocks", DEGRADED, ["HwSlowdown"])]),
    ],
)
def test_clocks_polls_in_a_row(masks, expected_last):
    base, state = baseline(), CheckState()
    for mask in masks:
        out = checks.check_clocks(base, sample(clocks=mask), CFG, state)
    assert found(out) == expected_last


def test_clocks_custom_poll_count_and_unsupported():
    cfg, state = HealthConfig(clock_polls=1), CheckState()
    assert found(checks.check_clocks(baseline(), sample(clocks=HW), cfg, state)) == [("clocks", DEGRADED, ["HwSlowdown"])]
    assert checks.check_clocks(baseline(), sample(clocks=None), cfg, state) == []


def test_sw_thermal_is_info_per_episode():
    base, state = baseline(), CheckState()
    seq = [SWT, SWT, 0, SWT]
    out = [found(checks.check_clocks(base, sample(clocks=m), CFG, state)) for m in seq]
    info = [("clocks_sw_thermal", INFO, ["SwThermalSlowdown"])]
    assert out == [info, [], [], info]


# --- temperature -----------------------------------------------------------------------------
# baseline thresholds: slowdown 87 C, shutdown 95 C; fatal from 95 - 5 = 90 C
@pytest.mark.parametrize(
    "temps, expected",
    [
        ([40], []),
        ([86], []),
        ([86.9], []),
        ([87], [("temperature", DEGRADED, 87)]),  # >= slowdown
        ([89], [("temperature", DEGRADED, 89)]),
        ([90], [("temperature", FATAL, 90)]),  # >= shutdown - margin
        ([99], [("temperature", FATAL, 99)]),
        ([87, 85], [("temperature", DEGRADED, 85)]),  # hysteresis: still hot 2 C below
        ([87, 84], []),  # 3 C below: cool again
        ([87, 84, 86], []),  # re-armed: needs slowdown again
        ([86, 85], []),  # never hot: no hysteresis
        ([91, 85], [("temperature", DEGRADED, 85)]),  # fatal also counts as hot
        ([None], []),
    ],
)
def test_temperature(temps, expected):
    base, state = baseline(), CheckState()
    for t in temps:
        out = checks.check_temperature(base, sample(temperature=t), CFG, state)
    assert found(out) == expected


@pytest.mark.parametrize(
    "cfg_kw, base_kw, temp, expected",
    [
        ({"temp_slowdown": 80}, {}, 80, [("temperature", DEGRADED, 80)]),  # config overrides
        ({"temp_shutdown": 85}, {}, 80, [("temperature", FATAL, 80)]),
        ({"temp_shutdown_margin": 0}, {}, 94, [("temperature", DEGRADED, 94)]),
        ({"temp_shutdown_margin": 0}, {}, 95, [("temperature", FATAL, 95)]),
        ({}, {"temp_slowdown": None, "temp_shutdown": None}, 120, []),  # no thresholds known
        ({}, {"temp_slowdown": None}, 89, []),
        ({}, {"temp_slowdown": None}, 90, [("temperature", FATAL, 90)]),
        ({"temp_slowdown": 70}, {"temp_slowdown": None, "temp_shutdown": None}, 75, [("temperature", DEGRADED, 75)]),
    ],
)
def test_temperature_thresholds(cfg_kw, base_kw, temp, expected):
    cfg = HealthConfig(**cfg_kw)
    out = checks.check_temperature(baseline(**base_kw), sample(temperature=temp), cfg, CheckState())
    assert found(out) == expected


# --- NVLink ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "base_links, cur_links, expected",
    [
        ({0: 1, 1: 1}, {0: 1, 1: 1}, []),
        ({0: 1, 1: 1}, {0: 1, 1: 0}, [("nvlink_down", FATAL, [1])]),
        ({0: 1, 1: 1, 2: 1}, {0: 0, 1: 1, 2: 0}, [("nvlink_down", FATAL, [0, 2])]),
        ({0: 1, 1: 0}, {0: 1, 1: 0}, []),  # down at start-up: not watched
        ({0: 1}, {}, []),  # state not read this poll
    ],
)
def test_nvlink_state(base_links, cur_links, expected):
    out = checks.check_nvlink(baseline(nvlink_state=base_links), None, sample(nvlink_state=cur_links), CFG)
    assert found(out) == expected


@pytest.mark.parametrize(
    "base_err, prev_err, cur_err, expected",
    [
        ({"replay": 0}, None, {"replay": 0}, []),
        ({"replay": 0}, None, {"replay": 4}, [("nvlink_errors", INFO, {"replay": 4})]),
        ({"replay": 0}, {"replay": 4}, {"replay": 4}, []),  # not growing any more
        ({"replay": 0}, {"replay": 4}, {"replay": 6}, [("nvlink_errors", INFO, {"replay": 2})]),
        ({"crc_flit": 1, "recovery": 0}, None, {"crc_flit": 3, "recovery": 1}, [("nvlink_errors", INFO, {"crc_flit": 2, "recovery": 1})]),
        ({"crc_data": 9}, None, {"crc_data": 2}, []),  # reset counter
        ({}, None, {"replay": 5}, []),  # no reference
    ],
)
def test_nvlink_errors(base_err, prev_err, cur_err, expected):
    prev = None if prev_err is None else sample(nvlink_errors=prev_err)
    out = checks.check_nvlink(baseline(nvlink_errors=base_err), prev, sample(nvlink_errors=cur_err), CFG)
    assert found(out) == expected


# --- PCIe ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "series, expected_last",
    [
        ([(5, 0)], []),
        ([(5, 8)], []),  # 8 in the first minute: at the limit
        ([(5, 9)], [("pcie_replay", DEGRADED, 9.0)]),  # more than 8 within a minute
        ([(30, 4), (60, 8), (90, 12)], []),  # 8 per minute, steady
        ([(30, 5), (60, 10), (90, 15)], [("pcie_replay", DEGRADED, 10.0)]),
        ([(60, 20), (120, 20), (180, 20)], []),  # a burst long ago
        ([(120, 30)], [("pcie_replay", DEGRADED, 15.0)]),  # 30 over 2 minutes
        ([(10, None)], []),
    ],
)
def test_pcie_replay_rate(series, expected_last):
    base, state = baseline(t=0.0, pcie_replay=0), CheckState()
    for t, count in series:
        out = checks.check_pcie(base, sample(t=t, pcie_replay=count), CFG, state)
    assert found(out) == expected_last


def test_pcie_replay_custom_limit():
    cfg = HealthConfig(pcie_replay_per_min=100)
    out = checks.check_pcie(baseline(pcie_replay=0), sample(t=10, pcie_replay=50), cfg, CheckState())
    assert out == []


@pytest.mark.parametrize(
    "base_width, max_width, cur_width, expected",
    [
        (16, 16, 16, []),
        (16, 16, 8, [("pcie_width", DEGRADED, 8)]),
        (8, 16, 8, []),  # already narrow at start-up: reported by the baseline only
        (8, 16, 4, []),
        (16, None, 8, []),  # max unknown
        (16, 16, None, []),
    ],
)
def test_pcie_width(base_width, max_width, cur_width, expected):
    base = baseline(pcie_width=base_width, pcie_max_width=max_width)
    out = checks.check_pcie(base, sample(pcie_width=cur_width, pcie_replay=None), CFG, CheckState())
    assert found(out) == expected


# --- baseline ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, expected",
    [
        ({}, []),
        ({"recovery_action": 0}, []),
        ({"recovery_action": 1}, [("recovery_action", DEGRADED, 1)]),
        ({"remap_failure": True}, [("remap_failure", DEGRADED, True)]),
        ({"remap_pending": True}, [("remap_pending", INFO, True)]),
        ({"nvlink_state": {0: 1, 1: 0, 2: 0}}, [("nvlink_down", INFO, [1, 2])]),
        ({"pcie_width": 8}, [("pcie_width", INFO, 8)]),
        ({"ecc_dbe": 12}, []),  # old errors: just the reference
    ],
)
def test_baseline_findings(kw, expected):
    assert found(baseline_findings(baseline(**kw), CFG)) == expected


def test_evaluate_runs_every_check():
    base = baseline(nvlink_state={0: 1}, nvlink_errors={"replay": 0})
    state = CheckState()
    cur = sample(
        t=1,
        recovery_action=1,
        ecc_dbe=2,
        remap_pending=True,
        clocks=HW,
        temperature=88,
        nvlink_state={0: 0},
        nvlink_errors={"replay": 1},
        pcie_replay=50,
        pcie_width=4,
    )
    cfg = HealthConfig(clock_polls=1)
    assert [f.signal for f in evaluate(base, None, cur, cfg, state)] == [
        "recovery_action",
        "ecc_dbe",
        "remap_pending",
        "clocks",
        "temperature",
        "nvlink_down",
        "nvlink_errors",
        "pcie_replay",
        "pcie_width",
    ]
    healthy = sample(t=2, nvlink_state={0: 1}, nvlink_errors={"replay": 0})
    assert evaluate(base, None, healthy, cfg, CheckState()) == []
