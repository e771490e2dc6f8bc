"""The NVML checks table (pure): readings in, findings out.

A ``GpuSample`` holds one poll's readings of one GPU (None: not supported / not read).  The
first sample, taken at start-up, is the baseline: faults already present then are reported
once by ``baseline_findings`` and are not raised again by ``evaluate``.

Degraded and fatal findings are level-triggered (re-reported every poll while the condition
holds; ``AlarmFilter`` latches them).  Info findings are edge-triggered (one per occurrence),
so that ``AlarmFilter`` can escalate an info event that keeps happening.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from .alarms import DEGRADED, FATAL, INFO

# Same values as pynvml's NVML_GPU_RECOVERY_ACTION_* (checked by the tests).
RECOVERY_NONE = 0
RECOVERY_GPU_RESET = 1
RECOVERY_NODE_REBOOT = 2
RECOVERY_DRAIN_P2P = 3
RECOVERY_DRAIN_AND_RESET = 4
RECOVERY_RECOVER_IMEX_DOMAIN = 5
RECOVERY_BUS_RESET = 6
RECOVERY_SYSTEM_REBOOT = 7
RECOVERY_NAMES = {
    RECOVERY_NONE: "NONE",
    RECOVERY_GPU_RESET: "GPU_RESET",
    RECOVERY_NODE_REBOOT: "NODE_REBOOT",
    RECOVERY_DRAIN_P2P: "DRAIN_P2P",
    RECOVERY_DRAIN_AND_RESET: "DRAIN_AND_RESET",
    RECOVERY_RECOVER_IMEX_DOMAIN: "RECOVER_IMEX_DOMAIN",
    RECOVERY_BUS_RESET: "BUS_RESET",
    RECOVERY_SYSTEM_REBOOT: "SYSTEM_REBOOT",
}

# Same values as pynvml's nvmlClocksEventReason* (checked by the tests).
CLOCK_REASONS = {
    "GpuIdle": 0x1,
    "ApplicationsClocksSetting": 0x2,
    "SwPowerCap": 0x4,
    "HwSlowdown": 0x8,
    "SyncBoost": 0x10,
    "SwThermalSlowdown": 0x20,
    "HwThermalSlowdown": 0x40,
    "HwPowerBrakeSlowdown": 0x80,
    "DisplayClockSetting": 0x100,
}
CLOCKS_HW_MASK = CLOCK_REASONS["HwSlowdown"] | CLOCK_REASONS["HwThermalSlowdown"] | CLOCK_REASONS["HwPowerBrakeSlowdown"]
CLOCKS_SW_THERMAL = CLOCK_REASONS["SwThermalSlowdown"]

PCIE_REPLAY_WINDOW = 60.0  # seconds: replays are counted per minute, as DCGM does


def clock_reason_names(mask: int) -> list[str]:
    return [name for name, bit in CLOCK_REASONS.items() if mask & bit]


@dataclass
class GpuSample:
    time: float  # monotonic seconds of the reading
    recovery_action: int | None = None  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
    ecc_dbe: int | None = None  # NVML_FI_DEV_ECC_DBE_VOL_TOTAL
    remap_pending: bool | None = None  # nvmlDeviceGetRemappedRows
    remap_failure: bool | None = None
    clocks: int | None = None  # nvmlDeviceGetCurrentClocksEventReasons mask
    temperature: float | None = None  # nvmlDeviceGetTemperatureV, C
    nvlink_state: dict[int, int] = field(default_factory=dict)  # link -> 1 active / 0 not
    nvlink_errors: dict[str, int] = field(default_factory=dict)  # counter -> total, all links
    pcie_replay: int | None = None  # nvmlDeviceGetPcieReplayCounter
    pcie_width: int | None = None  # current PCIe link width
    # read at start-up only (baseline)
    temp_slowdown: float | None = None
    temp_shutdown: float | None = None
    pcie_max_width: int | None = None


@dataclass(frozen=True)
class Finding:
    signal: str
    severity: str
    value: object
    message: str


@dataclass
class CheckState:
    """What the checks remember between polls of one GPU."""

    clock_run: int = 0  # consecutive polls with a HW slowdown reason
    sw_thermal: bool = False  # SW thermal slowdown active at the previous poll
    temp_hot: bool = False  # hysteresis of the temperature check
    pcie_history: collections.deque = field(default_factory=collections.deque)


def nvlink_used(base: GpuSample) -> bool:
    return any(state == 1 for state in base.nvlink_state.values())


# ---------------------------------------------------------------------------------------
def baseline_findings(base: GpuSample, cfg) -> list[Finding]:
    """Faults already present at start-up.  Mostly info; a GPU that already needs a reset
    (recovery action) or has a row-remapping failure is degraded: replace it when a spare
    exists, but do not kill a job that chose to start on it."""
    out = []
    if base.recovery_action not in (None, RECOVERY_NONE):
        name = RECOVERY_NAMES.get(base.recovery_action, str(base.recovery_action))
        out.append(Finding("recovery_action", DEGRADED, base.recovery_action, f"recovery action {name} already set at start-up"))
    if base.remap_failure:
        out.append(Finding("remap_failure", DEGRADED, True, "row-remapping failure already recorded at start-up"))
    if base.remap_pending:
        out.append(Finding("remap_pending", INFO, True, "row remapping already pending a reset at start-up"))
    down = sorted(link for link, state in base.nvlink_state.items() if state == 0)
    if down:
        out.append(Finding("nvlink_down", INFO, down, f"NVLink link(s) {down} inactive at start-up (not watched)"))
    if base.pcie_width is not None and base.pcie_max_width and base.pcie_width < base.pcie_max_width:
        out.append(
            Finding("pcie_width", INFO, base.pcie_width, f"PCIe link width x{base.pcie_width} below max x{base.pcie_max_width} at start-up")
        )
    return out


def check_recovery_action(base: GpuSample, cur: GpuSample, cfg) -> list[Finding]:
    action = cur.recovery_action
    if action is None or action == RECOVERY_NONE or action == base.recovery_action:
        return []
    name = RECOVERY_NAMES.get(action, str(action))
    if action == RECOVERY_DRAIN_P2P and not nvlink_used(base):
        return [Finding("recovery_action", DEGRADED, action, f"recovery action {name} (no NVLink in use: drain at the next switch)")]
    return [Finding("recovery_action", FATAL, action, f"recovery action {name}")]


def check_ecc(base: GpuSample, cur: GpuSample, cfg) -> list[Finding]:
    if cur.ecc_dbe is None or base.ecc_dbe is None:
        return []
    delta = cur.ecc_dbe - base.ecc_dbe
    if delta > 0:
        return [Finding("ecc_dbe", FATAL, delta, f"{delta} new uncorrected (double-bit) volatile ECC error(s)")]
    return []


def check_remap(base: GpuSample, cur: GpuSample, cfg) -> list[Finding]:
    out = []
    if cur.remap_failure and not base.remap_failure:
        out.append(Finding("remap_failure", FATAL, True, "row-remapping failure"))
    if cur.remap_pending and not base.remap_pending:
        out.append(Finding("remap_pending", DEGRADED, True, "row remapping pending: the GPU needs a reset"))
    return out


def check_clocks(base: GpuSample, cur: GpuSample, cfg, state: CheckState) -> list[Finding]:
    if cur.clocks is None:
        return []
    out = []
    hw = cur.clocks & CLOCKS_HW_MASK
    state.clock_run = state.clock_run + 1 if hw else 0
    if state.clock_run >= cfg.clock_polls:
        names = clock_reason_names(hw)
        out.append(Finding("clocks", DEGRADED, names, f"clocks held down by {'+'.join(names)} for {state.clock_run} polls in a row"))
    sw = bool(cur.clocks & CLOCKS_SW_THERMAL)
    if sw and not state.sw_thermal:
        out.append(Finding("clocks_sw_thermal", INFO, ["SwThermalSlowdown"], "software thermal slowdown started"))
    state.sw_thermal = sw
    return out


def check_temperature(base: GpuSample, cur: GpuSample, cfg, state: CheckState) -> list[Finding]:
    t = cur.temperature
    if t is None:
        return []
    slowdown = cfg.temp_slowdown or base.temp_slowdown
    shutdown = cfg.temp_shutdown or base.temp_shutdown
    if shutdown and t >= shutdown - cfg.temp_shutdown_margin:
        state.temp_hot = True
        return [Finding("temperature", FATAL, t, f"temperature {t:g} C within {cfg.temp_shutdown_margin:g} C of shutdown ({shutdown:g} C)")]
    if slowdown:
        hot = t >= slowdown or (state.temp_hot and t > slowdown - cfg.temp_hysteresis)
        state.temp_hot = hot
        if hot:
            return [Finding("temperature", DEGRADED, t, f"temperature {t:g} C at or above slowdown ({slowdown:g} C)")]
    return []


def check_nvlink(base: GpuSample, prev: GpuSample | None, cur: GpuSample, cfg) -> list[Finding]:
    out = []
    down = sorted(link for link, state in cur.nvlink_state.items() if state == 0 and base.nvlink_state.get(link) == 1)
    if down:
        out.append(Finding("nvlink_down", FATAL, down, f"NVLink link(s) {down} went down (active at start-up)"))
    ref = prev if prev is not None else base
    grown = {
        name: total - ref.nvlink_errors[name]
        for name, total in cur.nvlink_errors.items()
        if name in ref.nvlink_errors and total > ref.nvlink_errors[name]
    }
    if grown:
        text = ", ".join(f"{k} +{v}" for k, v in sorted(grown.items()))
        out.append(Finding("nvlink_errors", INFO, grown, f"NVLink error counters grew: {text}"))
    return out


def check_pcie(base: GpuSample, cur: GpuSample, cfg, state: CheckState) -> list[Finding]:
    out = []
    if cur.pcie_replay is not None:
        hist = state.pcie_history
        if not hist and base.pcie_replay is not None:
            hist.append((base.time, base.pcie_replay))
        hist.append((cur.time, cur.pcie_replay))
        # keep one reading at or before the window start as the reference
        while len(hist) > 2 and hist[1][0] <= cur.time - PCIE_REPLAY_WINDOW:
            hist.popleft()
        ref_time, ref_count = hist[0]
        span = cur.time - ref_time
        replays = cur.pcie_replay - ref_count
        if span > 0 and replays > 0:
            per_min = replays * PCIE_REPLAY_WINDOW / max(span, PCIE_REPLAY_WINDOW)
            if per_min > cfg.pcie_replay_per_min:
                out.append(
                    Finding(
                        "pcie_replay",
                        DEGRADED,
                        round(per_min, 3),
                        f"PCIe replays at {per_min:.1f}/min (limit {cfg.pcie_replay_per_min:g}/min)",
                    )
                )
    if (
        cur.pcie_width is not None
        and base.pcie_max_width
        and base.pcie_width is not None
        and base.pcie_width >= base.pcie_max_width
        and cur.pcie_width < base.pcie_max_width
    ):
        out.append(
            Finding("pcie_width", DEGRADED, cur.pcie_width, f"PCIe link width dropped to x{cur.pcie_width} (max x{base.pcie_max_width})")
        )
    return out


def evaluate(base: GpuSample, prev: GpuSample | None, cur: GpuSample, cfg, state: CheckState) -> list[Finding]:
    """All checks of one poll of one GPU."""
    return (
        check_recovery_action(base, cur, cfg)
        + check_ecc(base, cur, cfg)
        + check_remap(base, cur, cfg)
        + check_clocks(base, cur, cfg, state)
        + check_temperature(base, cur, cfg, state)
        + check_nvlink(base, prev, cur, cfg)
        + check_pcie(base, cur, cfg, state)
    )
