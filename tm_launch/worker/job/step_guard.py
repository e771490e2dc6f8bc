"""A step's effects wait for its job-wide commit: the vote asked at the step's first effect,
and again before each later optimizer step of the same step (``step_effects``).

The vote itself is ``generation.commit`` (through the generation's store); this is where a
step asks for it. An optimizer's step (torch's global pre-hook: every optimizer, registered or
not, is checked), an LR scheduler's ``step`` and a GradScaler's ``update`` (their classes
guarded at ``register``) run only on a step that commits; on one that does not, the
optimizer's gradients are dropped so torch leaves parameters and state untouched, and the step
runs again with nothing applied. Where a later optimizer step's vote fails after earlier ones
applied, those are rolled back from the start-of-step copy (``step_effects``), or, without one,
live mode ends loudly before the effect applies.
"""

from __future__ import annotations

import torch

from .. import torch_patches
from ..generation.directives import Directives
from ..generation.state_exchange import StateLost
from ..log import log
from ..snapshots import Snapshots
from ..state.ddp_tp import LocalizedTP, localized_parameters
from ..state.zero import ZeroPartition, is_zero
from .step_effects import EffectCount, StartOfStep

_SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


class StepGuard:
    def __init__(self, state, directives: Directives, snapshots: Snapshots, generation):
        self.state = state  # the worker's TrainingState
        self.directives = directives
        self.snapshots = snapshots
        self._generation = generation  # () -> the generation this worker trains in
        self.in_step = False  # inside the body of a step of ``job.steps()``
        self.boundary_ok = True  # the step's start went as it should (its per-rank mirror reached the holder)
        self.effects = EffectCount()  # optimizer steps per step, learned
        self.start_copy = StartOfStep()  # multi-effect steps: the state before the first one applied
        self.on_lost = None  # (StateLost) -> None: ends live mode (``LiveJob._state_lost``); set by the job
        self._undone = False  # this step's earlier effects were rolled back already
        self.on_decision = None  # (committed) -> None, once the step's vote is decided (``job.discovery``)

    def start_step(self) -> None:
        """The top of a step (the sandbox's too): nothing applied yet."""
        self.effects.start()
        self.start_copy.drop()
        self._undone = False

    def install(self) -> None:
        torch_patches.before_every_optimizer_step(self.before_optimizer_step)

    def guard(self, obj, rank: int):
        """``register``: guard what ``obj`` steps; returns what to carry for it and who else
        holds it (``None``: as declared). A ZeRO optimizer is carried as this rank's partition, a
        module whose tensor-parallel parameters DDP localized with those parameters as DTensors
        (``state.ddp_tp``)."""
        scheduler = _wrapped(obj, "scheduler", _SCHEDULERS)  # accelerate's AcceleratedScheduler steps the one it wraps
        if scheduler is not None:
            torch_patches.guard_method(scheduler, "step", self.effect_allowed, None)
        elif isinstance(obj, torch.amp.GradScaler):
            torch_patches.guard_method(obj, "update", self.effect_allowed, _reset_scaler)
        elif is_zero(obj):  # each rank's own partition: held by this rank alone
            return ZeroPartition(obj), (rank,)
        elif isinstance(obj, torch.nn.Module):
            localized = localized_parameters(obj)
            if localized:
                return LocalizedTP(obj, localized), None
        return obj, None

    def effect_allowed(self) -> bool:
        """The current step's job-wide decision (voted on first use); outside a step, True."""
        if not self.in_step:
            return True
        state = self.state
        if state.commit.decision is None:
            for g in state.groups:
                g.settle()
            state.poison.release_broken()  # peers blocked in a failed communicator fail now, before the vote waits
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()  # a step commits only once its GPU work is complete
            if not self.boundary_ok:
                state.poison.set(RuntimeError("the step's per-rank state did not reach its snapshot holder (it is gone)"))
            ok = not state.poison.active
            generation = self._generation()
            if (
                not state.commit.decide(
                    ok,
                    lambda: self.directives.newest_generation() > generation,
                    self._before_vote_counts,
                    peer_gone=self.peer_gone,
                )
                and ok
            ):
                state.poison.set(RuntimeError("the step did not commit: a peer failed before voting"))
        if self.on_decision is not None:
            self.on_decision(bool(state.commit.decision))
        return bool(state.commit.decision)

    def _before_vote_counts(self) -> bool:
        """What must be true before this rank's vote counts (the voter thread runs it): the
        step's snapshot is complete here and on the holder, and the per-rank state after the step
        is on the holder (a joiner that replaces this rank starts from it)."""
        step = self.state.commit.step
        if not self.snapshots.ready_to_commit(step, give_up=self.peer_gone):
            return False
        mirror = self.state.per_rank.vote_mirror(step)
        return mirror is None or self.snapshots.publish_mirror(*mirror)

    def mirror_settled(self) -> None:
        """Between two steps of a framework's loop (``LiveLoop.settled``): the per-rank state after
        the committed step's bookkeeping, mirrored as the next step's start
        (``PerRankState.mirror_settled``; a mirror that did not reach the holder is sent again at
        that start, as without this)."""
        commit = self.state.commit
        if commit.step == self.state.step and commit.decision:
            self.state.per_rank.mirror_settled(commit.step + 1, self.snapshots.publish_mirror)

    def peer_gone(self) -> bool:
        """The agent handed over a newer generation because a peer is gone (not a planned switch)."""
        return self.directives.peer_gone_after(self._generation())

    def before_optimizer_step(self, optimizer, args, kwargs):
        """Every optimizer's step asks for the commit; on a step that did not commit its
        gradients are dropped, so torch's optimizers leave parameters and state untouched. A
        later optimizer step of a step whose earlier ones committed votes again; in a step known
        to have several, the registered state is copied just before the first one applies."""
        if self.state.in_sandbox:  # counted all the same (``Spare.warm_up``): a joiner knows its steps' effects
            self.effects.applied()
            return None
        if not self.in_step:
            return None
        if not any(optimizer is obj for obj in self.state.carried()):
            raise RuntimeError(
                f"tm-launch: an optimizer ({type(optimizer).__name__}) stepped in job.steps() but is not registered: a rank "
                "that joins would not receive its state. Register it: job.register(optimizer=opt)"
            )
        commit = self.state.commit
        later = self.effects.this_step > 0
        if later and commit.decision:
            commit.next_vote()
        if self.effect_allowed():
            if not later and self.effects.several:
                self.start_copy.take(self.state.objects)
            self.effects.applied()
            return None
        if later and not self._undone:
            self._undo(optimizer)
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        return None

    def _undo(self, optimizer) -> None:
        """A later optimizer step of this step cannot commit after earlier ones applied: every
        rank gets here at the same vote. Roll them back (the step runs again from its start),
        or, with no copy of that start, end live mode before this effect applies."""
        self._undone = True
        step, done = self.state.commit.step, self.effects.this_step
        if self.start_copy.held:
            self.start_copy.restore(self.state.objects)
            log.info(
                f"step {step}: optimizer step {done + 1} ({type(optimizer).__name__}) could not commit after {done} applied; "
                f"rolled back to the step's start, it runs again"
            )
            return
        lost = StateLost(
            f"step {step}: optimizer step {done + 1} ({type(optimizer).__name__}) could not commit after {done} had been "
            f"applied (a peer failed between them), and this rank kept no copy of the step's start (its steps were not "
            f"known to have several optimizer steps yet)",
            step,
            [self.state.rank],
        )
        if self.on_lost is None:
            raise lost
        self.on_lost(lost)


def _wrapped(obj, attr: str, kind):
    """``obj`` if it is a ``kind``, else the ``kind`` a framework's wrapper holds as ``obj.<attr>``."""
    if isinstance(obj, kind):
        return obj
    inner = getattr(obj, attr, None)
    return inner if isinstance(inner, kind) else None


def _reset_scaler(scaler) -> None:
    """A skipped ``GradScaler.update()`` must still forget the step's per-optimizer records, or
    the step's re-run fails with 'step() has already been called since the last update()'."""
    from collections import defaultdict

    from torch.amp.grad_scaler import _refresh_per_optimizer_state

    scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
