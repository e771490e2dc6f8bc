"""What a worker tells its agent about its steps (its ``WorkerStatus`` in the agent's store,
``tm_launch.protocol``): read by the hang watchdog, the straggler statistic, ``ctl status`` and
``ctl timeline``.

* ``StepStats``: step and compute times. A live worker records every committed step.
* ``LiveStatus``: a live worker's status: where it is (``WorkerState``), its step, why it waits.
* ``StepReporter``: restart mode's ``report_step(step)``. A worker outside ``job.steps()`` (a
  framework's loop, a loop of its own, every worker under ``--no-live``) says how many steps it
  finished; the agent reads the same status as a live worker's. Its state is ``running`` from
  the first report on, which is also when the agent's hang watchdog starts watching the worker:
  a worker that never reports is never watched (its script may simply not report).
* ``process_reporter``: the reporter of a worker that has no ``LiveJob`` (``PlainJob`` under
  ``--no-live``, or a script that never calls ``tm_launch.init()``); None without an agent
  (plain torchrun), where reporting does nothing.

A report costs a few list operations; the status is written at most every ``STATUS_INTERVAL``
seconds (one local store round trip), like a live worker's.
"""

from __future__ import annotations

import atexit
import os
import sys
import time

from ..protocol import STATUS_INTERVAL, WorkerEnv, WorkerState, WorkerStatus


class StepStats:
    """Step and compute times for the agent's hang watchdog and straggler statistic."""

    def __init__(self, window: int):
        self.window = max(1, window)
        self.step_times: list[float] = []
        self.compute: list[float] = []
        self.windows: dict[int, float] = {}

    def record(self, step: int, seconds: float, t0: float = 0.0, group=None, steps: int = 1) -> None:
        """``steps`` steps ending with step index ``step`` took ``seconds`` each.

        Compute time = step time minus the wait in the step's last collective (``group``, a
        LiveGroup): peers of a straggler wait for it there, the straggler does not (C4's
        observation). Without a group (restart mode) nothing is known of the wait."""
        waited = 0.0
        if group is not None:
            submit, complete = group.last_submit, group.last_complete
            waited = complete - submit if submit > t0 and complete > submit else 0.0
        self.step_times.append(seconds)
        compute = max(seconds - waited, 0.0)
        self.compute.append(compute)
        window = step // self.window
        self.windows[window] = self.windows.get(window, 0.0) + compute * steps
        for old in [w for w in self.windows if w < window - 3]:
            del self.windows[old]
        if len(self.step_times) > 200:
            del self.step_times[:100], self.compute[:100]

    def median(self) -> float:
        xs = sorted(self.step_times[-20:])
        return xs[len(xs) // 2] if xs else 0.0

    def report(self, step: int | None) -> dict:
        return {
            "step_time": self.median(),
            "step_times": self.step_times[-20:],
            "steps_run": len(self.step_times),
            "compute": self.compute[-20:],
            # completed straggler windows only: {window index: summed compute seconds}
            "windows": {str(w): c for w, c in self.windows.items() if step is not None and (w + 1) * self.window <= step},
        }


class LiveStatus:
    """A live worker's status, written through ``agent`` (an ``AgentClient``): at most every
    ``STATUS_INTERVAL`` seconds, and at once (waking the agent) when ``force``d: a change of
    state, or anything the agent acts on."""

    def __init__(self, agent, stats: StepStats, where, extra=None):
        self.agent = agent
        self.stats = stats
        self._where = where  # () -> (rank, generation, step): read at each write
        self._extra = extra or dict  # () -> more status fields (the snapshots' memory)
        self.state = WorkerState.SANDBOX
        self.waiting_for_peers = False  # in a commit vote that has waited long: the agent probes the peers
        self.why = ""  # what made this process wait for a new generation (its agent says it)
        self._written_at = 0.0

    def set(self, state: WorkerState, force: bool = True) -> None:
        self.state = state
        self.report(force=force)

    def recovering(self, why: str) -> None:
        """Wait for a new generation: tell the agent at once, and why (``failures.FailureWatch``
        reports this node with that reason if no peer was lost and no new generation comes)."""
        self.why = why
        self.set(WorkerState.RECOVERING)

    def slow_vote(self, waiting: bool) -> None:
        """The commit vote waits for a peer longer than a step's skew: tell the agent, which then
        checks whether a peer node died (its agent refuses connections) instead of waiting for
        its lease; a dead peer failed no collective of ours, so nothing else would start that."""
        self.waiting_for_peers = waiting
        self.report(force=True)

    def report(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._written_at < STATUS_INTERVAL:
            return
        self._written_at = now
        rank, generation, step = self._where()
        self.agent.report_status(
            WorkerStatus(
                state=self.state,
                step=step,
                generation=generation,
                rank=rank,
                time=now,
                pid=os.getpid(),
                waiting_for_peers=self.waiting_for_peers,
                why=self.why if self.state == WorkerState.RECOVERING else "",
                **self.stats.report(step),
                **self._extra(),
            ),
            wake=force,
        )


class StepReporter:
    """Restart mode's status, written through ``agent`` (an ``AgentClient``)."""

    def __init__(self, agent, rank: int, generation: int, window: int):
        self.agent = agent
        self.rank, self.generation = rank, generation
        self.stats = StepStats(window)
        self.last: tuple[int, float] | None = None  # the last step reported, and when (perf_counter)
        self.state = WorkerState.STARTED  # what the status says once written: running, finished, exiting
        self.written_at = 0.0
        self.agent_gone = False

    @classmethod
    def from_env(cls, env: WorkerEnv) -> StepReporter:
        from .agent_client import AgentClient

        return cls(AgentClient(env), env.rank, env.generation, env.straggler_window)

    def step(self, step: int) -> None:
        """This worker finished step ``step`` (the global step count: 1 after the first step)."""
        now, step = time.perf_counter(), int(step)
        last = self.last
        if last is not None and step == last[0]:
            return  # a repeated report is not progress
        if last is not None and step > last[0]:
            n = step - last[0]
            self.stats.record(step - 1, (now - last[1]) / n, steps=n)
        self.last = (step, now)  # a step going back (the script reloaded a checkpoint) starts over
        self._write(WorkerState.RUNNING, force=last is None)

    def finished(self) -> None:
        """The loop ran all its steps (``PlainJob.steps``): like a live worker at its end."""
        self._write(WorkerState.FINISHED, force=True)

    def exiting(self) -> None:
        """At interpreter exit: not ``running`` any more, so that the watchdog leaves the process
        alone while it tears down; not ``finished`` either (the script may have raised), so
        that a non-zero exit still counts as a failure."""
        if self.state == WorkerState.RUNNING:
            self._write(WorkerState.EXITING, force=True)

    def _write(self, state: WorkerState, force: bool) -> None:
        now = time.time()
        if self.agent_gone or (not force and now - self.written_at < STATUS_INTERVAL):
            return
        self.state, self.written_at = state, now
        step = self.last[0] if self.last else None
        try:
            self.agent.report_status(
                WorkerStatus(
                    state=state,
                    step=step,
                    generation=self.generation,
                    rank=self.rank,
                    time=now,
                    pid=os.getpid(),
                    mode="restart",
                    collective_timeout=default_group_timeout(),
                    **self.stats.report(step),
                ),
                now=force,  # a state change (finished, exiting) is written before the process goes on
            )
        except Exception:  # the agent is gone: reporting must never break the training loop
            self.agent_gone = True


def default_group_timeout() -> float:
    """Seconds the default group's collectives wait for a peer, as torch set them up (the
    script's ``timeout=``, else the backend's default); 0 when there is no group (yet) or its
    backend does not say. A script that never imported torch.distributed has none."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 0.0
    import torch

    world = dist.group.WORLD
    for device in ("cuda", "cpu"):  # NCCL's, where there is one: what the training waits in
        try:
            return world._get_backend(torch.device(device)).options._timeout.total_seconds()
        except (RuntimeError, AttributeError):
            continue
    return 0.0


_PROCESS: StepReporter | None = None


def process_reporter() -> StepReporter | None:
    """This process's reporter with a client of its own (made on first use, closed at exit);
    None without an agent (plain torchrun)."""
    global _PROCESS
    if _PROCESS is None:
        env = WorkerEnv.from_environ()
        if env.under_agent:
            _PROCESS = StepReporter.from_env(env)
            atexit.register(_close_process_reporter)
    return _PROCESS


def _close_process_reporter() -> None:
    if _PROCESS is not None:
        _PROCESS.exiting()
        _PROCESS.agent.close()  # its heartbeat thread must end before interpreter teardown
