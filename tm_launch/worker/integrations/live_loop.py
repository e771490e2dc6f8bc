"""Live steps driven from a framework's own step hook (``tm_launch.lightning``, ``tm_launch.huggingface``).

A framework's loop cannot be wrapped in ``job.steps()``, but each framework calls one hook per
optimizer step that contains the step's forward and backward (Lightning's ``optimizer_step``
closure, the HF ``Trainer``'s ``training_step``). ``LiveLoop.run`` makes that hook a live step:
it advances ``job.steps()`` (where a failure is repaired and a new generation entered), runs the
body, takes the commit vote, and runs the body again when the step did not commit, so the
framework's loop never counts a step that was not applied job-wide.
"""

from __future__ import annotations

import sys

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ...protocol import WorkerEnv
from ..log import first_line, log


def live_job():
    """The job (``tm_launch.init()``) when this worker may be repaired in place: under tm-launch
    and not ``--no-live``; None otherwise (torchrun, restart mode)."""
    if not WorkerEnv.from_environ().under_agent:
        return None
    from ..job import entry

    if entry.live_job() is None and dist.is_initialized():
        raise RuntimeError(
            "tm-launch: the process group was started before tm_launch.init(); call tm_launch.init() "
            "first in the script (before TrainingArguments or Accelerator, which start one of their own)"
        )
    job = entry.init()
    return job if job is entry.live_job() else None


class LiveLoop:
    """One framework's training loop as a sequence of live steps (see the module docstring)."""

    def __init__(self, job):
        self.job = job
        self._steps = None  # job.steps(): advanced once per attempt of a step
        self._generation: int | None = None
        self.started: int | None = None  # the step whose first attempt began last
        self.running = False  # inside run(): between the framework's step count and its commit
        self._join_at: int | None = None  # join_at(): the framework step the job's other loops are in

    def run(self, framework_step: int, body, on_new_generation=None, on_new_step=None, at_step=None):
        """One optimizer step of the framework, at its ``framework_step`` (its global step):
        ``on_new_generation()`` before the first attempt in a new generation (this rank stepped
        in an earlier one), ``on_new_step(step)`` before the first attempt of a step, ``body()``
        for each attempt; returns the committed attempt's result.

        ``at_step(step)`` before each attempt, for a framework whose body reads its step count
        from its own state (``tm_launch.torchtitan``), which can then run any step: a spare's
        warm-up steps in the sandbox, then the job's step once it joins; and when survivors
        return to an earlier step (a lost rank's newest snapshot was still on its way), that step
        and those after it run here, each to its commit, until the job is back at
        ``framework_step``. Without it the job's step must be the framework's."""
        if self._steps is None:
            self._steps = self.job.steps(sys.maxsize, start=framework_step)
        if framework_step != self.started:
            # Before steps() runs: a joiner entering there (a planned switch) receives the
            # framework's state as of this step's start.
            if on_new_step:
                on_new_step(framework_step)
            self.started = framework_step
        self.running = True
        try:
            while True:
                step = next(self._steps)
                if step != framework_step and at_step is None:
                    raise RuntimeError(
                        f"tm-launch: the job is at step {step} but the framework at {framework_step}: one "
                        "optimizer step per batch (no gradient accumulation) is required for live mode"
                    )
                if at_step is not None:
                    at_step(step)
                if self._generation is not None and self._generation != self.job.generation and on_new_generation:
                    on_new_generation()
                self._generation = self.job.generation
                try:
                    result = body()
                except Exception as e:
                    if self.job.step_ok:
                        raise
                    # The step was interrupted: the framework met what a failed collective left
                    # (torchtitan stops on a loss that is not finite: the failed all-reduce's
                    # NaN). Not the training's fault; the step runs again.
                    log.info(
                        f"step {step} interrupted; the framework stopped on what its failed collectives left ({first_line(e)}): it runs again"
                    )
                    self.job.abandon_step()  # the rest of its collectives are never run
                    result = None
                if self.job.commit() and step >= max(framework_step, self._join_at or 0):
                    self._join_at = None
                    return result
        finally:
            self.running = False

    def settled(self) -> None:
        """The framework's own work after its last committed step is done (the HF ``Trainer``'s
        logging, evaluation and save): this rank's per-rank state is now what its next step
        starts from, and is mirrored to its holder now, so that a rank lost before that step
        begins is still taken over live (``PerRankState.mirror_settled``). Not in the sandbox,
        and not after a step whose collectives after the commit failed (the next step's start
        mirrors it, as it would without this)."""
        if self._steps is not None and not self.running and not self.job.in_sandbox and self.job.step_ok:
            self.job.guard.mirror_settled()

    def join_at(self, framework_step: int) -> None:
        """A rank joining the job (inside ``run``): the others' loops are in ``framework_step``,
        and so must this one's be when ``run`` returns to the framework, even if the job returned
        to an earlier step (``at_step``): whatever the framework does between its steps
        (torchtitan's checkpoint at an interval step) is then done by every rank at the same step.
        A step this loop is already in or past is no news (a survivor restoring its own snapshot)."""
        if self.started is None or framework_step > self.started:
            self._join_at = self.started = framework_step

    def close(self) -> None:
        """The framework's loop ended: the last step's bookkeeping; the agent sees it finish."""
        if self._steps is not None:
            self.job.end_loop()
            self._steps.close()
            self._steps = None


def new_ddp_like(old: DistributedDataParallel) -> DistributedDataParallel:
    """A new DDP over ``old``'s module, configured as ``old``, without DDP's start-up broadcast.

    For a new generation on every rank that stepped in an earlier one: a DDP that has stepped
    lays its gradient bucket out in backward order, a new one in parameter order until its second
    step (when all adopt rank 0's order, a broadcast). A joining rank's new DDP and a survivor's
    old one would all-reduce buffers laid out differently, element by element: wrong gradients,
    no error. With a new DDP everywhere, every rank lays out and re-buckets the same way at the
    same step. ``old``'s autograd hooks are removed (it must not reduce again)."""
    old._remove_autograd_hooks()
    return DistributedDataParallel(
        old.module,
        device_ids=old.device_ids,
        output_device=old.output_device,
        dim=old.dim,
        process_group=old.process_group,
        bucket_cap_mb=old.bucket_bytes_cap / 2**20,
        find_unused_parameters=old.find_unused_parameters,
        gradient_as_bucket_view=old.gradient_as_bucket_view,
        static_graph=old.static_graph,
        forward_sync_buffers=old.forward_sync_buffers,
        init_sync=False,
    )


def final_only(job, publish):
    """``publish`` (a framework's metrics logger) called only with numbers that are final: not
    in a spare's warm-up (its sandbox steps are not the job's), not in a step that did not commit
    nor one whose collectives after the commit failed (``job.step_ok``: what a failed all-reduce
    left is this rank's garbage, and the step's committed values are logged by nobody rather than
    wrongly). A plain loop does the same with ``if job.step_ok: log(...)`` after its collectives."""

    def final(*args, **kwargs):
        if job.in_sandbox or not job.step_ok:
            return None
        return publish(*args, **kwargs)

    final.__wrapped__ = publish
    return final
