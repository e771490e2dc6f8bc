"""What a worker tells its agent about its steps (``worker/<local rank>/status`` in the agent's
store): read by the hang watchdog, the straggler statistic, ``ctl status`` and ``ctl timeline``.

* ``StepStats``: step and compute times. A live worker records every committed step.
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
import time

STATUS_INTERVAL = 0.25  # seconds between two status writes of one worker


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
            "step_time": self.median(), "step_times": self.step_times[-20:], "steps_run": len(self.step_times),
            "compute": self.compute[-20:],
            # completed straggler windows only: {window index: summed compute seconds}
            "windows": {str(w): c for w, c in self.windows.items() if step is not None and (w + 1) * self.window <= step},
        }


class StepReporter:
    """Restart mode's status, written through ``agent`` (an ``AgentClient``)."""

    def __init__(self, agent, rank: int, generation: int, window: int):
        self.agent = agent
        self.rank, self.generation = rank, generation
        self.stats = StepStats(window)
        self.last: tuple[int, float] | None = None  # the last step reported, and when (perf_counter)
        self.state = "started"  # what the status says once written: running, finished, exiting
        self.written_at = 0.0
        self.agent_gone = False

    @classmethod
    def from_env(cls, env) -> "StepReporter":
        from .agent_client import AgentClient

        return cls(AgentClient(env), int(env.get("RANK", 0)), int(env.get("TM_GENERATION", 0)),
                   int(env.get("TM_STRAGGLER_WINDOW", "20")))

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
        self._write("running", force=last is None)

    def finished(self) -> None:
        """The loop ran all its steps (``PlainJob.steps``): like a live worker at its end."""
        self._write("finished", force=True)

    def exiting(self) -> None:
        """At interpreter exit: not ``running`` any more, so that the watchdog leaves the process
        alone while it tears down; not ``finished`` either (the script may have raised), so
        that a non-zero exit still counts as a failure."""
        if self.state == "running":
            self._write("exiting", force=True)

    def _write(self, state: str, force: bool) -> None:
        now = time.time()
        if self.agent_gone or (not force and now - self.written_at < STATUS_INTERVAL):
            return
        self.state, self.written_at = state, now
        step = self.last[0] if self.last else None
        try:
            self.agent.set("status", {
                "step": step, "generation": self.generation, "state": state, "rank": self.rank, "time": now,
                "pid": os.getpid(), "mode": "restart", **self.stats.report(step),
            })
        except Exception:  # the agent is gone: reporting must never break the training loop
            self.agent_gone = True


_PROCESS: StepReporter | None = None


def process_reporter() -> StepReporter | None:
    """This process's reporter with a client of its own (made on first use, closed at exit);
    None without an agent (plain torchrun)."""
    global _PROCESS
    if _PROCESS is None and os.environ.get("TM_AGENT_STORE"):
        _PROCESS = StepReporter.from_env(os.environ)
        atexit.register(_close_process_reporter)
    return _PROCESS


def _close_process_reporter() -> None:
    if _PROCESS is not None:
        _PROCESS.exiting()
        _PROCESS.agent.close()  # its heartbeat thread must end before interpreter teardown
