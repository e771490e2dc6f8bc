"""A scripted fake of the NVML library, at the pynvml boundary (``TM_FAKE_NVML=FILE``).

``FakeNvml`` is a module-like object: it implements the pynvml functions the monitor calls,
raises pynvml's real exception classes (``pynvml.NVMLError_GpuIsLost``, ...) and returns real
pynvml structures (``c_nvmlDevice_t`` handles, ``c_nvmlEventData_t``, arrays of
``c_nvmlFieldValue_t``).  Constants, structures and exception classes it does not define are
pynvml's own; a pynvml *function* it does not implement raises AttributeError, so the monitor
cannot silently call something the fake does not script.

Timeline file (YAML or JSON; times in seconds after the first ``nvmlInit``)::

    gpus: 2                      # or a list of per-GPU initial states, e.g. [{nvlinks: 4}, {}]
    init: {temperature: 45}      # optional: initial state applied to every GPU first
    events:
      - {at: 5.0, gpu: 0, xid: 79}
      - {at: 6.0, gpu: 0, field: NVML_FI_DEV_ECC_DBE_VOL_TOTAL, value: 1}
      - {at: 7.0, gpu: 0, raise: NVMLError_GpuIsLost}
      - {at: 8.0, gpu: 1, hang: 3.0, call: nvmlDeviceGetFieldValues}
      - {at: 9.0, gpu: 1, temperature: 90, clocks: [HwSlowdown]}

See health/FORMAT.md for every key.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
import time
from dataclasses import dataclass

import pynvml

from health.checks import CLOCK_REASONS, RECOVERY_NAMES

_RECOVERY_BY_NAME = {name: value for value, name in RECOVERY_NAMES.items()}
NVLINK_COUNTER_FIELDS = {
    "crc_flit": pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL,
    "crc_data": pynvml.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL,
    "replay": pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL,
    "recovery": pynvml.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL,
}
STATE_KEYS = (
    "uuid",
    "name",
    "temperature",
    "temp_slowdown",
    "temp_shutdown",
    "clocks",
    "recovery_action",
    "ecc_dbe",
    "remap_corr",
    "remap_unc",
    "remap_pending",
    "remap_failure",
    "nvlinks",
    "nvlink_down",
    "nvlink_up",
    "nvlink_errors",
    "pcie_replay",
    "pcie_width",
    "pcie_max_width",
    "compute_pids_file",
    "compute_sm",
)
ACTION_KEYS = ("xid", "field", "value", "raise", "hang", "call", "count")
EVENT_KEYS = ("at", "after_file", "gpu") + ACTION_KEYS + STATE_KEYS
# values returned as NVML_VALUE_TYPE_UNSIGNED_INT (the rest: UNSIGNED_LONG_LONG)
_UINT_FIELDS = {pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION}


class _Gpu:
    def __init__(self, index: int):
        self.index = index
        self.struct = pynvml.struct_c_nvmlDevice_t()
        self.handle = ctypes.pointer(self.struct)  # a real c_nvmlDevice_t
        self.addr = ctypes.addressof(self.struct)
        self.uuid = f"GPU-{index:08x}-fa4e-4000-8000-{index:012x}"
        self.name = "Fake NVIDIA GPU"
        self.temperature = 40
        self.thresholds = {pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: 87, pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: 95}
        self.clocks = 0
        self.remap = [0, 0, 0, 0]  # corr, unc, pending, failure
        self.nvlinks: list[int] = []  # per link: 1 active, 0 not
        self.pcie_replay = 0
        self.pcie_width = 16
        self.pcie_max_width = 16
        self.compute_pids_file: str | None = None  # the pids computing on it, one a line (read at each call)
        self.compute_sm = 0  # ... each at this SM utilization, percent
        self.fields: dict[int, object] = {pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: 0, pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL: 0}


@dataclass
class _Rule:
    kind: str  # "raise" or "hang"
    gpu: int | None  # None: every call, device-less ones included
    call: str | None  # None: every function
    error: type | None  # raise: the NVMLError subclass
    seconds: float  # hang: how long the call blocks
    count: int | None  # None: for ever (raise default); hang default 1

    def matches(self, call: str, gpu: int | None) -> bool:
        return (self.call is None or self.call == call) and (self.gpu is None or self.gpu == gpu)


def _error_class(spec, where: str):
    if isinstance(spec, int) and not isinstance(spec, bool):
        try:
            return pynvml.nvmlExceptionClass(spec)
        except ValueError:
            raise ValueError(f"{where}: unknown NVML error code {spec}") from None
    if isinstance(spec, str):
        if spec.startswith("NVML_ERROR_"):
            code = getattr(pynvml, spec, None)
            if isinstance(code, int):
                return pynvml.nvmlExceptionClass(code)
        cls = getattr(pynvml, spec, None)
        if isinstance(cls, type) and issubclass(cls, pynvml.NVMLError) and cls is not pynvml.NVMLError:
            return cls
    raise ValueError(f"{where}: unknown pynvml error {spec!r} (e.g. NVMLError_GpuIsLost, NVML_ERROR_GPU_IS_LOST or an error code)")


def _field_id(spec, where: str) -> int:
    if isinstance(spec, int) and not isinstance(spec, bool):
        return spec
    if isinstance(spec, str) and spec.startswith("NVML_FI_") and isinstance(getattr(pynvml, spec, None), int):
        return getattr(pynvml, spec)
    raise ValueError(f"{where}: unknown field {spec!r} (a pynvml NVML_FI_* name or a number)")


def _links(value, where: str) -> list[int]:
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise ValueError(f"{where}: expected a link number or a list of them, got {value!r}")
    return items


class FakeNvml:
    """See the module docstring.  Thread-safe.  ``clock`` (monotonic seconds) drives the
    timeline; tests pass a hand-moved clock.  Wait timeouts and hangs use real time."""

    def __init__(self, spec: dict, source: str = "<timeline>", clock=time.monotonic):
        self._source = source
        self._clock = clock
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._release = threading.Event()
        self._t0: float | None = None
        self._refcount = 0
        self._rules: list[_Rule] = []
        self._xids: list[tuple[int, int]] = []  # (gpu, xid) not yet delivered
        self._sets: dict[int, tuple[object, set]] = {}  # addr -> (struct, registered gpus)
        self.calls: dict[str, int] = {}  # call counts, for tests/benchmarks
        self._parse(spec)

    # ----------------------------------------------------------------------------- loading
    @classmethod
    def from_file(cls, path: str, clock=time.monotonic) -> FakeNvml:
        with open(path) as f:
            text = f.read()
        try:
            import yaml

            spec = yaml.safe_load(text)
        except ImportError:  # pragma: no cover - pyyaml is a dependency
            spec = json.loads(text)
        return cls(spec, source=path, clock=clock)

    def _parse(self, spec):
        src = self._source
        if not isinstance(spec, dict):
            raise ValueError(f"{src}: expected a mapping with gpus and events")
        unknown = set(spec) - {"gpus", "init", "events"}
        if unknown:
            raise ValueError(f"{src}: unknown top-level key(s) {sorted(unknown)}; expected gpus, init, events")
        gpus = spec.get("gpus", 1)
        per_gpu = [{} for _ in range(gpus)] if isinstance(gpus, int) and not isinstance(gpus, bool) else gpus
        if not isinstance(per_gpu, list) or not all(isinstance(g, dict) for g in per_gpu):
            raise ValueError(f"{src}: gpus: expected a count or a list of mappings")
        self._gpus = [_Gpu(i) for i in range(len(per_gpu))]
        init = spec.get("init") or {}
        if not isinstance(init, dict):
            raise ValueError(f"{src}: init: expected a mapping of GPU state keys")
        for i, gpu in enumerate(self._gpus):
            for where, state in ((f"{src}: init", init), (f"{src}: gpus[{i}]", per_gpu[i])):
                for key, value in state.items():
                    if key not in STATE_KEYS:
                        raise ValueError(f"{where}: unknown key {key!r}; state keys are {', '.join(STATE_KEYS)}")
                    self._set_state(gpu, key, value, f"{where}.{key}")
        events = spec.get("events") or []
        if not isinstance(events, list):
            raise ValueError(f"{src}: events: expected a list")
        self._events = []
        for i, ev in enumerate(events):
            where = f"{src}: events[{i}]"
            if not isinstance(ev, dict):
                raise ValueError(f"{where}: expected a mapping")
            unknown = set(ev) - set(EVENT_KEYS)
            if unknown:
                raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; keys are {', '.join(EVENT_KEYS)}")
            at = ev.get("at", 0.0)
            if isinstance(at, bool) or not isinstance(at, (int, float)) or at < 0:
                raise ValueError(f"{where}: at: expected seconds >= 0, got {at!r}")
            if "after_file" in ev and not isinstance(ev["after_file"], str):
                raise ValueError(f"{where}: after_file: expected a path, got {ev['after_file']!r}")
            if "field" in ev and "value" not in ev:
                raise ValueError(f"{where}: field needs a value")
            if "value" in ev and "field" not in ev:
                raise ValueError(f"{where}: value without field")
            if not any(k in ev for k in ("xid", "field", "raise", "hang") + STATE_KEYS):
                raise ValueError(f"{where}: nothing to do (give xid, field, raise, hang or a state key)")
            if ("call" in ev or "count" in ev) and not ("raise" in ev or "hang" in ev):
                raise ValueError(f"{where}: call/count only go with raise or hang")
            self._check_event(ev, where)
            self._events.append((float(at), i, ev))
        self._events.sort(key=lambda e: (e[0], e[1]))
        self._next = 0
        # links named by nvlink_down/nvlink_up must exist when the event fires
        links = [len(g.nvlinks) for g in self._gpus]
        for at, i, ev in self._events:
            for gpu in self._targets(ev, f"{src}: events[{i}]", 0):
                if "nvlinks" in ev:
                    links[gpu] = ev["nvlinks"]
                for key in ("nvlink_down", "nvlink_up"):
                    for link in _links(ev[key], "") if key in ev else []:
                        if link >= links[gpu]:
                            raise ValueError(f"{src}: events[{i}]: {key}: GPU {gpu} has no link {link} (it has {links[gpu]}; set nvlinks)")

    def _targets(self, ev, where, default):
        gpu = ev.get("gpu", default)
        if gpu is None:
            return None
        if gpu == "all":
            return list(range(len(self._gpus)))
        if isinstance(gpu, bool) or not isinstance(gpu, int) or not 0 <= gpu < len(self._gpus):
            raise ValueError(f"{where}: gpu: expected 0..{len(self._gpus) - 1} or 'all', got {gpu!r}")
        return [gpu]

    def _check_event(self, ev, where):
        self._targets(ev, where, 0)
        if "xid" in ev:
            xids = ev["xid"] if isinstance(ev["xid"], list) else [ev["xid"]]
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in xids):
                raise ValueError(f"{where}: xid: expected an integer or a list of them")
        if "field" in ev:
            _field_id(ev["field"], f"{where}: field")
        if "raise" in ev and ev["raise"] not in (None, "none"):
            _error_class(ev["raise"], f"{where}: raise")
        if "hang" in ev:
            h = ev["hang"]
            if isinstance(h, bool) or not isinstance(h, (int, float)) or h <= 0:
                raise ValueError(f"{where}: hang: expected seconds > 0, got {h!r}")
        if "call" in ev:
            call = ev["call"]
            if not isinstance(call, str) or not call.startswith("nvml") or not callable(getattr(type(self), call, None)):
                raise ValueError(f"{where}: call: {call!r} is not a function the fake NVML implements")
        if "count" in ev:
            c = ev["count"]
            if isinstance(c, bool) or not isinstance(c, int) or c < 1:
                raise ValueError(f"{where}: count: expected an integer >= 1, got {c!r}")
        # validate state keys on a scratch GPU
        scratch = _Gpu(0)
        scratch.nvlinks = [1] * pynvml.NVML_NVLINK_MAX_LINKS
        for key in STATE_KEYS:
            if key in ev:
                self._set_state(scratch, key, ev[key], f"{where}: {key}")

    @staticmethod
    def _set_state(gpu: _Gpu, key: str, value, where: str):
        def want_int(v=value, minimum=0):
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise ValueError(f"{where}: expected an integer >= {minimum}, got {v!r}")
            return v

        if key == "uuid" or key == "name":
            if not isinstance(value, str):
                raise ValueError(f"{where}: expected a string")
            setattr(gpu, key, value)
        elif key == "temperature":
            gpu.temperature = want_int()
        elif key in ("temp_slowdown", "temp_shutdown"):
            which = pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN if key == "temp_slowdown" else pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN
            if value is None:
                gpu.thresholds.pop(which, None)
            else:
                gpu.thresholds[which] = want_int()
        elif key == "clocks":
            if isinstance(value, list):
                mask = 0
                for name in value:
                    if name not in CLOCK_REASONS:
                        raise ValueError(f"{where}: unknown clock event reason {name!r}; known: {', '.join(CLOCK_REASONS)}")
                    mask |= CLOCK_REASONS[name]
                gpu.clocks = mask
            else:
                gpu.clocks = want_int()
        elif key == "recovery_action":
            if isinstance(value, str):
                if value.upper() not in _RECOVERY_BY_NAME:
                    raise ValueError(f"{where}: unknown recovery action {value!r}; known: {', '.join(_RECOVERY_BY_NAME)}")
                value = _RECOVERY_BY_NAME[value.upper()]
            gpu.fields[pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION] = want_int(value)
        elif key == "ecc_dbe":
            gpu.fields[pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL] = want_int()
        elif key.startswith("remap_"):
            slot = ("remap_corr", "remap_unc", "remap_pending", "remap_failure").index(key)
            gpu.remap[slot] = int(value) if isinstance(value, bool) else want_int()
        elif key == "nvlinks":
            n = want_int()
            if n > pynvml.NVML_NVLINK_MAX_LINKS:
                raise ValueError(f"{where}: at most {pynvml.NVML_NVLINK_MAX_LINKS} links")
            gpu.nvlinks = [1] * n
            for fid in NVLINK_COUNTER_FIELDS.values():
                if n:
                    gpu.fields.setdefault(fid, 0)
                else:
                    gpu.fields.pop(fid, None)
        elif key in ("nvlink_down", "nvlink_up"):
            for link in _links(value, where):
                if link >= len(gpu.nvlinks):
                    raise ValueError(f"{where}: link {link} does not exist (the GPU has {len(gpu.nvlinks)}; set nvlinks)")
                gpu.nvlinks[link] = 0 if key == "nvlink_down" else 1
        elif key == "nvlink_errors":
            if not isinstance(value, dict) or not set(value) <= set(NVLINK_COUNTER_FIELDS):
                raise ValueError(f"{where}: expected a mapping of {', '.join(NVLINK_COUNTER_FIELDS)} to totals, got {value!r}")
            for name, total in value.items():
                gpu.fields[NVLINK_COUNTER_FIELDS[name]] = want_int(total)
        elif key == "compute_pids_file":
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{where}: expected a file name or null")
            gpu.compute_pids_file = value
        elif key == "compute_sm":
            gpu.compute_sm = want_int()
            if value > 100:
                raise ValueError(f"{where}: a percentage is at most 100")
        elif key in ("pcie_replay", "pcie_width", "pcie_max_width"):
            setattr(gpu, key, want_int())
        else:  # pragma: no cover - STATE_KEYS and this chain agree
            raise ValueError(f"{where}: unknown state key")

    # ------------------------------------------------------------------------ the timeline
    def __getattr__(self, name):
        value = getattr(pynvml, name)
        if callable(value) and not isinstance(value, type):
            raise AttributeError(f"the fake NVML does not implement pynvml.{name}")
        return value

    def now(self) -> float:
        """Seconds since the first nvmlInit (0 before it)."""
        return 0.0 if self._t0 is None else self._clock() - self._t0

    def release(self) -> None:
        """End every scripted hang now (tests call this when they are done)."""
        self._release.set()
        with self._cond:
            self._cond.notify_all()

    def _gated(self) -> bool:
        """The next event is due but waits for its ``after_file`` to exist (the timeline holds)."""
        if self._next >= len(self._events):
            return False
        at, _, ev = self._events[self._next]
        return at <= self.now() and "after_file" in ev and not os.path.exists(ev["after_file"])

    def _advance(self):
        now = self.now()
        while self._next < len(self._events) and self._events[self._next][0] <= now and not self._gated():
            at, i, ev = self._events[self._next]
            self._next += 1
            self._apply(ev, f"{self._source}: events[{i}]")

    def _apply(self, ev, where):
        if "raise" in ev or "hang" in ev:
            gpus = self._targets(ev, where, None)
            for gpu in gpus if gpus is not None else [None]:
                if "raise" in ev:
                    if ev["raise"] in (None, "none"):
                        self._rules = [r for r in self._rules if not (r.kind == "raise" and r.gpu == gpu and r.call == ev.get("call"))]
                    else:
                        self._rules.append(_Rule("raise", gpu, ev.get("call"), _error_class(ev["raise"], where), 0.0, ev.get("count")))
                if "hang" in ev:
                    self._rules.append(_Rule("hang", gpu, ev.get("call"), None, float(ev["hang"]), ev.get("count", 1)))
        for gpu in self._targets(ev, where, 0):
            g = self._gpus[gpu]
            if "xid" in ev:
                for xid in ev["xid"] if isinstance(ev["xid"], list) else [ev["xid"]]:
                    self._xids.append((gpu, xid))
                self._cond.notify_all()
            if "field" in ev:
                fid = _field_id(ev["field"], where)
                if ev["value"] is None:
                    g.fields.pop(fid, None)
                else:
                    g.fields[fid] = ev["value"]
            for key in STATE_KEYS:
                if key in ev:
                    self._set_state(g, key, ev[key], f"{where}: {key}")

    def _take_rule(self, kind, call, gpu):
        for rule in self._rules:
            if rule.kind == kind and rule.matches(call, gpu):
                if rule.count is not None:
                    rule.count -= 1
                    if rule.count <= 0:
                        self._rules.remove(rule)
                return rule
        return None

    def _enter(self, call: str, gpu: int | None = None):
        """Every API function starts here: time advances, scripted hangs and errors fire."""
        with self._lock:
            self.calls[call] = self.calls.get(call, 0) + 1
            if call != "nvmlInit" and self._refcount <= 0:
                raise pynvml.NVMLError_Uninitialized()
            self._advance()
            hang = self._take_rule("hang", call, gpu)
        if hang is not None:
            self._release.wait(hang.seconds)
        with self._lock:
            self._advance()
            err = self._take_rule("raise", call, gpu)
        if err is not None:
            raise err.error()

    def _gpu(self, handle) -> _Gpu:
        try:
            addr = ctypes.cast(handle, ctypes.c_void_p).value
        except (TypeError, ctypes.ArgumentError):
            raise pynvml.NVMLError_InvalidArgument() from None
        for g in self._gpus:
            if g.addr == addr:
                return g
        raise pynvml.NVMLError_InvalidArgument()

    def _device(self, call, handle) -> _Gpu:
        g = self._gpu(handle)
        self._enter(call, g.index)
        return g

    # ---------------------------------------------------------------- pynvml functions
    def nvmlInit(self):
        with self._lock:
            if self._t0 is None:
                self._t0 = self._clock()
            self._refcount += 1
        try:
            self._enter("nvmlInit")
        except pynvml.NVMLError:
            with self._lock:
                self._refcount -= 1
            raise

    def nvmlInitWithFlags(self, flags):
        self.nvmlInit()

    def nvmlShutdown(self):
        self._enter("nvmlShutdown")
        with self._cond:
            self._refcount -= 1
            self._cond.notify_all()

    def nvmlSystemGetDriverVersion(self):
        self._enter("nvmlSystemGetDriverVersion")
        return "fake"

    def nvmlDeviceGetCount(self):
        self._enter("nvmlDeviceGetCount")
        return len(self._gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        if not isinstance(index, int) or not 0 <= index < len(self._gpus):
            self._enter("nvmlDeviceGetHandleByIndex")
            raise pynvml.NVMLError_InvalidArgument()
        self._enter("nvmlDeviceGetHandleByIndex", index)
        return self._gpus[index].handle

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if isinstance(uuid, bytes):
            uuid = uuid.decode()
        for g in self._gpus:
            if g.uuid == uuid:
                self._enter("nvmlDeviceGetHandleByUUID", g.index)
                return g.handle
        self._enter("nvmlDeviceGetHandleByUUID")
        raise pynvml.NVMLError_NotFound()

    def nvmlDeviceGetUUID(self, handle):
        return self._device("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetIndex(self, handle):
        return self._device("nvmlDeviceGetIndex", handle).index

    def nvmlDeviceGetName(self, handle):
        return self._device("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetFieldValues(self, handle, fieldIds):
        g = self._device("nvmlDeviceGetFieldValues", handle)
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        stamp = int(time.time() * 1e6)
        with self._lock:
            for i, fid in enumerate(fieldIds):
                scope = 0
                if isinstance(fid, tuple):
                    fid, scope = fid
                v = values[i]
                v.fieldId, v.scopeId, v.timestamp, v.latencyUsec = fid, scope, stamp, 0
                if fid not in g.fields:
                    v.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                    continue
                v.nvmlReturn = pynvml.NVML_SUCCESS
                if fid in _UINT_FIELDS:
                    v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                    v.value.uiVal = int(g.fields[fid])
                else:
                    v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                    v.value.ullVal = int(g.fields[fid])
        return values

    def nvmlDeviceGetRemappedRows(self, handle):
        g = self._device("nvmlDeviceGetRemappedRows", handle)
        return tuple(g.remap)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return self._device("nvmlDeviceGetCurrentClocksEventReasons", handle).clocks

    def nvmlDeviceGetTemperatureV(self, handle, sensor, version=pynvml.nvmlTemperature_v1):
        g = self._device("nvmlDeviceGetTemperatureV", handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise pynvml.NVMLError_NotSupported()
        return g.temperature

    def nvmlDeviceGetTemperature(self, handle, sensor):
        g = self._device("nvmlDeviceGetTemperature", handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise pynvml.NVMLError_NotSupported()
        return g.temperature

    def nvmlDeviceGetTemperatureThreshold(self, handle, threshold):
        g = self._device("nvmlDeviceGetTemperatureThreshold", handle)
        if threshold not in g.thresholds:
            raise pynvml.NVMLError_NotSupported()
        return g.thresholds[threshold]

    def nvmlDeviceGetNvLinkState(self, handle, link):
        g = self._device("nvmlDeviceGetNvLinkState", handle)
        if not g.nvlinks:
            raise pynvml.NVMLError_NotSupported()
        if not 0 <= link < len(g.nvlinks):
            raise pynvml.NVMLError_InvalidArgument()
        return g.nvlinks[link]

    def nvmlDeviceGetPcieReplayCounter(self, handle):
        return self._device("nvmlDeviceGetPcieReplayCounter", handle).pcie_replay

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle):
        return self._device("nvmlDeviceGetCurrPcieLinkWidth", handle).pcie_width

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle):
        return self._device("nvmlDeviceGetMaxPcieLinkWidth", handle).pcie_max_width

    # A worker that computes on its GPU: its pid written to ``compute_pids_file`` by the test's
    # script (no file, or not listed: it computes nothing there).
    @staticmethod
    def _computing(g: _Gpu) -> list[int]:
        try:
            with open(g.compute_pids_file) as f:
                return [int(line) for line in f.read().split()]
        except (TypeError, OSError, ValueError):
            return []

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        g = self._device("nvmlDeviceGetComputeRunningProcesses", handle)
        out = []
        for pid in self._computing(g):
            info = pynvml.c_nvmlProcessInfo_v2_t()
            info.pid, info.usedGpuMemory = pid, 1 << 30
            out.append(pynvml.nvmlStructToFriendlyObject(info))
        return out

    def nvmlDeviceGetUtilizationRates(self, handle):
        g = self._device("nvmlDeviceGetUtilizationRates", handle)
        util = pynvml.c_nvmlUtilization_t()
        util.gpu = util.memory = g.compute_sm if self._computing(g) else 0
        return util

    def nvmlDeviceGetProcessUtilization(self, handle, timeStamp):
        g = self._device("nvmlDeviceGetProcessUtilization", handle)
        now_us = int(time.time() * 1e6)
        pids = self._computing(g) if now_us > timeStamp else []
        if not pids:
            raise pynvml.NVMLError_NotFound()  # what NVML says when no sample is newer than timeStamp
        out = []
        for pid in pids:
            sample = pynvml.c_nvmlProcessUtilizationSample_t()
            sample.pid, sample.timeStamp, sample.smUtil, sample.memUtil = pid, now_us, g.compute_sm, g.compute_sm
            out.append(sample)
        return out

    def nvmlEventSetCreate(self):
        self._enter("nvmlEventSetCreate")
        struct = pynvml.struct_c_nvmlEventSet_t()
        with self._lock:
            self._sets[ctypes.addressof(struct)] = (struct, set())
        return ctypes.pointer(struct)

    def _event_set(self, event_set):
        addr = ctypes.cast(event_set, ctypes.c_void_p).value
        if addr not in self._sets:
            raise pynvml.NVMLError_InvalidArgument()
        return self._sets[addr][1]

    def nvmlDeviceRegisterEvents(self, handle, eventTypes, eventSet):
        g = self._device("nvmlDeviceRegisterEvents", handle)
        with self._lock:
            registered = self._event_set(eventSet)
            if eventTypes & pynvml.nvmlEventTypeXidCriticalError:
                registered.add(g.index)
                self._cond.notify_all()

    def nvmlEventSetWait_v2(self, eventSet, timeoutms):
        self._enter("nvmlEventSetWait_v2")
        deadline = time.monotonic() + timeoutms / 1000.0  # real time, whatever the clock
        with self._cond:
            while True:
                if self._refcount <= 0:
                    raise pynvml.NVMLError_Uninitialized()
                registered = self._event_set(eventSet)
                self._advance()
                for i, (gpu, xid) in enumerate(self._xids):
                    if gpu in registered:
                        del self._xids[i]
                        data = pynvml.c_nvmlEventData_t()
                        data.device = self._gpus[gpu].handle
                        data.eventType = pynvml.nvmlEventTypeXidCriticalError
                        data.eventData = xid
                        data.gpuInstanceId = 0xFFFFFFFF
                        data.computeInstanceId = 0xFFFFFFFF
                        return data
                left = deadline - time.monotonic()
                if left <= 0:
                    raise pynvml.NVMLError_Timeout()
                if self._next < len(self._events):
                    left = min(left, max(0.0, self._events[self._next][0] - self.now()) + 0.001)
                    if self._gated():
                        left = min(left, 0.02)  # poll for the file that releases the timeline
                self._cond.wait(left)

    def nvmlEventSetWait(self, eventSet, timeoutms):
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    def nvmlEventSetFree(self, eventSet):
        self._enter("nvmlEventSetFree")
        with self._cond:
            self._event_set(eventSet)
            del self._sets[ctypes.cast(eventSet, ctypes.c_void_p).value]
            self._cond.notify_all()
