"""The NVML health monitor that runs inside each agent.

Two threads: ``tm-health-xid`` blocks on an NVML event set for XID critical errors, and
``tm-health-poll`` runs one batched poll of every watched GPU each ``poll_interval`` seconds
(and soon after any XID).  Each poll runs in a short-lived thread under a watchdog: a poll
that does not return within ``nvml_timeout`` raises a fatal ``nvml_hang`` alarm naming the
call that hung, and the monitor stops touching NVML.  A call raising GPU-lost / reset-required
is a fatal alarm too.  Everything goes through ``AlarmFilter`` before ``on_alarm``.

NVML missing (no driver, CPU machine, pynvml not importable): ``start()`` logs one info line
and returns False; nothing else happens.  ``TM_FAKE_NVML=FILE`` swaps in the scripted fake
(``tests/doubles/fake_nvml.py`` of the source checkout this package runs from) at the pynvml
boundary; this module is the same code either way.
"""

from __future__ import annotations

import collections
import ctypes
import importlib.util
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .alarms import DEGRADED, FATAL, INFO, Alarm, AlarmFilter
from .checks import CheckState, Finding, GpuSample, baseline_findings, evaluate
from .xid import classify_xid, xid_name

log = logging.getLogger(__name__)

FAKE_ENV = "TM_FAKE_NVML"
# The fake is a test double: it lives with the tests, not in the package. An agent finds it in
# the checkout its ``health`` package comes from (a source or editable install: the demo, the
# tests and the benchmarks run from one), whatever its working directory.
FAKE_NVML = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "doubles", "fake_nvml.py")

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
_LOG_LEVEL = {FATAL: logging.ERROR, DEGRADED: logging.WARNING, INFO: logging.INFO}


def gpus_for_local_ranks(nproc: int, cuda_visible_devices: str | None) -> list[str]:
    """The NVML device of each local rank, as the string NvmlMonitor takes (index or UUID).

    Local rank i uses CUDA device i, i.e. the i-th entry of CUDA_VISIBLE_DEVICES (indexes,
    ``GPU-``/``MIG-`` UUIDs or unique UUID prefixes).  Parsing follows CUDA: the list ends at
    the first entry that is not a valid device; an empty variable means no GPU.  Unset: rank i
    uses device i.  With fewer devices than ranks, ranks share them round-robin.
    Note: indexes assume CUDA_DEVICE_ORDER=PCI_BUS_ID (NVML's order), true on homogeneous
    nodes.
    """
    if nproc <= 0:
        return []
    if cuda_visible_devices is None:
        return [str(i) for i in range(nproc)]
    entries = []
    for raw in cuda_visible_devices.split(","):
        entry = raw.strip()
        if entry.isdigit():
            entries.append(str(int(entry)))
        elif entry.startswith(("GPU-", "MIG-")) and len(entry) > 4:
            entries.append(entry)
        else:
            break
    if not entries:
        return []
    return [entries[i % len(entries)] for i in range(nproc)]


def load_nvml():
    """(module, None) with the NVML binding to use, or (None, reason)."""
    path = os.environ.get(FAKE_ENV)
    if path:
        if not os.path.exists(FAKE_NVML):
            return None, f"{FAKE_ENV} is set but the fake NVML is not here ({FAKE_NVML}): it ships with the source checkout only"
        return _fake_nvml().FakeNvml.from_file(path), None
    try:
        import pynvml
    except ImportError as e:
        return None, f"pynvml not importable: {e}"
    return pynvml, None


def _fake_nvml():
    """The fake's module, loaded once from the checkout (``FAKE_NVML``)."""
    module = sys.modules.get("_tm_launch_fake_nvml")
    if module is None:
        spec = importlib.util.spec_from_file_location("_tm_launch_fake_nvml", FAKE_NVML)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up while it runs
        spec.loader.exec_module(module)
    return module


class _Lost(Exception):
    def __init__(self, error, call):
        super().__init__(call)
        self.error = error
        self.call = call


@dataclass
class _Device:
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

    @property
    def rank(self) -> int:
        return self.ranks[0]

    @property
    def label(self) -> str:
        who = "local ranks " + ",".join(map(str, self.ranks)) if len(self.ranks) > 1 else f"local rank {self.rank}"
        where = f"NVML {self.index}" if self.index is not None else self.spec
        return f"GPU {self.rank} ({where}, {self.uuid}, {who})"


class NvmlMonitor:
    """Watches the GPUs of one agent's workers and reports alarms.

    ``gpus``: NVML indexes or UUIDs as strings, one per local rank (see
    ``gpus_for_local_ranks``).  ``Alarm.gpu`` is the local rank (the lowest one when ranks
    share a GPU); the message names the NVML index and UUID.  ``on_alarm`` is called from the
    monitor's threads, one alarm at a time; keep it quick.
    """

    def __init__(self, node: str, gpus: list[str], cfg, on_alarm: Callable[[Alarm], None], nvml=None):
        self.node = node
        self.gpus = [str(g) for g in gpus]
        self.cfg = cfg
        self.on_alarm = on_alarm
        self._nvml = nvml
        self._filter = AlarmFilter(cfg)
        self._emit_lock = threading.Lock()
        self._poll_lock = threading.Lock()
        self._stop = threading.Event()
        self._poll_now = threading.Event()
        self._devices: list[_Device] = []
        self._by_addr: dict[int, _Device] = {}
        self._current: tuple | None = None  # (device, call) the poll thread is in
        self._event_set = None
        self._event_beat: float | None = None
        self._event_hang_reported = False
        self._node_xid_times: dict = {}  # XIDs that name no watched GPU
        self._threads: list[threading.Thread] = []
        self._initialized = False
        self.started = False
        self.wedged = False  # an NVML call hung: NVML is not touched again

    # ------------------------------------------------------------------------ lifecycle
    def start(self) -> bool:
        """Initialise NVML, take the baseline, start the threads.  False (after one info
        log line) when the monitor is off: disabled, NVML unavailable, or no GPU to watch."""
        if self.started or self.wedged:
            return True  # running, or an NVML call hung (already reported as fatal)
        if not self.cfg.nvml:
            log.info("GPU health monitor off (health.nvml is false)")
            return False
        if not self.gpus:
            log.info("GPU health monitor off: no GPU visible to the workers")
            return False
        if self._nvml is None:
            self._nvml, why = load_nvml()
            if self._nvml is None:
                log.info("GPU health monitor off: NVML unavailable (%s)", why)
                return False
        NVMLError = self._nvml.NVMLError
        self._stop.clear()
        try:
            finished, _ = self._guarded(self._start_sync, self.cfg.nvml_start_timeout, "start")
        except NVMLError as e:
            log.info("GPU health monitor off: NVML unavailable (%s: %s)", type(e).__name__, e)
            if self._initialized:
                self._quietly(self._nvml.nvmlShutdown)
                self._initialized = False
            return False
        self.started = True
        if not finished:
            return True  # the fatal nvml_hang alarm is out; NVML is not touched again
        if self._event_set is not None:
            self._spawn("tm-health-xid", self._event_loop)
        self._spawn("tm-health-poll", self._poll_loop)
        return True

    def unsupported(self) -> dict:
        """Per watched GPU (its label): the readings NVML refused at start-up, never polled."""
        return {dev.label: sorted(dev.unsupported) for dev in self._devices}

    def stop(self) -> None:
        """Stop the threads and release NVML (unless a call hung).  Idempotent."""
        self._stop.set()
        self._poll_now.set()
        deadline = time.monotonic() + self.cfg.nvml_timeout + self.cfg.event_wait_ms / 1000 + 1
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = any(t.is_alive() for t in self._threads)
        self._threads = []
        if self._initialized and not self.wedged and not alive:
            lib = self._nvml

            def release():
                if self._event_set is not None:
                    lib.nvmlEventSetFree(self._event_set)
                lib.nvmlShutdown()

            t = threading.Thread(target=self._quietly, args=(release,), daemon=True, name="tm-health-stop")
            t.start()
            t.join(self.cfg.nvml_timeout)
            self._initialized = False
        self._event_set = None
        self.started = False

    @staticmethod
    def _quietly(fn):
        try:
            fn()
        except Exception as e:  # shutting down: nothing to report to
            log.debug("NVML shutdown: %s", e)

    def _spawn(self, name, target):
        t = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(t)
        t.start()

    # ------------------------------------------------------------------------ plumbing
    def _call(self, dev, name, *args):
        self._current = (dev, name)
        try:
            return getattr(self._nvml, name)(*args)
        finally:
            self._current = None  # not reached while the call hangs: the watchdog reads it

    def _guarded(self, fn, timeout, what):
        """Run fn in a fresh thread; (True, result) or (False, None) when it hung, in
        which case the fatal nvml_hang alarm has been emitted.  fn's exception re-raises."""
        box = {}

        def run():
            try:
                box["result"] = fn()
            except BaseException as e:  # re-raised in the caller's thread
                box["error"] = e

        t = threading.Thread(target=run, name=f"tm-health-{what}-call", daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            self.wedged = True
            dev, call = self._current or (None, what)
            where = dev.label if dev is not None else "NVML"
            self._emit(
                Alarm(
                    self.node,
                    dev.rank if dev else None,
                    "nvml_hang",
                    call,
                    FATAL,
                    f"{where}: {call} did not return within {timeout:g} s",
                    time.time(),
                )
            )
            return False, None
        if "error" in box:
            raise box["error"]
        return True, box.get("result")

    def _emit(self, alarm: Alarm) -> Alarm | None:
        with self._emit_lock:
            passed = self._filter.admit(alarm)
            if passed is None:
                log.debug("suppressed repeat: %s", alarm.message)
                return None
            log.log(_LOG_LEVEL[passed.severity], "health %s [%s] %s: %s", passed.severity, self.node, passed.signal, passed.message)
            try:
                self.on_alarm(passed)
            except Exception:
                log.exception("health alarm callback failed")
            return passed

    def _alarm(self, dev: _Device | None, f: Finding) -> Alarm:
        where = dev.label if dev is not None else "NVML"
        return Alarm(self.node, dev.rank if dev is not None else None, f.signal, f.value, f.severity, f"{where}: {f.message}", time.time())

    def _is(self, error, *names) -> bool:
        return isinstance(error, tuple(getattr(self._nvml, n) for n in names))

    def _lost(self, error) -> bool:
        return self._is(error, "NVMLError_GpuIsLost", "NVMLError_ResetRequired", "NVMLError_GpuNotFound")

    # ------------------------------------------------------------------------ start-up
    def _start_sync(self):
        lib = self._nvml
        self._call(None, "nvmlInit")
        self._initialized = True
        try:
            driver = self._call(None, "nvmlSystemGetDriverVersion")
        except lib.NVMLError as e:
            driver = f"unknown ({e})"
        devices: dict = {}
        for rank, spec in enumerate(self.gpus):
            dev = _Device(spec, [rank])
            try:
                dev.handle = self._resolve(dev)
            except lib.NVMLError as e:
                if self._lost(e):
                    self._emit(self._alarm(dev, self._lost_finding(e, "device lookup")))
                else:
                    self._emit(
                        self._alarm(
                            dev, Finding("nvml_error", INFO, f"lookup: {e}", f"cannot find the GPU ({type(e).__name__}: {e}); not watched")
                        )
                    )
                continue
            dev.addr = ctypes.cast(dev.handle, ctypes.c_void_p).value
            if dev.addr in devices:
                devices[dev.addr].ranks.append(rank)
                continue
            devices[dev.addr] = dev
        self._devices = list(devices.values())
        self._by_addr = dict(devices)
        for dev in self._devices:
            try:
                dev.index = self._call(dev, "nvmlDeviceGetIndex", dev.handle)
                dev.uuid = self._call(dev, "nvmlDeviceGetUUID", dev.handle)
            except lib.NVMLError as e:
                if self._lost(e):
                    self._mark_lost(dev, e, "nvmlDeviceGetIndex")
                    continue
            dev.base, findings = self._sample(dev, baseline=True)
            if dev.base is not None:
                findings += baseline_findings(dev.base, self.cfg)
            for f in findings:
                self._emit(self._alarm(dev, f))
        self._register_events()
        for dev in self._devices:
            if dev.base is not None:
                log.info("health: watching %s; not supported: %s", dev.label, ", ".join(sorted(dev.unsupported)) or "none")
        log.info(
            "GPU health monitor on: %d GPU(s), driver %s, poll every %g s, XID events %s",
            len(self._devices),
            driver,
            self.cfg.poll_interval,
            "on" if self._event_set is not None else "off",
        )

    def _resolve(self, dev: _Device):
        lib, spec = self._nvml, dev.spec
        if spec.isdigit():
            return self._call(dev, "nvmlDeviceGetHandleByIndex", int(spec))
        try:
            return self._call(dev, "nvmlDeviceGetHandleByUUID", spec)
        except (lib.NVMLError_NotFound, lib.NVMLError_InvalidArgument):
            pass
        # CUDA_VISIBLE_DEVICES accepts unique UUID prefixes; NVML wants the full UUID
        matches = []
        for i in range(self._call(dev, "nvmlDeviceGetCount")):
            handle = self._call(dev, "nvmlDeviceGetHandleByIndex", i)
            if self._call(dev, "nvmlDeviceGetUUID", handle).startswith(spec):
                matches.append(handle)
        if len(matches) != 1:
            raise lib.NVMLError_NotFound()
        return matches[0]

    def _register_events(self):
        lib = self._nvml
        live = [d for d in self._devices if not d.lost]
        if not live:
            return
        try:
            event_set = self._call(None, "nvmlEventSetCreate")
        except lib.NVMLError as e:
            log.info("health: XID events unavailable (%s)", e)
            return
        registered = 0
        for dev in live:
            try:
                self._call(dev, "nvmlDeviceRegisterEvents", dev.handle, lib.nvmlEventTypeXidCriticalError, event_set)
                registered += 1
            except lib.NVMLError as e:
                if self._lost(e):
                    self._mark_lost(dev, e, "nvmlDeviceRegisterEvents")
                else:
                    dev.unsupported.add("xid_events")
        if registered:
            self._event_set = event_set
        else:
            self._call(None, "nvmlEventSetFree", event_set)

    # ------------------------------------------------------------------------ sampling
    def _lost_finding(self, error, call) -> Finding:
        if self._is(error, "NVMLError_ResetRequired"):
            return Finding("reset_required", FATAL, call, f"{call}: GPU requires a reset")
        return Finding("gpu_lost", FATAL, call, f"{call}: GPU is lost ({type(error).__name__})")

    def _mark_lost(self, dev, error, call):
        dev.lost = True
        self._emit(self._alarm(dev, self._lost_finding(error, call)))

    def _read(self, dev: _Device, key: str, call: str, *args, findings: list, baseline: bool = False):
        """One NVML reading; None when unsupported or failed (failure: an info finding).
        A reading that fails at start-up is never read again: there is no reference for it
        (and e.g. MIG handles refuse many queries with InvalidArgument)."""
        if key in dev.unsupported:
            return None
        lib = self._nvml
        try:
            return self._call(dev, call, dev.handle, *args)
        except lib.NVMLError as e:
            if self._lost(e):
                raise _Lost(e, call) from None
            if baseline or self._is(e, "NVMLError_NotSupported", "NVMLError_FunctionNotFound"):
                dev.unsupported.add(key)
                log.debug("health: %s: %s unavailable (%s)", dev.label, key, e)
            else:
                findings.append(Finding("nvml_error", INFO, f"{call}: {type(e).__name__}", f"{call} failed: {e}"))
            return None

    def _sample(self, dev: _Device, baseline: bool = False):
        """One poll's readings of one GPU: (GpuSample, findings), or (None, findings) when
        the GPU is lost."""
        lib = self._nvml
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
            return None, findings + [self._lost_finding(lost.error, lost.call)]
        return s, findings

    def _probe_nvlinks(self, dev, s):
        """Baseline: the state of every NVLink link, up to the first one NVML refuses."""
        lib = self._nvml
        for link in range(lib.NVML_NVLINK_MAX_LINKS):
            try:
                s.nvlink_state[link] = int(self._call(dev, "nvmlDeviceGetNvLinkState", dev.handle, link))
            except lib.NVMLError as e:
                if self._lost(e):
                    raise _Lost(e, "nvmlDeviceGetNvLinkState") from None
                if link == 0:
                    dev.unsupported.add("nvlink")
                break  # past the last link (InvalidArgument / NotSupported)

    # ------------------------------------------------------------------------ polling
    def poll_once(self) -> list[Alarm]:
        """One batched poll of every GPU, in the calling thread; returns the alarms that
        passed the filter (they also went to on_alarm)."""
        if not self._initialized or self.wedged:
            return []
        if not self._poll_lock.acquire(timeout=self.cfg.nvml_timeout):
            return []
        try:
            passed = []
            for dev in self._devices:
                if dev.lost or dev.base is None:
                    continue
                cur, findings = self._sample(dev)
                if cur is not None:
                    findings += evaluate(dev.base, dev.prev, cur, self.cfg, dev.state)
                    dev.prev = cur
                for f in findings:
                    a = self._emit(self._alarm(dev, f))
                    if a is not None:
                        passed.append(a)
            return passed
        finally:
            self._poll_lock.release()

    def _poll_loop(self):
        interval = self.cfg.poll_interval
        min_gap = min(1.0, interval)
        last = time.monotonic()
        while not self._stop.is_set():
            self._poll_now.wait(max(0.0, last + interval - time.monotonic()))
            if self._stop.is_set():
                break
            gap = last + min_gap - time.monotonic()
            if gap > 0 and self._stop.wait(gap):
                break
            self._poll_now.clear()
            self._check_event_thread()
            last = time.monotonic()
            try:
                finished, _ = self._guarded(self.poll_once, self.cfg.nvml_timeout, "poll")
            except Exception:
                log.exception("health poll failed")
                continue
            if not finished:
                break

    def _check_event_thread(self):
        beat = self._event_beat
        limit = self.cfg.event_wait_ms / 1000 + self.cfg.nvml_timeout
        if beat is None or self._event_hang_reported or time.monotonic() - beat <= limit:
            return
        self._event_hang_reported = True
        self._emit(
            Alarm(
                self.node,
                None,
                "nvml_hang",
                "nvmlEventSetWait_v2",
                FATAL,
                f"NVML: nvmlEventSetWait_v2 did not return within {limit:g} s",
                time.time(),
            )
        )

    # ------------------------------------------------------------------------ XID events
    def _event_loop(self):
        lib = self._nvml
        try:
            while not self._stop.is_set():
                self._event_beat = time.monotonic()
                try:
                    data = lib.nvmlEventSetWait_v2(self._event_set, self.cfg.event_wait_ms)
                except lib.NVMLError_Timeout:
                    continue
                except lib.NVMLError as e:
                    if self._stop.is_set():
                        break
                    if self._lost(e):
                        self._emit(self._alarm(None, self._lost_finding(e, "nvmlEventSetWait_v2")))
                        self._poll_now.set()  # the poll finds out which GPU
                        break
                    self._emit(
                        self._alarm(
                            None,
                            Finding("nvml_error", INFO, f"nvmlEventSetWait_v2: {type(e).__name__}", f"nvmlEventSetWait_v2 failed: {e}"),
                        )
                    )
                    self._stop.wait(min(1.0, self.cfg.poll_interval))
                    continue
                self._on_event(data)
        except Exception:
            log.exception("health XID thread failed")
        finally:
            self._event_beat = None

    def _on_event(self, data):
        if not data.eventType & self._nvml.nvmlEventTypeXidCriticalError:
            return
        xid = int(data.eventData)
        dev = self._by_addr.get(ctypes.cast(data.device, ctypes.c_void_p).value)
        now = time.monotonic()
        per_xid = dev.xid_times if dev is not None else self._node_xid_times
        times = per_xid.setdefault(xid, collections.deque())
        times.append(now)
        while now - times[0] > self.cfg.repeat_window:
            times.popleft()
        severity = classify_xid(xid, self.cfg, len(times))
        if severity is None:
            log.debug("health: ignored %s", xid_name(xid))
            return
        repeat = f" ({len(times)} within {self.cfg.repeat_window:g} s)" if len(times) > 1 else ""
        self._emit(self._alarm(dev, Finding("xid", severity, xid, f"{xid_name(xid)}{repeat}")))
        self._poll_now.set()  # read recovery action / ECC / remap state right away
