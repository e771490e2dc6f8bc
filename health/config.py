"""The `health:` section of the tm-launch YAML config.

Every field has a default, a simple type (bool / int / float / str / list[int]) and a
``metadata["help"]`` string: the CLI generates ``--health-<field-with-dashes>`` flags from
``dataclasses.fields(HealthConfig)``.  Do not add ``from __future__ import annotations`` here:
the CLI reads ``field.type`` as a real type.
"""

import dataclasses
import difflib
from dataclasses import dataclass, field

# Sources: NVIDIA's XID catalog, DCGM health watches, the Kubernetes device plugin,
# nvidia-resiliency-ext.  Fatal: the GPU (or its node) cannot keep running this job.
DEFAULT_FATAL_XIDS = [46, 48, 62, 64, 74, 79, 95, 109, 110, 119, 120, 136, 140, 143, 144, 145, 146, 147, 148, 149, 150, 155, 156, 158]
# Degraded on the first occurrence: the GPU still works but should be replaced soon
# (63: row remap pending a reset, 92: high single-bit ECC rate, 94: contained ECC error).
DEFAULT_DEGRADED_XIDS = [63, 92, 94]
# Usually application faults: info once, degraded when the same XID repeats on a GPU.
DEFAULT_REPEAT_XIDS = [8, 13, 31, 32, 43, 61, 68, 69]
# 45 is logged whenever a process with a GPU context is killed, which tm-launch itself does.
DEFAULT_IGNORED_XIDS = [45]


def _f(default, help):
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class HealthConfig:
    # --- NVML monitor -------------------------------------------------------------------
    nvml: bool = _f(True, "run the NVML GPU health monitor in each agent (off: no GPU checks)")
    poll_interval: float = _f(5.0, "seconds between batched NVML polls")
    nvml_timeout: float = _f(
        10.0, "seconds an NVML poll (or the XID wait, beyond its own timeout) may take before it counts as hung: a fatal nvml_hang alarm"
    )
    nvml_start_timeout: float = _f(60.0, "seconds nvmlInit, device lookup and the start-up baseline may take together")
    event_wait_ms: int = _f(1000, "milliseconds the XID thread blocks in nvmlEventSetWait per call (bounds how long stop() takes)")
    fatal_xids: list[int] = _f(DEFAULT_FATAL_XIDS, "XIDs that are fatal (fail over now)")
    degraded_xids: list[int] = _f(DEFAULT_DEGRADED_XIDS, "XIDs that are degraded (planned migration to a spare)")
    repeat_xids: list[int] = _f(
        DEFAULT_REPEAT_XIDS, "XIDs that are info once and degraded when they repeat repeat_count times within repeat_window on one GPU"
    )
    ignored_xids: list[int] = _f(DEFAULT_IGNORED_XIDS, "XIDs that are ignored entirely")
    repeat_count: int = _f(3, "an info-level event (or a repeat XID) seen this many times within repeat_window escalates to degraded")
    repeat_window: float = _f(300.0, "seconds over which repeats are counted")
    alarm_hold: float = _f(
        600.0, "seconds an alarm latches: repeats of the same node/gpu/signal at the same or lower severity are suppressed (0 = forever)"
    )
    temp_slowdown: float = _f(0.0, "degraded at this GPU temperature in C (0 = NVML's slowdown threshold)")
    temp_shutdown: float = _f(0.0, "shutdown temperature in C (0 = NVML's shutdown threshold)")
    temp_shutdown_margin: float = _f(5.0, "fatal at temp_shutdown minus this many C")
    temp_hysteresis: float = _f(3.0, "a hot GPU counts as cool again only this many C below the slowdown threshold")
    clock_polls: int = _f(3, "HW slowdown / HW thermal / power-brake clock reasons must be active this many polls in a row to be degraded")
    pcie_replay_per_min: float = _f(8.0, "degraded when PCIe replays grow faster than this many per minute (DCGM's limit)")
    # --- hang detection -----------------------------------------------------------------
    hang_timeout: float = _f(
        0.0,
        "seconds without step progress before a worker is killed "
        "(0 = automatic: hang_multiplier x slowest recent step, "
        "at least hang_floor)",
    )
    hang_multiplier: float = _f(10.0, "automatic hang timeout: multiple of the slowest recent step time")
    hang_floor: float = _f(60.0, "automatic hang timeout: never below this many seconds")
    hang_warmup_steps: int = _f(3, "steps that count as warm-up (compilation, first collectives): they get hang_warmup_timeout")
    hang_warmup_timeout: float = _f(600.0, "hang timeout during warm-up steps and before any step time is known")
    hang_checkpoint_timeout: float = _f(900.0, "hang timeout while a checkpoint is being saved")
    hang_history: int = _f(20, "step times remembered for the automatic hang timeout")
    # --- stuck collectives (C4) -----------------------------------------------------------
    collective_watch: bool = _f(
        True, "find the rank a stuck collective waits for from the live groups' telemetry (C4) and replace it (live workers only)"
    )
    collective_floor: float = _f(1.0, "a collective counts as stuck only after its members waited this many seconds")
    collective_multiplier: float = _f(10.0, "... and this multiple of the group's recent collective duration")
    collective_alive_floor: float = _f(
        10.0,
        "a rank that is alive but has not entered the stuck collective is blamed only after this many seconds "
        "(the whole rule where no progress evidence is known; a floor under the busy limit otherwise)",
    )
    collective_alive_multiplier: float = _f(10.0, "... and this multiple of its median recent step")
    collective_still_floor: float = _f(
        6.0,
        "a rank outside the collective its peers wait in, of which nothing moved for this many seconds (CPU time, storage I/O, "
        "its main thread's position, its GPU), is stuck and replaced; one that makes progress is busy and waits until its "
        "peers' collective timeout, as under torchrun",
    )
    collective_frozen_after: float = _f(
        10.0,
        "a worker whose heartbeat thread is silent this many seconds counts as frozen (a stopped process always does; "
        "a long call holding the interpreter, a big pickle, silences it too)",
    )
    # --- straggler detection --------------------------------------------------------------
    straggler: bool = _f(True, "detect stragglers from per-rank compute time (time outside the job's collectives)")
    straggler_z: float = _f(3.5, "robust z-score (0.6745 (c - median) / MAD) above which a rank is slow in a window")
    straggler_ratio: float = _f(1.2, "a slow rank must also exceed this multiple of the median")
    straggler_mad_floor: float = _f(0.01, "MAD is floored at this fraction of the median")
    straggler_window: int = _f(20, "training steps aggregated into one straggler window")
    straggler_need: int = _f(3, "a rank is a straggler (degraded) when slow in straggler_need of the last straggler_of windows")
    straggler_of: int = _f(5, "number of recent windows the straggler_need rule looks at")

    def __post_init__(self):
        self.validate()

    # ------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d) -> "HealthConfig":
        """Build from the YAML ``health:`` mapping.  Raises ValueError with one line,
        ``health.<key>: <what is wrong>``."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ValueError(f"health: expected a mapping, got {type(d).__name__}")
        known = {f.name: f for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, value in d.items():
            if key not in known:
                near = difflib.get_close_matches(str(key).replace("-", "_"), known, n=1, cutoff=0.6)
                hint = f"; did you mean '{near[0]}'?" if near else ""
                raise ValueError(f"health.{key}: unknown key{hint}")
            kwargs[key] = _coerce(key, known[key].type, value)
        return cls(**kwargs)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        positive = [
            "poll_interval",
            "nvml_timeout",
            "nvml_start_timeout",
            "repeat_window",
            "hang_multiplier",
            "hang_warmup_timeout",
            "hang_checkpoint_timeout",
            "straggler_z",
            "straggler_ratio",
            "collective_floor",
            "collective_multiplier",
            "collective_alive_floor",
            "collective_alive_multiplier",
            "collective_still_floor",
            "collective_frozen_after",
        ]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"health.{name}: must be > 0, got {getattr(self, name)}")
        non_negative = [
            "alarm_hold",
            "temp_slowdown",
            "temp_shutdown",
            "temp_shutdown_margin",
            "temp_hysteresis",
            "pcie_replay_per_min",
            "hang_timeout",
            "hang_floor",
            "hang_warmup_steps",
            "straggler_mad_floor",
        ]
        for name in non_negative:
            if getattr(self, name) < 0:
                raise ValueError(f"health.{name}: must be >= 0, got {getattr(self, name)}")
        at_least_one = [
            "event_wait_ms",
            "repeat_count",
            "clock_polls",
            "hang_history",
            "straggler_window",
            "straggler_need",
            "straggler_of",
        ]
        for name in at_least_one:
            if getattr(self, name) < 1:
                raise ValueError(f"health.{name}: must be >= 1, got {getattr(self, name)}")
        if self.straggler_need > self.straggler_of:
            raise ValueError(f"health.straggler_need: must be <= straggler_of ({self.straggler_of}), got {self.straggler_need}")


def _coerce(key, typ, value):
    where = f"health.{key}"
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{where}: expected true or false, got {value!r}")
    if typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ValueError(f"{where}: expected an integer, got {value!r}")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ValueError(f"{where}: expected a number, got {value!r}")
    if typ is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"{where}: expected a string, got {value!r}")
    if typ == list[int]:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: expected a list of integers, got {value!r}")
        out = []
        for item in value:
            if isinstance(item, bool) or not isinstance(item, int):
                raise ValueError(f"{where}: expected a list of integers, got item {item!r}")
            out.append(item)
        return out
    raise ValueError(f"{where}: unsupported field type {typ!r}")  # pragma: no cover
