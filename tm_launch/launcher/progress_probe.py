"""The agent's looks at its workers' progress (the adapter of ``health.progress``).

Per worker process and loop iteration: its CPU time and its children's (``/proc/PID/stat``,
and ``/proc/PID/task/*/children`` for a data loader's workers), its storage I/O
(``/proc/PID/io``), whether the kernel shows it stopped, and the main thread's move count from
its collective page (``moves``; -1 without a page: restart mode), and its GPU's activity as the
health monitor's last NVML poll saw it (``gpu``). ``health.progress.advance``
folds each sample in; ``verdict`` says busy, stuck or frozen. Reading those files costs a few
microseconds each; an unreadable one counts as no progress from that source (never as progress).

Who uses it: the culprit rule's records (``collective_watch``) and the heartbeat watchdog
(``supervisor.watch_hangs``): the same evidence for every detector that can kill a worker.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from health.progress import Progress, Sample, advance, verdict

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[float, bool] | None:
    """(CPU seconds of the process, stopped?) from ``/proc/PID/stat``; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # after the name: state is field 3 of stat(5), utime 14, stime 15 (here: 0, 11, 12)
    return (int(fields[11]) + int(fields[12])) / _TICK, fields[0] in ("T", "t")


def _children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
    except (OSError, ValueError):
        pass
    return out


def _io(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/io") as f:
            fields = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        return int(fields["read_bytes"]) + int(fields["write_bytes"])
    except (OSError, KeyError, ValueError):
        return 0


def sample(pid: int, moves: int, now: float | None = None, gpu: float = 0.0) -> Sample | None:
    """One look at ``pid`` (None: it is gone); ``gpu``: the health monitor's last look at its GPU."""
    stat = _stat(pid)
    if stat is None:
        return None
    cpu, stopped = stat
    io = _io(pid)
    for child in _children(pid):
        got = _stat(child)
        if got is not None:
            cpu += got[0]
            io += _io(child)
    return Sample(time.monotonic() if now is None else now, cpu, io, moves, gpu, stopped)


class ProgressProbe:
    """Each watched worker's progress, keyed by pid (a restarted worker starts afresh)."""

    def __init__(self):
        self._state: dict[int, tuple[Progress, Sample]] = {}
        # pid -> percent of its GPU busy (``NvmlMonitor.gpu_activity``, set when the monitor
        # runs; NVML is read on the monitor's threads, never here: a call may hang)
        self.gpu: Callable[[int], float] = lambda pid: 0.0

    def look(self, pid: int, moves: int = -1) -> Progress | None:
        """Sample ``pid`` now and fold it in (call once per loop iteration per worker)."""
        s = sample(pid, moves, gpu=self.gpu(pid))
        if s is None:
            self._state.pop(pid, None)
            return None
        state, ref = self._state.get(pid, (None, None))
        state, ref = advance(state, ref, s)
        self._state[pid] = (state, ref)
        return state

    def known(self, pid: int) -> Progress | None:
        got = self._state.get(pid)
        return None if got is None else got[0]

    def judge(self, pid: int, idle: float) -> tuple[str, float, Progress | None]:
        """(health.progress verdict, seconds without progress, the state) of ``pid``, outside
        its collectives for ``idle`` seconds."""
        state = self.known(pid)
        kind, still = verdict(state, idle, time.monotonic())
        return kind, still, state

    def forget(self, alive: set[int]) -> None:
        """Drop the processes no longer watched."""
        for pid in set(self._state) - alive:
            del self._state[pid]
