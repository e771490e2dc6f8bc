"""Busy, stuck or frozen (pure): does a rank that is outside the collectives make progress?

Why: a rank its peers wait for may be doing what scripts do between steps (an evaluation on rank
0 alone, a ``torch.save`` then a barrier, an upload) or it may be hung (a sleep, a read from a
dead filesystem, a deadlock, a stopped process). The collectives cannot tell these apart: the
rank has not entered the next one either way. Torch would let a busy rank run until its peers'
collective timeout (gloo 30 min, NCCL 10 min), so killing it earlier breaks a working job; a
hung rank is worth replacing within seconds. What tells them apart is whether anything moves
in the process between two looks:

* **CPU time** (utime + stime of the process and its children, ``/proc/PID/stat``): a compute
  loop, a pickle, a data loader's workers. Threads of the runtime (the heartbeat, a few
  hundred microseconds a second) stay far below ``CPU_SHARE``.
* **Storage I/O** (``read_bytes`` + ``write_bytes``, ``/proc/PID/io``): a save throttled by the
  disk. Socket traffic is not counted there (the heartbeat writes to a socket).
* **The main thread's position** (code object and line, sampled by a worker thread and counted
  on the rank's page): Python code running, even slowly (a polling loop).
* **GPU activity** (NVML, read by the health monitor's poll: ``gpu_use``): kernels of the
  process running on its GPU while its CPU waits (a ``torch.cuda.synchronize()``, a long
  kernel). Having a CUDA context is no evidence (a hung process keeps it); a per-process
  sample with SM utilization is, and so is the device's utilization when the process is the
  only one computing on it. A look older than ``GPU_FRESH`` polls says nothing any more.

No evidence for long enough is a hang (**stuck**); a process the kernel shows stopped is
**frozen** at once. ``verdict`` is the rule; the adapter that takes the samples is
``tm_launch/launcher/progress_probe.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

BUSY, STUCK, FROZEN, UNKNOWN = "busy", "stuck", "frozen", "unknown"
CPU_SHARE = 0.05  # core-seconds per second above which a process computes (a heartbeat costs ~0.0005)
WINDOW = 1.0  # s: two samples at least this far apart are compared
GPU_FRESH = 2.0  # NVML polls: a look at a process's GPU older than this many poll intervals is no evidence


@dataclass(frozen=True)
class Sample:
    """One look at a process: when (the agent's monotonic clock), and its counters then."""

    t: float
    cpu: float  # seconds of CPU time, the process and its children
    io: int  # bytes read from and written to storage
    moves: int  # times its main thread's position changed (-1: not known, no page)
    gpu: float = 0.0  # NVML's utilization of the process on its GPU, percent (0: none or not known)
    stopped: bool = False  # the kernel shows it stopped (SIGSTOP, a debugger)


def moved(before: Sample, after: Sample) -> list[str]:
    """What made progress from ``before`` to ``after`` (empty: nothing did)."""
    dt = after.t - before.t
    if dt <= 0:
        return []
    out = []
    if after.cpu - before.cpu >= CPU_SHARE * dt:
        out.append(f"cpu {100 * (after.cpu - before.cpu) / dt:.0f}%")
    if after.io > before.io:
        out.append(f"io {after.io - before.io} bytes")
    if before.moves >= 0 and after.moves > before.moves:
        out.append("main thread moved")
    if after.gpu > 0:
        out.append(f"gpu {after.gpu:.0f}%")
    return out


def gpu_use(pid: int, samples, running, device_util: int | None) -> float:
    """NVML's evidence that ``pid`` computes on one GPU, percent (0: none), from one look:
    ``samples``, ``(pid, sm_percent)`` per-process utilization samples newer than the last look
    (``nvmlDeviceGetProcessUtilization``); ``running``, the pids with a compute context on it
    (``nvmlDeviceGetComputeRunningProcesses``); ``device_util``, the device's utilization
    (``nvmlDeviceGetUtilizationRates``; None: not known). A process's own samples decide; without
    any for it, the device's work is its only when it is the one process computing there."""
    mine = [sm for p, sm in samples if p == pid]
    if mine:
        return float(max(mine))
    if device_util and set(running) == {pid} and not [p for p, _ in samples if p != pid]:
        return float(device_util)
    return 0.0


def fresh_gpu(look: tuple[float, float] | None, now: float, poll_interval: float) -> float:
    """The percent of a look ``(when, percent)`` at a process's GPU, while it is recent enough
    to stand for the present (``GPU_FRESH`` polls); 0 for none or an old one (NVML stopped
    answering: no evidence, never evidence of progress)."""
    if look is None or now - look[0] > GPU_FRESH * poll_interval:
        return 0.0
    return look[1]


@dataclass(frozen=True)
class Progress:
    """What the adapter knows of one process: the last sample, and the last time it showed
    progress (``since``: when it was first sampled, if it never did)."""

    last: Sample
    progress_at: float
    evidence: tuple[str, ...] = ()  # what moved in the last window that moved
    windows: int = 0  # windows compared so far (none: nothing is known yet, the verdict is UNKNOWN)


def advance(state: Progress | None, ref: Sample | None, sample: Sample) -> tuple[Progress, Sample]:
    """Fold ``sample`` in: the new state and the new reference sample. Windows of at least
    ``WINDOW`` seconds are compared (the CPU clock ticks in 10 ms; shorter ones would be noise)."""
    if state is None or ref is None:
        return Progress(sample, sample.t), sample
    if sample.t - ref.t < WINDOW:
        return Progress(sample, state.progress_at, state.evidence, state.windows), ref
    what = moved(ref, sample)
    if what:
        return Progress(sample, sample.t, tuple(what), state.windows + 1), sample
    return Progress(sample, state.progress_at, state.evidence, state.windows + 1), sample


def verdict(progress: Progress | None, idle: float, now: float) -> tuple[str, float]:
    """(BUSY / STUCK / FROZEN / UNKNOWN, seconds without progress) of a rank that has been
    outside its collectives for ``idle`` seconds. STUCK only says that nothing moved for the
    returned seconds; how many are too many is the caller's limit."""
    if progress is None:
        return UNKNOWN, 0.0
    if progress.last.stopped:
        return FROZEN, idle
    if progress.windows == 0:
        return UNKNOWN, 0.0  # one look is no evidence either way: the caller's old limits apply
    still = min(idle, max(0.0, now - progress.progress_at))
    if now - progress.progress_at <= WINDOW * 2.5:  # the last complete window, or the one before, moved
        return BUSY, still
    return STUCK, still
