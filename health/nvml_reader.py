"""What NVML says about each watched GPU: finding it, its baseline, one poll's readings.

``DeviceReader`` makes the per-GPU NVML calls of the health monitor and turns the answers into
``Finding``s (judged by ``checks``).  It starts no thread and raises no alarm: ``NvmlMonitor``
(``nvml_monitor.py``) decides when to read (its poll and XID threads, the watchdog around each
batch of calls) and what becomes of a finding.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .alarms import FATAL, INFO
from .checks import CheckState, Finding, GpuSample, baseline_findings, evaluate
from .progress import gpu_use

log = logging.getLogger(__name__)

# pynvml field ids read in the batched nvmlDeviceGetFieldValues call
FI_RECOVERY_ACTION = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
FI_ECC_DBE_VOL_TOTAL = 4  # NVML_FI_DEV_ECC_DBE_VOL_TOTAL
NVLINK_ERROR_FIELDS = {38: "crc_flit", 45: "crc_data", 52: "replay", 59: "recovery"}
FIELD_IDS = [FI_RECOVERY_ACTION, FI_ECC_DBE_VOL_TOTAL] + list(NVLINK_ERROR_FIELDS)
_VALUE_MEMBER = {
    0: "dVal",
    1: "uiVal",
    2: "ulVal",
    3: "ullVal",
    4: "sllVal",
    5: "siVal",
    6: "usVal",
}  # NVML_VALUE_TYPE_* -> c_nvmlValue_t member


class _Lost(Exception):
    def __init__(self, error, call):
        super().__init__(call)
        self.error = error
        self.call = call


@dataclass
class Device:
    """One watched GPU (local ranks that share it share one) and what is known of it."""

    spec: str
    ranks: list[int]
    handle: object = None
    addr: int | None = None
    index: int | None = None
    uuid: str = "?"
    base: GpuSample | None = None
    prev: GpuSample | None = None
    state: CheckState = field(default_factory=CheckState)
    unsupported: set = field(default_factory=set)
    temp_call: str = "nvmlDeviceGetTemperatureV"
    lost: bool = False
    xid_times: dict = field(default_factory=dict)
    seen_us: int = 0  # the newest per-process utilization sample read so far (NVML's microseconds)

    @property
    def rank(self) -> int:
        return self.ranks[0]

    @property
    def label(self) -> str:
        who = "local ranks " + ",".join(map(str, self.ranks)) if len(self.ranks) > 1 else f"local rank {self.rank}"
        where = f"NVML {self.index}" if self.index is not None else self.spec
        return f"GPU {self.rank} ({where}, {self.uuid}, {who})"


class DeviceReader:
    """Reads the watched GPUs through NVML and says what the readings show.

    Exists apart from ``NvmlMonitor`` because reading a GPU is most of the monitor's code and
    none of its concurrency: which calls make a poll, what each refusal means (unsupported for
    good, one failed reading, a lost GPU), the baseline every later reading is compared with.
    The monitor makes one call at a time into it (start-up, then one poll at a time); ``current``
    is the NVML call in progress, which the monitor's watchdog names when a call hangs, and its
    XID thread uses only what makes no NVML call (``device_at``, ``is_lost``, ``lost_finding``).

    ``report(device or None, finding)``: where start-up findings go, as they come (a later call
    may hang; what was found before it is out).  ``poll`` returns its findings instead.
    """

    def __init__(self, nvml, cfg, report: Callable[[Device | None, Finding], object]):
        self.nvml = nvml
        self.cfg = cfg
        self.report = report
        self.devices: list[Device] = []
        self.current: tuple | None = None  # (device, call) NVML is in
        self._by_addr: dict[int, Device] = {}

    def call(self, dev, name, *args):
        self.current = (dev, name)
        try:
            return getattr(self.nvml, name)(*args)
        finally:
            self.current = None  # not reached while the call hangs: the watchdog reads it

    def _is(self, error, *names) -> bool:
        return isinstance(error, tuple(getattr(self.nvml, n) for n in names))

    def is_lost(self, error) -> bool:
        return self._is(error, "NVMLError_GpuIsLost", "NVMLError_ResetRequired", "NVMLError_GpuNotFound")

    def lost_finding(self, error, call) -> Finding:
        if self._is(error, "NVMLError_ResetRequired"):
            return Finding("reset_required", FATAL, call, f"{call}: GPU requires a reset")
        return Finding("gpu_lost", FATAL, call, f"{call}: GPU is lost ({type(error).__name__})")

    def device_at(self, handle) -> Device | None:
        """The watched GPU of an NVML device handle (an XID event's), or None."""
        return self._by_addr.get(ctypes.cast(handle, ctypes.c_void_p).value)

    def unsupported(self) -> dict:
        """Per watched GPU (its label): the readings NVML refused at start-up, never polled."""
        return {dev.label: sorted(dev.unsupported) for dev in self.devices}

    # ------------------------------------------------------------------------ start-up
    def open(self, gpus: list[str]) -> None:
        """Find the GPU of each local rank (``gpus``), name it and take its baseline."""
        lib = self.nvml
        devices: dict = {}
        for rank, spec in enumerate(gpus):
            dev = Device(spec, [rank])
            try:
                dev.handle = self._resolve(dev)
            except lib.NVMLError as e:
                if self.is_lost(e):
                    self.report(dev, self.lost_finding(e, "device lookup"))
                else:
                    self.report(
                        dev, Finding("nvml_error", INFO, f"lookup: {e}", f"cannot find the GPU ({type(e).__name__}: {e}); not watched")
                    )
                continue
            dev.addr = ctypes.cast(dev.handle, ctypes.c_void_p).value
            if dev.addr in devices:
                devices[dev.addr].ranks.append(rank)
                continue
            devices[dev.addr] = dev
        self.devices = list(devices.values())
        self._by_addr = dict(devices)
        for dev in self.devices:
            try:
                dev.index = self.call(dev, "nvmlDeviceGetIndex", dev.handle)
                dev.uuid = self.call(dev, "nvmlDeviceGetUUID", dev.handle)
            except lib.NVMLError as e:
                if self.is_lost(e):
                    self._mark_lost(dev, e, "nvmlDeviceGetIndex")
                    continue
            dev.base, findings = self._sample(dev, baseline=True)
            if dev.base is not None:
                findings += baseline_findings(dev.base, self.cfg)
            for f in findings:
                self.report(dev, f)

    def _resolve(self, dev: Device):
        lib, spec = self.nvml, dev.spec
        if spec.isdigit():
            return self.call(dev, "nvmlDeviceGetHandleByIndex", int(spec))
        try:
            return self.call(dev, "nvmlDeviceGetHandleByUUID", spec)
        except (lib.NVMLError_NotFound, lib.NVMLError_InvalidArgument):
            pass
        # CUDA_VISIBLE_DEVICES accepts unique UUID prefixes; NVML wants the full UUID
        matches = []
        for i in range(self.call(dev, "nvmlDeviceGetCount")):
            handle = self.call(dev, "nvmlDeviceGetHandleByIndex", i)
            if self.call(dev, "nvmlDeviceGetUUID", handle).startswith(spec):
                matches.append(handle)
        if len(matches) != 1:
            raise lib.NVMLError_NotFound()
        return matches[0]

    def register_events(self):
        """An NVML event set with the XID critical errors of every live GPU, or None when no
        GPU can deliver them."""
        lib = self.nvml
        live = [d for d in self.devices if not d.lost]
        if not live:
            return None
        try:
            event_set = self.call(None, "nvmlEventSetCreate")
        except lib.NVMLError as e:
            log.info("health: XID events unavailable (%s)", e)
            return None
        registered = 0
        for dev in live:
            try:
                self.call(dev, "nvmlDeviceRegisterEvents", dev.handle, lib.nvmlEventTypeXidCriticalError, event_set)
                registered += 1
            except lib.NVMLError as e:
                if self.is_lost(e):
                    self._mark_lost(dev, e, "nvmlDeviceRegisterEvents")
                else:
                    dev.unsupported.add("xid_events")
        if registered:
            return event_set
        self.call(None, "nvmlEventSetFree", event_set)
        return None

    # ------------------------------------------------------------------------ sampling
    def poll(self, dev: Device) -> list[Finding]:
        """One poll of one GPU: what its readings, against its baseline and the last poll,
        show.  Nothing for a GPU that is lost or has no baseline."""
        if dev.lost or dev.base is None:
            return []
        cur, findings = self._sample(dev)
        if cur is not None:
            findings += evaluate(dev.base, dev.prev, cur, self.cfg, dev.state)
            dev.prev = cur
        return findings

    def activity(self, dev: Device) -> dict[int, float]:
        """Which processes compute on this GPU now: {pid: percent} (``health.progress.gpu_use``
        over the per-process samples since the last look, the compute processes and the device's
        utilization). A reading NVML refuses counts as no evidence; none raises but a lost GPU."""
        if dev.lost or dev.handle is None:
            return {}
        lib = self.nvml
        findings: list[Finding] = []
        try:
            running = [int(p.pid) for p in self._read(dev, "processes", "nvmlDeviceGetComputeRunningProcesses", findings=findings) or ()]
            rates = self._read(dev, "utilization", "nvmlDeviceGetUtilizationRates", findings=findings)
            samples = []
            if "process_utilization" not in dev.unsupported:
                try:
                    got = self.call(dev, "nvmlDeviceGetProcessUtilization", dev.handle, dev.seen_us)
                except lib.NVMLError as e:
                    if self.is_lost(e):
                        raise _Lost(e, "nvmlDeviceGetProcessUtilization") from None
                    if not self._is(e, "NVMLError_NotFound"):  # NotFound: no sample since the last look
                        dev.unsupported.add("process_utilization")
                    got = []
                samples = [(int(x.pid), int(x.smUtil)) for x in got]
                dev.seen_us = max([dev.seen_us, *(int(x.timeStamp) for x in got)])
        except _Lost as lost:
            self._mark_lost(dev, lost.error, lost.call)
            return {}
        util = int(rates.gpu) if rates is not None else None
        return {pid: gpu_use(pid, samples, running, util) for pid in {*running, *(p for p, _ in samples)}}

    def _mark_lost(self, dev, error, call):
        dev.lost = True
        self.report(dev, self.lost_finding(error, call))

    def _read(self, dev: Device, key: str, call: str, *args, findings: list, baseline: bool = False):
        """One NVML reading; None when unsupported or failed (failure: an info finding).
        A reading that fails at start-up is never read again: there is no reference for it
        (and e.g. MIG handles refuse many queries with InvalidArgument)."""
        if key in dev.unsupported:
            return None
        lib = self.nvml
        try:
            return self.call(dev, call, dev.handle, *args)
        except lib.NVMLError as e:
            if self.is_lost(e):
                raise _Lost(e, call) from None
            if baseline or self._is(e, "NVMLError_NotSupported", "NVMLError_FunctionNotFound"):
                dev.unsupported.add(key)
                log.debug("health: %s: %s unavailable (%s)", dev.label, key, e)
            else:
                findings.append(Finding("nvml_error", INFO, f"{call}: {type(e).__name__}", f"{call} failed: {e}"))
            return None

    def _sample(self, dev: Device, baseline: bool = False):
        """One poll's readings of one GPU: (GpuSample, findings), or (None, findings) when
        the GPU is lost."""
        lib = self.nvml
        s = GpuSample(time=time.monotonic())
        findings: list[Finding] = []

        def read(key, call, *args):
            return self._read(dev, key, call, *args, findings=findings, baseline=baseline)

        try:
            values = read("fields", "nvmlDeviceGetFieldValues", FIELD_IDS)
            for v in values if values is not None else ():
                if v.nvmlReturn != lib.NVML_SUCCESS:
                    if baseline:
                        dev.unsupported.add(f"field {v.fieldId}")
                    continue
                value = int(getattr(v.value, _VALUE_MEMBER.get(v.valueType, "ullVal")))
                if v.fieldId == FI_RECOVERY_ACTION:
                    s.recovery_action = value
                elif v.fieldId == FI_ECC_DBE_VOL_TOTAL:
                    s.ecc_dbe = value
                elif v.fieldId in NVLINK_ERROR_FIELDS:
                    s.nvlink_errors[NVLINK_ERROR_FIELDS[v.fieldId]] = value
            remap = read("remapped_rows", "nvmlDeviceGetRemappedRows")
            if remap is not None:
                s.remap_pending, s.remap_failure = bool(remap[2]), bool(remap[3])
            s.clocks = read("clocks", "nvmlDeviceGetCurrentClocksEventReasons")
            s.temperature = read("temperature", dev.temp_call, lib.NVML_TEMPERATURE_GPU)
            if baseline and "temperature" in dev.unsupported and dev.temp_call.endswith("V"):
                # drivers older than nvmlDeviceGetTemperatureV: the deprecated call
                dev.temp_call = "nvmlDeviceGetTemperature"
                dev.unsupported.discard("temperature")
                s.temperature = read("temperature", dev.temp_call, lib.NVML_TEMPERATURE_GPU)
            if baseline:
                self._probe_nvlinks(dev, s)
            else:
                for link, state in dev.base.nvlink_state.items():
                    if state == 1:
                        up = read(f"nvlink {link}", "nvmlDeviceGetNvLinkState", link)
                        if up is not None:
                            s.nvlink_state[link] = int(up)
            s.pcie_replay = read("pcie_replay", "nvmlDeviceGetPcieReplayCounter")
            s.pcie_width = read("pcie_width", "nvmlDeviceGetCurrPcieLinkWidth")
            if baseline:
                s.temp_slowdown = read("temp_slowdown", "nvmlDeviceGetTemperatureThreshold", lib.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
                s.temp_shutdown = read("temp_shutdown", "nvmlDeviceGetTemperatureThreshold", lib.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN)
                s.pcie_max_width = read("pcie_max_width", "nvmlDeviceGetMaxPcieLinkWidth")
        except _Lost as lost:
            dev.lost = True
            return None, findings + [self.lost_finding(lost.error, lost.call)]
        return s, findings

    def _probe_nvlinks(self, dev, s):
        """Baseline: the state of every NVLink link, up to the first one NVML refuses."""
        lib = self.nvml
        for link in range(lib.NVML_NVLINK_MAX_LINKS):
            try:
                s.nvlink_state[link] = int(self.call(dev, "nvmlDeviceGetNvLinkState", dev.handle, link))
            except lib.NVMLError as e:
                if self.is_lost(e):
                    raise _Lost(e, "nvmlDeviceGetNvLinkState") from None
                if link == 0:
                    dev.unsupported.add("nvlink")
                break  # past the last link (InvalidArgument / NotSupported)
