"""``LiveJob``'s side of the state found without registration (``state.discovered``) and of the
loop's own variables (``state.loop_variables``): found when a loop over ``job.steps()`` begins,
adopted as if registered, put back when a step runs again.

Kept apart from ``live`` so that the step loop holds three calls: ``at_loop_start`` (find and
adopt), ``begin_step`` and ``end_step`` (the rollback), plus the vote's ``at_decision``.
"""

from __future__ import annotations

from .. import rehearsal_dump
from ..generation.state_exchange import StateLost
from ..log import log
from ..state.discovered import Rollback, describe, find, frame_variables, script_frame
from ..state.loop_variables import LoopVariables

LOOP = "tm:loop"  # the per-rank entry of the loop's variables


class Discovery:
    def __init__(self, job):
        self.job = job
        self.registered: list = []  # the objects the script passed to register(), as it passed them
        self.excluded: list = []  # register(exclude=[...])
        self.found: list = []
        self.rollback = Rollback([])
        self._said: set = set()  # the log lines already written (each once per process)

    def at_loop_start(self, here) -> None:
        """``here``: a frame inside ``steps()``; the script's loop frame is its first caller
        outside tm-launch (None under a framework's loop: it registers what it holds)."""
        job, state = self.job, self.job.state
        frame = script_frame(here)
        if frame is None:
            return
        covered = [*self.registered, *state.carried(), *state.per_rank.objects.values(), *(f.obj for f in self.found)]
        new = find(frame_variables(frame), covered, self.excluded)
        for f in new:
            name = f.name if f.name not in state.objects else f"{f.name}~found"
            f.name = name
            carried, holders = job.guard.guard(f.obj, job.rank)
            state.objects[name] = carried
            state.declared[name] = holders
            # Its buffers travel with it, not as per-rank state: an EMA's ``n_averaged`` moves
            # after the vote on every rank alike, and per-rank state that moves there leaves no
            # exact mirror for a rank lost after its commit. Buffers that differ by rank (a found
            # model in training with BatchNorm) show in the audit, loud.
        self.found += new
        self.rollback = Rollback(self.found)
        loop = LoopVariables(frame, skip=set())
        state.per_rank.objects[LOOP] = loop
        self._say(describe(new) if new else None)
        self._say(loop.not_carried())

    def forget(self) -> None:
        """The script runs again from the top (a spare promoted to other ranks): what it
        registered, excluded and kept before is dropped, not kept alive."""
        self.registered, self.excluded, self.found = [], [], []
        self.rollback = Rollback([])
        rehearsal_dump.REGISTRY.forget_run()  # under tm-launch rehearse: its record of the first run holds that run's frame

    def begin_step(self) -> None:
        if self.rollback:
            self.rollback.begin_step()

    def at_decision(self, committed: bool) -> None:
        if self.rollback:
            self.rollback.at_decision(committed)

    def end_step(self, committed: bool, step: int) -> None:
        """After the body: objects put back when the step runs again; one that cannot be ends
        live mode (``StateLost``: every worker restarts from the script's checkpoint, loud)."""
        if not self.rollback:
            return
        first = not self.rollback.watched[0].history
        self.rollback.end_step(committed)
        if self.rollback.lost:
            raise StateLost(
                f"step {step} runs again, but {', '.join(self.rollback.lost)} changed before its vote failed and was not copied "
                "at the step's start (it had changed only after the commit until now)",
                step,
                [self.job.rank],
            )
        if first and committed:
            self._say("after the first step: " + self.rollback.policies())

    def _say(self, line: str | None) -> None:
        if line is None or line in self._said or self.job.in_sandbox:
            return
        self._said.add(line)
        if self.job.rank == 0:
            log.info(line)
