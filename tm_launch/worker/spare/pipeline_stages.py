"""torch's own pipeline stages (``torch.distributed.pipelining``) across a live change.

A ``PipelineStage`` built without ``input_args`` / ``output_args`` does a set-up once, in its
schedule's first ``step()``: a vote with its neighbours (tensor point-to-point), then its
neighbours' tensor shapes by object point-to-point (``_forward_metadata_inference`` /
``_backward_metadata_inference``, ``recv_object_list``), from which it allocates its receive
buffers; the schedule then keeps ``_stage(s)_{forward,backward}_initialized``. A process that
meets a running job (a promoted spare, a replacement) has not done it, its neighbours have: the
joiner's ``recv_object_list`` read their activations as a pickled object's size (a 93 TB
allocation, ``UnpicklingError``) and the job restarted until its restarts ran out.

The rule (``set_up_decision``, pure):

* in the sandbox a schedule's step does not run at all: its set-up needs its neighbours, and a
  spare has none (the local backend's receives would hand it zeros for their shapes). The
  sandbox still warms up everything around it (the model, the optimizer, the script's loop);
* a schedule whose job entered a new generation since its set-up (the world's
  ``LiveGroup.generation``) forgets its set-up and does it again in its next step, on every rank
  together: the survivor beside a joiner redoes what the joiner does for the first time, in the
  same step, so both read what the other sends. A stage's set-up is a pure function of the shapes
  and the module (no state changes: torch runs it under a forked RNG and drops the gradients it
  made), so redoing it changes no number. Ranks whose pipeline group the change kept redo it too:
  a set-up may hold collectives of the stage's data-parallel replicas, which must run on all of
  them or none (torchtitan's loss runs its own backward, and FSDP2 reduces its output layer's
  gradients over ``dp_replicate`` there: a kept replica that skipped the set-up met its
  peer's reduction with another of a different size, "Received data size doesn't match");
* a step whose communication already failed (the step is poisoned, and will run again) may
  fail inside torch's schedule on what the failed receives left (a set-up reading an object from
  a dead neighbour): that failure is dropped, not raised out of the script's loop, with what the
  step left in the schedule (``discard_leftovers``), and the step runs again with every
  microbatch once. The actions it did not get to may hold collectives of groups that did not
  fail (a stage's FSDP gradient reduction over its data-parallel peers, in its last backward),
  which those peers still run: the step is marked abandoned (``StepPoison.abandon``), so the
  rank closes its subgroups at its boundary and their waits end. Any other failure is the
  script's and is raised (the first failed collective's own error among them: the live loop
  then runs the step again); what that step left is discarded before the schedule's next step,
  also where no new generation came between (a script that catches the error and steps on): a
  stage whose FSDP2 reduction raised is left mid-step by FSDP, and its next step starts there.

So a promoted spare's first step costs what its neighbour's does in that step (both do the
set-up once), and nothing of the old generation's point-to-point traffic is read by the new.
"""

from __future__ import annotations

import sys
import weakref

from .. import torch_patches
from ..log import first_line, log

SKIP, REDO, KEEP = "skip", "redo", "keep"
# a schedule's "set-up done" flags: single-stage schedules (GPipe, 1F1B) and multi-stage ones
SET_UP_FLAGS = (
    "_stage_forward_initialized",
    "_stage_backward_initialized",
    "_stages_forward_initialized",
    "_stages_backward_initialized",
)


def set_up_decision(in_sandbox: bool, set_up_at: tuple | None, now: tuple) -> str:
    """What a schedule's next step does with its stages' set-up: ``SKIP`` the whole step (no
    peers to set up with), ``REDO`` it (never done, or done in an older generation: ``set_up_at``
    and ``now`` are the generations of the world and of its stages' groups) or ``KEEP`` it."""
    if in_sandbox:
        return SKIP
    return KEEP if set_up_at == now else REDO


def drops_failure(poisoned: bool) -> bool:
    """A failure out of a schedule's step is dropped (the step runs again) only when the step's
    communication had already failed; otherwise it is the script's own."""
    return poisoned


def stages_of(schedule) -> list:
    return list(schedule._stages) if hasattr(schedule, "_stages") else [schedule._stage]


def group_generations(schedule) -> tuple:
    """The generation of the world and of each stage's process group (-1 for a group that is no
    ``LiveGroup``)."""
    import torch.distributed as dist

    groups = [dist.group.WORLD, *(stage.group if stage.group is not None else dist.group.WORLD for stage in stages_of(schedule))]
    return tuple(getattr(group, "generation", -1) for group in groups)


def stage_group_ranks(schedule) -> set:
    """The global ranks of each stage's process group: its other members hold other stages, so a
    stage's DTensors are no copy of theirs (``state.replicas.pipeline_dims``)."""
    import torch.distributed as dist

    return {frozenset(dist.get_process_group_ranks(stage.group or dist.group.WORLD)) for stage in stages_of(schedule)}


def forget_set_up(schedule) -> None:
    """The schedule does its stages' set-up (vote, shape exchange, buffers) again next step."""
    for flag in SET_UP_FLAGS:
        if hasattr(schedule, flag):
            setattr(schedule, flag, False)


def stand_in_losses(schedule, losses: list | None) -> None:
    """A skipped step of a schedule holding the last stage fills the script's ``losses`` as
    torch would, one per microbatch (zeros: nothing ran), so that a loop summing them
    (torchtitan's ``torch.stack(losses)``) runs in the sandbox too."""
    import torch

    last = [s for s in stages_of(schedule) if s.is_last]
    if losses is None or not last:
        return
    losses[:] = [torch.zeros((), device=last[0].device) for _ in range(schedule._n_microbatches)]


def discard_leftovers(schedule) -> None:
    """What a step that failed part-way left in the schedule and its stages: the last stage's
    losses of the microbatches it got to (torch clears them only at a step's end; the step run
    again then took the dropped step's loss for its first microbatch, whose graph was detached:
    "Trying to use a saved tensor that has been detached in-place"), the receives a runtime
    schedule (interleaved, looped BFS, zero-bubble, ZBV, DualPipeV) posted and never waited on,
    the forward caches, the input gradients and deferred weight gradients not yet sent or run,
    and a stage's FSDP2 state mid-step (``torch_patches.reset_fsdp_after_dropped_step``) with
    the unshards a runtime schedule started or finished for it."""
    schedule._internal_losses.clear()
    for posted in ("fwd_recv_ops", "bwd_recv_ops"):  # the runtime schedules' receives posted, never waited on
        getattr(schedule, posted, {}).clear()  # (left, the step run again fails: "Recv twice for stage_idx=...")
    for unsharding in ("unshard_ops", "unsharded_stages"):  # its FSDP unshards under way or done (the stages reshard below;
        getattr(schedule, unsharding, set()).clear()  # left, the step run again fails: "Unsharding the same stage_idx=0 twice")
    for stage in stages_of(schedule):
        stage.clear_runtime_states()
        for cache in (stage.bwd_cache, stage.backward_state, stage.dw_runner):
            cache.clear()
        torch_patches.reset_fsdp_after_dropped_step(stage.submod)


class PipelineSteps:
    """Every pipeline schedule's ``step`` in a live worker, through ``around`` (installed once
    the script imported ``torch.distributed.pipelining``: the import costs seconds)."""

    def __init__(self, in_sandbox, poisoned, abandon=lambda: None, stage_groups=set, on_new_stage_groups=lambda: None):
        """``abandon()``: this rank leaves the poisoned step part-way (``StepPoison.abandon``);
        ``stage_groups()``: the set this rank's stages' groups are noted in, before each step
        (``TrainingState.pipeline_groups``: who holds a copy of a stage); ``on_new_stage_groups()``
        once it grew (what this rank snapshots is chosen again: a stage sharded across its
        replicas is this rank's own only once its pipeline peers are known not to hold it)."""
        self.in_sandbox, self.poisoned, self.abandon, self.stage_groups = in_sandbox, poisoned, abandon, stage_groups
        self.on_new_stage_groups = on_new_stage_groups
        self._set_up_at: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._left_part_way: weakref.WeakSet = weakref.WeakSet()  # schedules whose last step raised
        self._said_skip = False

    def install_if_used(self) -> None:
        if "torch.distributed.pipelining.schedules" in sys.modules:
            torch_patches.around_every_pipeline_step(self.around)

    def around(self, schedule, step, *args, **kwargs):
        groups, noted = stage_group_ranks(schedule), self.stage_groups()
        if not groups <= noted:
            noted.update(groups)
            self.on_new_stage_groups()
        now = group_generations(schedule)
        decision = set_up_decision(self.in_sandbox(), self._set_up_at.get(schedule), now)
        if decision == SKIP:
            if not self._said_skip:
                log.info(
                    "a pipeline schedule's steps do not run in the sandbox (its stages set up with their neighbours): "
                    "its first live step does; there step() returns None and a last stage's losses are zeros"
                )
                self._said_skip = True
            stand_in_losses(schedule, kwargs.get("losses"))
            return None
        if decision == REDO:
            if schedule in self._set_up_at:
                log.info(
                    f"pipeline stage(s) {[s.stage_index for s in stages_of(schedule)]}: a new generation, set up again with their neighbours"
                )
            forget_set_up(schedule)
            discard_leftovers(schedule)  # a step interrupted without an exception (served locally once its group broke)
            self._set_up_at[schedule] = now
        elif schedule in self._left_part_way:
            discard_leftovers(schedule)  # no new generation since (the script caught the error and stepped on)
        self._left_part_way.discard(schedule)
        try:
            return step(schedule, *args, **kwargs)
        except Exception as e:
            if not drops_failure(self.poisoned()):
                self._left_part_way.add(schedule)  # the script's loop sees it; what it left goes before the next step
                raise
            log.info(
                f"a pipeline step failed after its communication did ({type(e).__name__}: {first_line(e)}): dropped, the step runs again"
            )
            discard_leftovers(schedule)
            self.abandon()  # its actions left undone include collectives of groups that did not fail
            return None
