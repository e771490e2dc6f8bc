"""A spare's warm-up, parking and promotion (``Spare``), used by the live job's step loop.

A process that joins a running job (a spare, or a replacement started cold) starts in the
*sandbox*: every group is served by a local backend, and the script builds its model, groups
and optimizer and runs ``--sandbox-steps`` real steps without talking to anyone (kernels,
allocator, the framework's lazy set-up), then parks until a generation names its node. It
warms up as the last node's ranks; promoted to other ranks, it runs the script again from the
top for the ranks it got (``RankChanged``, caught by ``python -m tm_launch.worker``), so
nothing derived from the rank is wrong. What the warm-up leaves in the registered objects is
overwritten when the process enters the job: a joiner always receives its state from a live
replica or a snapshot, so no copy of the start state is kept (a spare costs no extra memory).
"""

from __future__ import annotations

import gc
import os
import sys

from ...protocol import Directive, WorkerState
from .. import torch_patches
from ..comms import communicators
from ..comms.groups import LocalBackend
from ..generation.generations import Generations, Superseded
from ..log import log
from ..snapshots import Snapshots
from ..state.transfer import cpu_copy, human_size
from ..step_report import LiveStatus
from . import cuda_warmup, ddp_rebuild, sharding_decisions


class RankChanged(BaseException):
    """A promoted spare takes ranks other than those it warmed up as: ``tm_launch.worker`` runs
    the script again from the top, for the ranks it got (a BaseException: scripts' ``except
    Exception`` must not swallow it)."""


def freeze_what_exists() -> None:
    """A sandboxed process may run the script again for other ranks (``RankChanged``), which
    then frees the old ranks' objects with a collection on the failover's critical path, and
    looks for DDP instances among the objects the collector tracks (``ddp_rebuild``).
    Everything older than this point (interpreter, torch, the script's imports) is moved out of
    the collector's sight, so that both see only what the script builds. torch._dynamo is
    imported first: DDP's constructor imports it (with inductor and the ONNX exporter, ~50,000
    objects), and left to the script's run those stayed in sight, where the promoted spare's
    collection and its scan cost ~30 ms each. The import costs ~0.7 s here, at the worker's
    start; a script that builds a DDP (or compiles) pays it anyway."""
    import torch._dynamo  # noqa: F401

    gc.collect()
    gc.freeze()


def forget_framework_ranks() -> None:
    """Frameworks that cache this process's rank once per process (accelerate's ``PartialState``
    singleton reads ``dist.get_rank()`` when first built) must read it again when the script
    runs again for other ranks: their state is dropped, the script's next ``Accelerator()``
    builds it anew."""
    accelerate_state = sys.modules.get("accelerate.state")
    if accelerate_state is not None:
        accelerate_state.AcceleratorState._reset_state(reset_partial_state=True)
        accelerate_state.GradientState._reset_state()


class Spare:
    """The sandbox part of a live job. ``job`` gives it what it acts on: the training state, the
    generations, the status, the snapshots, and ``detach(rank)`` (serve every collective locally
    as ``rank``)."""

    def __init__(self, job, sandbox_steps: int, local_rank: int):
        self.job = job
        self.state = job.state
        self.gens: Generations = job.gens
        self.status: LiveStatus = job.status
        self.snapshots: Snapshots = job.snapshots
        self.sandbox_steps = sandbox_steps
        self.local_rank = local_rank
        self.entering: Directive | None = None  # a generation to finish entering once the script re-ran
        self.held: list | None = None  # communicators entered before the loop, used from its first step
        self._held_per_rank: dict | None = None  # the per-rank state received with them

    def enter_before_loop(self) -> None:
        """See ``LiveJob.enter_before_loop``: park here, then enter at once, and serve collectives
        locally until the loop's first step."""
        if self.entering is not None:  # the script ran again for the ranks this spare took
            d, self.entering = self.entering, None
            try:
                self.gens.enter(d)
            except Superseded:
                self.park()
        else:
            self.park()
        self.held = [(g, g.inner) for g in self.state.groups if g.inner is not None and not g.in_process]
        for g, _ in self.held:
            g.swap(LocalBackend(g.rank(), g.size(), keeps_own_objects=True), g.rank(), g.size(), g.generation, keep_old=True)
        self._held_per_rank = {name: cpu_copy(obj.state_dict()) for name, obj in self.state.per_rank.objects.items()}
        self.status.set(WorkerState.ENTERING)

    def use_held(self) -> None:
        """The loop reached its first step: talk to the job through the communicators entered
        before it, with the per-rank state received then (its set-up may have drawn random numbers)."""
        held, self.held = self.held, None
        generation = self.job.generation
        for g, inner in held:
            if g.generation == generation:
                g.swap(inner, g.rank(), g.size(), g.generation)
            else:  # entered again meanwhile: that generation's communicator is not needed any more
                communicators.release(inner)
        for name, state in (self._held_per_rank or {}).items():
            self.state.per_rank.objects[name].load_state_dict(state)
        self._held_per_rank = None

    def enter_if_promoted(self) -> None:
        """The script ran again for the ranks this spare took: enter that generation now."""
        if self.entering is None:
            return
        entering, self.entering = self.entering, None
        try:
            self.gens.enter(entering)
        except Superseded:  # no longer promoted before it got in: a spare again
            self.park()

    def warm_up(self, start: int):
        """Real steps on local backends (kernels, allocator, the framework's lazy set-up):
        ``--sandbox-steps`` of them for a spare that parks next; one for a spare promoted to
        other ranks, which runs the script again for them while the job waits; more while a DDP
        still has first-step work left (a static graph: two), each step followed by DDP's bucket
        rebuild (``spare.ddp_rebuild``). A spare parks after them with its CUDA pools handed
        back; one running the script again for the ranks it was promoted to enters at once and
        keeps them for its first steps."""
        self.status.state = WorkerState.WARMUP
        again = self.entering is not None  # the script runs again for ranks it was promoted to
        if again:  # its new meshes take over DTensor's decisions cached with the old ones
            sharding_decisions.adopt_meshes()
        planned, ran, unsettled = 1 if again else self.sandbox_steps, 0, []
        while ran < planned or (unsettled and ran < ddp_rebuild.MOST_STEPS_TO_SETTLE):
            self.status.report(force=True)
            self.job.guard.start_step()  # its optimizer steps are counted per step (``step_effects``)
            yield start + ran
            ran += 1
            unsettled = ddp_rebuild.settle_now()  # DDP's bucket rebuild now, not in a live step
        if unsettled:  # its first live step will broadcast while its peers all-reduce: said, not hidden
            log.warning(f"{len(unsettled)} DDP(s) still to lay out their buckets after {ran} sandbox steps: a live step will")
        self.state.clear_step_effects()
        if self.entering is not None:  # promoted before these steps: it enters now and trains
            return
        left = cuda_warmup.leave_no_trace()  # None: CUDA never used here
        if left is not None:
            log.info(
                f"warm-up done: CUDA pools released, {human_size(left['allocated'])} allocated "
                f"({human_size(left['reserved'])} reserved) for the model and optimizer"
            )

    def park(self) -> None:
        """A warmed-up spare waits here until a generation names its node."""
        self.status.set(WorkerState.PARKED)
        after = self.job.generation
        while True:
            d = self.gens.directives.wait_after(after, repeat=False)
            if d.stop:
                sys.exit(0)
            if not d.active:
                self.keep_connections_ready(d)
            if d.active:
                os.environ["GROUP_RANK"] = str(-1 if d.group_rank is None else d.group_rank)  # a spare's was -1
            if d.active and d.rank_of(self.local_rank) != self.job.rank:
                self.take_other_ranks(d)
            if d.active:
                try:
                    self.gens.enter(d)
                    return
                except Superseded as newer:  # promoted, then replaced before it got in
                    d = newer.directive
                    self.status.set(WorkerState.PARKED)
            after = d.generation

    def keep_connections_ready(self, d: Directive | None = None) -> None:
        """A spare's connections to the store of the plan it waits beside (``d``; None: the one
        its agent handed over last, if any) and to that store's standby, for the day it is
        promoted: the world communicator, its subgroups, the vote, its abort path and the
        lookup of snapshot servers' addresses (``comms.store_clients``)."""
        if d is None:
            d = self.gens.directives.newest()
            if d is None:
                return
        networked = sum(1 for g in self.state.subgroups if not g.in_process)
        self.gens.builds.clients.prepare([d.store, d.standby], at_least=4 + networked)

    def take_other_ranks(self, d: Directive) -> None:
        """Promoted to ranks this process did not warm up as: drop everything the script built
        for the old ranks and run it again from the top for the new ones (``tm_launch.worker``)."""
        rank = d.rank_of(self.local_rank)
        log.info(f"promoted to rank {rank} (warmed up as rank {self.job.rank}): running the script again for rank {rank}")
        for g in self.state.subgroups:
            torch_patches.unregister(g)
        sharding_decisions.retire_meshes()
        self.state.forget_script()
        self.job.discovery.forget()
        self.snapshots.forget()
        self.job.detach(rank)
        forget_framework_ranks()
        self.entering = d  # still in the sandbox (no peers) until steps() enters generation d
        self.gens.builds.build_ahead(d)  # its world communicator connects while the script runs again
        raise RankChanged(f"promoted to rank {rank}")
