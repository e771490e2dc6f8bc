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

Reading the GPUs (which NVML calls, what a refusal means, the baseline) is ``DeviceReader``'s
(``nvml_reader.py``); this module decides when to read and what becomes of a finding.
"""

from __future__ import annotations

import collections
import importlib.util
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

from .alarms import DEGRADED, FATAL, INFO, Alarm, AlarmFilter
from .checks import Finding
from .nvml_reader import Device, DeviceReader
from .progress import fresh_gpu
from .xid import classify_xid, xid_name

log = logging.getLogger(__name__)

FAKE_ENV = "TM_FAKE_NVML"
# The fake is a test double: it lives with the tests, not in the package. An agent finds it in
# the checkout its ``health`` package comes from (a source or editable install: the demo, the
# tests and the benchmarks run from one), whatever its working directory.
FAKE_NVML = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "doubles", "fake_nvml.py")
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


class NvmlMonitor:
    """Watches the GPUs of one agent's workers and reports alarms.

    ``gpus``: NVML indexes or UUIDs as strings, one per local rank (see
    ``gpus_for_local_ranks``).  ``Alarm.gpu`` is the local rank (the lowest one when ranks
    share a GPU); the message names the NVML index and UUID.  ``on_alarm`` is called from the
    monitor's threads, one alarm at a time; keep it quick.

    Exists for what NVML cannot be trusted to do on its own: return.  It owns the threads, the
    watchdog that turns a hung call into a fatal alarm and keeps the monitor off NVML from then
    on, NVML's initialisation and release, the XID event set, and the way from a finding to
    ``on_alarm`` (``AlarmFilter``, the log line).  The reading itself is its ``DeviceReader``'s.
    """

    def __init__(self, node: str, gpus: list[str], cfg, on_alarm: Callable[[Alarm], None], nvml=None):
        self.node = node
        self.gpus = [str(g) for g in gpus]
        self.cfg = cfg
        self.on_alarm = on_alarm
        self._nvml = nvml
        self._reader: DeviceReader | None = None  # made with the NVML binding, at the first start()
        self._filter = AlarmFilter(cfg)
        self._emit_lock = threading.Lock()
        self._poll_lock = threading.Lock()
        self._stop = threading.Event()
        self._poll_now = threading.Event()
        self._event_set = None
        self._event_beat: float | None = None
        self._event_hang_reported = False
        self._node_xid_times: dict = {}  # XIDs that name no watched GPU
        self._threads: list[threading.Thread] = []
        self._initialized = False
        self.started = False
        self.wedged = False  # an NVML call hung: NVML is not touched again
        self._gpu_looks: dict[int, tuple[float, float]] = {}  # pid -> (when, percent) of the last poll

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
        if self._reader is None:
            self._reader = DeviceReader(self._nvml, self.cfg, self._report)
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
        return self._reader.unsupported() if self._reader is not None else {}

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
            dev, call = self._reader.current or (None, what)
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

    def _alarm(self, dev: Device | None, f: Finding) -> Alarm:
        where = dev.label if dev is not None else "NVML"
        return Alarm(self.node, dev.rank if dev is not None else None, f.signal, f.value, f.severity, f"{where}: {f.message}", time.time())

    def _report(self, dev: Device | None, f: Finding) -> Alarm | None:
        return self._emit(self._alarm(dev, f))

    # ------------------------------------------------------------------------ start-up
    def _start_sync(self):
        reader, lib = self._reader, self._nvml
        reader.call(None, "nvmlInit")
        self._initialized = True
        try:
            driver = reader.call(None, "nvmlSystemGetDriverVersion")
        except lib.NVMLError as e:
            driver = f"unknown ({e})"
        reader.open(self.gpus)
        self._event_set = reader.register_events()
        for dev in reader.devices:
            if dev.base is not None:
                log.info("health: watching %s; not supported: %s", dev.label, ", ".join(sorted(dev.unsupported)) or "none")
        log.info(
            "GPU health monitor on: %d GPU(s), driver %s, poll every %g s, XID events %s",
            len(reader.devices),
            driver,
            self.cfg.poll_interval,
            "on" if self._event_set is not None else "off",
        )

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
            looks: dict[int, tuple[float, float]] = {}
            for dev in self._reader.devices:
                for f in self._reader.poll(dev):
                    a = self._report(dev, f)
                    if a is not None:
                        passed.append(a)
                now = time.monotonic()
                for pid, percent in self._reader.activity(dev).items():
                    looks[pid] = (now, max(percent, looks.get(pid, (now, 0.0))[1]))
            self._gpu_looks = looks  # one assignment: the agent's loop reads a whole poll's looks
            return passed
        finally:
            self._poll_lock.release()

    def gpu_activity(self, pid: int) -> float:
        """Percent of its GPU that process ``pid`` kept busy at the last poll, while that poll is
        recent (``health.progress.fresh_gpu``); 0: none, or not known. Read by the agent's
        progress probe: a rank waiting on its GPU with its CPU idle is busy, not stuck."""
        return fresh_gpu(self._gpu_looks.get(pid), time.monotonic(), self.cfg.poll_interval)

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
                    if self._reader.is_lost(e):
                        self._report(None, self._reader.lost_finding(e, "nvmlEventSetWait_v2"))
                        self._poll_now.set()  # the poll finds out which GPU
                        break
                    self._report(
                        None, Finding("nvml_error", INFO, f"nvmlEventSetWait_v2: {type(e).__name__}", f"nvmlEventSetWait_v2 failed: {e}")
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
        dev = self._reader.device_at(data.device)
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
        self._report(dev, Finding("xid", severity, xid, f"{xid_name(xid)}{repeat}"))
        self._poll_now.set()  # read recovery action / ECC / remap state right away
