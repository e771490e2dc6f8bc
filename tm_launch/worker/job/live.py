"""``LiveJob``: the live API (``job.register()``, ``job.steps()``) and its step loop.

Under tm-launch (live mode) each worker talks only to its own agent (``agent_client``). Lifecycle:

* **fresh start** (generation 0 or a full restart, ``TM_SANDBOX=0``): ``init`` joins the
  generation's communicator at once, like ``init_process_group``. ``init(backend=...)`` picks the
  devices every group of the job serves (``communicators.devices_for``: gloo for CPU tensors,
  NCCL too for CUDA tensors; by default NCCL whenever CUDA is usable, as torch does).
* **sandbox** (spares, and any process that joins a running job): ``init`` gives every group a
  local backend; the script builds its model, groups and optimizer and runs ``--sandbox-steps``
  real steps without talking to anyone, then parks in ``steps()``. A spare warms up as the last
  node's ranks; promoted to other ranks, it runs the script again from the top for the ranks it
  got (``RankChanged``, caught by ``tm_launch.worker``), so nothing derived from the rank is wrong.
  After its steps it hands what they left in the CUDA allocator back to the driver
  (``cuda_warmup.leave_no_trace``; nothing on a CPU job).
* **a step** is all or nothing job-wide (``commit``): the vote is taken at its first effect
  (an optimizer, scheduler or scaler step) or at the end of the body, and the step counter moves
  exactly when the step committed. A failure before the commit re-runs the step with nothing
  applied; a failure after it (a logging collective) does not run it again.
* **enter** a generation (``generations``): rebuild the communicators whose membership changed,
  agree on the newest committed step, and the ranks behind receive their own state from a live
  replica of the same shard (``replicas``, ``transfer``).

A framework's loop cannot be wrapped in ``job.steps()``: its integration (``tm_launch.worker.integrations.live_loop``,
used by ``tm_launch.lightning`` and ``tm_launch.huggingface``) advances ``steps()`` from the
framework's step hook, and ``enter_before_loop()`` lets its spare enter before the loop runs, so
the framework resumes its own loop from the state received.

A worker is *live* (its failures are repaired in place) once it runs ``job.steps()``; until
then, and for scripts that never call it, failures restart every worker (restart mode).
Under plain torchrun, or with ``tm-launch --no-live``, ``init`` is ``init_process_group`` and
``steps`` is ``range`` (a ``PlainJob``; ``--no-live`` sets ``TM_NO_LIVE=1``, so it never goes live).

**Restart mode's progress**: a loop of its own (a framework's, or any plain loop) calls
``job.report_step(step)`` after each step, ``step`` being the global step count it keeps (1
after the first step), or ``tm_launch.report_step(step)`` when it never calls ``init``. The
agent then sees what it sees of a live worker: ``ctl status`` shows the step, ``ctl timeline``
draws the steps and each restart's downtime, and the hang watchdog kills the worker when it
stops (limit from the reported step times; a worker that never reports is never watched). A
report costs a few list operations, the status is written at most every 0.25 s
(``tm_launch.worker.step_report``). Inside ``job.steps()`` it does nothing (the live loop counts), a
``PlainJob``'s ``steps()`` reports by itself under ``--no-live``, and under plain torchrun
reporting does nothing.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import signal
import sys
import time

import torch.distributed as dist

from ...protocol import EXIT_REFUSED, EXIT_STATE_LOST, FirstStepRecord, RefusedRecord, StateLostRecord, WorkerEnv, WorkerState
from .. import torch_patches
from ..agent_client import AgentClient
from ..api import Job
from ..comms import communicators, telemetry
from ..comms.groups import FAKE_NAMES, LiveGroup, LocalBackend, StepPoison, asks_fake, in_process_backend, keep_out_of_graphs, unique_name
from ..generation.audit import Audit
from ..generation.commit import StepCommit
from ..generation.generations import Generations, StateLost
from ..generation.replica_survey import ReplicaSurvey
from ..log import log
from ..snapshots import Snapshots
from ..snapshots.service import SnapshotRefused
from ..spare import sharding_decisions
from ..spare.pipeline_stages import PipelineSteps
from ..spare.sandbox import Spare, freeze_what_exists
from ..state import data_loaders
from ..state.loop_loaders import LoopLoaders
from ..state.per_rank import PerRankState
from ..step_report import LiveStatus, StepReporter, StepStats
from . import optimizer_steps
from .discovery import Discovery
from .step_guard import StepGuard
from .training_state import TrainingState

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its agent dies: a dead node must not keep ranks."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def _replica_ranks(replicas, world: int):
    """``register(replicas=...)``: a group, a DeviceMesh (its ranks) or ranks; None: the world."""
    if replicas is None:
        return None
    if isinstance(replicas, LiveGroup):
        return tuple(range(world)) if replicas.member_ranks is None else replicas.member_ranks
    if hasattr(replicas, "mesh") and hasattr(replicas, "mesh_dim_names"):
        return tuple(int(r) for r in replicas.mesh.flatten().tolist())
    if isinstance(replicas, dist.ProcessGroup):
        return tuple(dist.get_process_group_ranks(replicas))
    return tuple(int(r) for r in replicas)


class LiveJob(Job):
    """A worker that survives its peers: substitution happens inside ``steps()``."""

    def __init__(self, env: WorkerEnv, backend: str | None = None, rng_per_rank: bool = True):
        overridden = communicators.live_process_environment()  # first: before this process starts threads
        if overridden and env.local_rank == 0:
            log.info(overridden)
        die_with_parent()
        self.local_rank = env.local_rank
        # Every group of the job serves these devices (an unusable choice raises before anything starts).
        self.devices = communicators.job_devices(backend, self.local_rank)
        self._c10d_names = communicators.c10d_names(self.devices)
        self.agent = AgentClient(env)
        self.node = env.node_id
        world = env.world_size
        # A spare warms up as the last node's ranks: rank-0-only side effects of the script's
        # set-up stay with the real rank 0, and a failed last node needs no second set-up.
        spare = env.starts_as_spare
        rank = world - env.local_world_size + self.local_rank if spare else env.rank
        poison = StepPoison()
        world_group = LiveGroup(None, rank, world, poison, name=unique_name(None), backend=self._c10d_names)
        self.state = TrainingState(
            world=world_group,
            poison=poison,
            commit=StepCommit(),
            stats=StepStats(env.straggler_window),
            per_rank=PerRankState(rng=rng_per_rank),
        )
        self.snapshots = Snapshots(
            env.local_addr,
            env.snapshot_every,
            env.snapshot_memory_limit,
            env.local_world_size,
            overlap_send=env.snapshot_send == "overlap",
            parity=env.snapshot_parity,
        )
        self.status = LiveStatus(
            self.agent,
            self.state.stats,
            lambda: (self.rank, self.generation, self.state.step),
            extra=lambda: {
                "snapshot_bytes": self.snapshots.nbytes,
                "snapshot_sent": self.snapshots.bytes_sent,
                "snapshot_held": self.snapshots.server.nbytes,
            },
        )
        self.state.commit.on_slow_vote = self.status.slow_vote
        self._restart_steps: StepReporter | None = None  # report_step() outside job.steps() (restart mode)
        self._live_marked = False
        self._first_step_gen = -1  # the generation whose first completed step was reported
        self._loop_ended = False  # end_loop(): a closed steps() generator means finished, not left
        self.detach(rank)
        keep_out_of_graphs()  # torch.compile: a graph break where a LiveGroup's collective is issued
        torch_patches.route_new_group(self.new_group)
        torch_patches.batch_p2p_through_live_groups()
        sharding_decisions.track_meshes()
        # Imported now, not on the recovery path: the replica sets and the transfer read DTensor
        # layouts, and the module's first import costs ~0.5-0.9 s on a loaded 2-core machine.
        import torch.distributed.tensor  # noqa: F401

        if env.sandbox:
            freeze_what_exists()
        torch_patches.refuse_rooted_objects_without_peers()
        # A DataLoader the script iterates itself is kept exact like job.data()'s (state.loop_loaders).
        loops = LoopLoaders(
            lambda: self.state.per_rank,
            lambda: self.guard.in_step,
            self._refused,
            log.info,
            between_steps=lambda: self.status.state is WorkerState.RUNNING and not self.guard.in_step and not self.in_sandbox,
        )
        torch_patches.route_loader_iteration(loops.iterate)
        self.gens = Generations(self.state, self.agent, self.status, env, self.devices, self.snapshots)
        self.guard = StepGuard(self.state, self.gens.directives, self.snapshots, lambda: self.generation)
        self.guard.install()
        self.guard.on_lost = self._state_lost
        self.discovery = Discovery(self)  # state the script keeps and never registered, found at the first step
        self.guard.on_decision = self.discovery.at_decision
        self.spare = Spare(self, env.sandbox_steps, self.local_rank)
        self.pipeline_steps = PipelineSteps(
            lambda: self.in_sandbox,
            lambda: self.state.poison.active,
            self.abandon_step,
            lambda: self.state.pipeline_groups,
            lambda: self.gens.exchange.choose_snapshots_again(self.rank, self.world_size),
        )
        self.audit = Audit(self.state, self.gens.exchange, env.audit_every)
        self.survey = ReplicaSurvey(self.state)
        if spare:  # opened while it warms up, not in the moment it is promoted
            self.spare.keep_connections_ready()
        atexit.register(self._close)
        self.agent.watch(self.gens.on_directive)
        if not env.sandbox:
            # Every rank of this generation starts here, like init_process_group: DDP's own
            # broadcast from rank 0 makes the state consistent, nothing to agree on.
            self.gens.enter(self.gens.directives.wait_after(env.generation - 1), agree=False)
            self.state.fresh_generation = self.generation  # nothing received: the audit has nothing to check here
        self.status.report(force=True)

    def detach(self, rank: int) -> None:
        """Serve every collective locally (sandbox, or a script re-running for its new ranks)."""
        world = self.group.size()
        self.group.swap(LocalBackend(rank, world), rank, world, self.generation)
        torch_patches.install_world(self.group)
        os.environ.update(RANK=str(rank), ROLE_RANK=str(rank))

    def _close(self) -> None:
        """Release communicators and store clients before interpreter teardown: C++ threads
        (gloo, TCPStore) destroyed during teardown abort the process (SIGABRT)."""
        self.agent.close()
        self.snapshots.close()
        self.gens.close()
        for g in [*self.state.subgroups, self.group]:
            g.swap(None, g.rank(), g.size(), g.generation)
        self.state.commit.use(None, 0, 1, -1)
        gc.collect()
        communicators.wait_released()  # an NCCL group torn down by interpreter shutdown aborts the process

    # -- public API ----------------------------------------------------------------------------
    @property
    def group(self) -> LiveGroup:
        """The world group: hand it to DDP/FSDP; it stays the same object across generations."""
        return self.state.world

    @property
    def in_sandbox(self) -> bool:
        """Still warming up without peers (a spare, or a process joining a running job)."""
        return self.state.in_sandbox

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def world_size(self) -> int:
        return self.group.size()

    @property
    def generation(self) -> int:
        return self.group.generation

    def abandon_step(self) -> None:
        """Code driving the step (torch's pipeline schedule, a framework's step) left the
        interrupted step part-way, dropping what it raised: its remaining collectives never run,
        so this rank closes its subgroups at the boundary (``StepPoison.abandon``)."""
        self.state.poison.abandon()

    @property
    def step_ok(self) -> bool:
        """False while the current step is interrupted: it did not commit (it will run again) or
        a collective after its commit failed (what it logs may be this rank's value only)."""
        return not self.state.poison.active and self.state.commit.decision is not False

    def register(self, replicas=None, per_rank: bool = False, exclude=(), **objects) -> None:
        """Objects with state_dict()/load_state_dict() that a joining rank must receive.

        ``replicas``: the ranks holding identical copies of these objects' plain tensors (a
        group, a DeviceMesh or ranks; default the world). DTensors (FSDP2, tensor parallel)
        carry their own layout. Optimizers skip their update on a step that does not commit;
        LR schedulers and GradScaler updates are guarded the same way.

        An object may carry others' state (a framework's whole checkpoint): its ``parts()``
        lists those modules and optimizers, which then may step and are cleared as registered
        ones are; a wrapper's ``.optimizer``/``.scheduler`` (accelerate's) is found by itself.

        ``per_rank=True``: state this rank alone advances in every step (``tm_launch.RNGState()``,
        a sampler's or loader's position): restored when a step runs again, and mirrored so that
        a rank that joins in its place continues from it (``tm_launch.worker.state.per_rank``).

        ``exclude=[obj, ...]``: objects the runtime would find by itself at the first step (an EMA,
        a second optimizer, a GradScaler, any ``Stateful``: ``state.discovered``) that are not
        this rank's training state; they are neither carried nor put back."""
        self.discovery.excluded += list(exclude)
        self.discovery.registered += list(objects.values())
        why = data_loaders.refuse_registered(objects)
        if why:
            self._refused(data_loaders.DataRefused(why))
        if per_rank:
            self.state.per_rank.add(objects)
            return
        for name, obj in objects.items():
            carried, holders = self.guard.guard(obj, self.rank)
            self.state.objects[name] = carried
            self.state.declared[name] = holders if holders is not None else _replica_ranks(replicas, self.world_size)
            self.state.per_rank.add_buffers_of(name, obj)  # per-rank, whatever the layout: ModuleBuffers

    def data(self, loader) -> data_loaders.Batches:
        """``batches = job.data(loader)``, then ``next(batches)`` once per step: a step that runs
        again gets its first attempt's batch, a joiner goes on at the lost rank's epoch and
        position (per-rank state; ``state.data_loaders``). A loader that cannot be made exact
        fails the job with one line saying what to do."""
        try:
            batches = data_loaders.Batches(loader)
        except data_loaders.DataRefused as refused:
            self._refused(refused)
        self.state.per_rank.objects[data_loaders.name_for(self.state.per_rank.objects)] = batches
        return batches

    def new_group(self, ranks, backend=None) -> LiveGroup:
        """A subgroup (TP/PP/DP style) that is rebuilt only when one of its ranks is replaced.
        ``dist.new_group`` and ``init_device_mesh`` come here too in live mode. A group of one
        member, or one asked for with torch's "fake" backend, is served in the process for good
        (``groups.in_process_backend``)."""
        ranks = tuple(range(self.world_size)) if ranks is None else tuple(sorted(int(r) for r in ranks))
        me = self.rank
        # Every rank creates every group in the same order (torch's rule for new_group), so the
        # n-th group of the same ranks is the same group everywhere: its own key in the store
        # (torchtitan's flattened meshes make several groups of the same ranks, whose set-ups
        # must not meet).
        same = sum(1 for g in self.state.subgroups if g.member_ranks == ranks)
        local = in_process_backend(ranks.index(me), len(ranks), backend) if me in ranks else None
        sub = LiveGroup(
            ranks,
            ranks.index(me) if me in ranks else -1,
            len(ranks),
            self.state.poison,
            name=unique_name(ranks),
            backend=FAKE_NAMES if asks_fake(backend) else self._c10d_names,
            store_key="sub-" + "-".join(map(str, ranks)) + (f"+{same}" if same else ""),
            in_process=local is not None,
        )
        if local is not None:
            sub.swap(local, ranks.index(me), len(ranks), self.generation)
        elif me in ranks:
            if isinstance(self.group.inner, LocalBackend):
                sub.swap(LocalBackend(sub.rank(), len(ranks)), sub.rank(), len(ranks), -1)
            else:
                sub.swap(
                    self.gens.builds.build(ranks, me, self.generation, key=sub.store_key), ranks.index(me), len(ranks), self.generation
                )
        self.state.subgroups.append(sub)
        torch_patches.register(sub, ranks)
        return sub

    def commit(self) -> bool:
        """Take the current step's job-wide vote now (it is taken anyway at the first optimizer,
        scheduler or scaler step, or at the end of the body); True when the step committed.
        Guard effects of your own with it: ``if job.commit(): write_metrics()``."""
        return self.guard.effect_allowed()

    def checkpointing(self):
        return telemetry.checkpointing()

    def enter_before_loop(self) -> None:
        """For loops that put themselves back at the right step from the state they receive
        (framework integrations such as ``tm_launch.lightning``, which resume through the
        framework's own checkpoint restore): a spare parks here, before its loop has run, until
        a generation names it; it then enters at once, receiving the registered state, and serves
        its collectives locally until its loop's first step in ``steps()``, so that what the
        framework does on resuming (DDP's construction, a barrier) talks to no one. Such a spare
        runs no warm-up steps: the framework's loop must not run before it knows its position.
        A worker that is already in the job returns at once."""
        if not self.in_sandbox:
            return
        try:
            self.spare.enter_before_loop()
        except StateLost as lost:  # as in steps(): every worker restarts from the checkpoint
            self._state_lost(lost)

    def report_step(self, step: int) -> None:
        """Restart mode (a loop of its own, not ``job.steps()``): this worker finished step
        ``step``, the global step count its script or framework keeps (1 after the first step).
        The agent shows it (``ctl status``, ``ctl timeline``) and watches the worker for hangs
        from the first report on (``tm_launch.worker.step_report``). Inside ``job.steps()``, and in the
        sandbox, it does nothing: the live loop counts its own steps."""
        optimizer_steps.the_script_reports()
        self.report_finished_step(step)

    def report_finished_step(self, step: int) -> None:
        if self._live_marked or self.in_sandbox:
            return
        if self._restart_steps is None:
            reporter = self._restart_steps = StepReporter(self.agent, self.rank, self.generation, self.state.stats.window)
            atexit.register(lambda: self._live_marked or reporter.exiting())  # before _close closes the client
        self._restart_steps.step(step)

    def steps(self, total: int, start: int = 0):
        """Yield the next step to run; membership changes take effect between steps. Closing
        the generator (``close()``, for loops that end on their own) finishes the step in
        flight as the end of its body would. The agent counts the worker *finished* when the
        steps ran out or the loop said it ended (``end_loop``); a generator closed otherwise was
        *left*: by a ``break``, or by an exception out of the loop body, which Python reports
        to the generator the same way (``GeneratorExit``, often only at interpreter teardown).
        A worker that left and then exits non-zero failed (found on a GPU: every rank's AdamW
        raised in its first step and the job ended "successfully")."""
        try:
            yield from self._live_steps(total, start)
        except StateLost as lost:
            self._state_lost(lost)
        except SnapshotRefused as refused:
            self._refused(refused)

    def _live_steps(self, total: int, start: int):
        spare = self.spare
        self.discovery.at_loop_start(sys._getframe())  # before a spare's warm-up: it receives these objects too
        self.pipeline_steps.install_if_used()  # torch's pipeline schedules across live changes (spare.pipeline_stages)
        if self.in_sandbox:
            # A spare warms up, and warms up again as the ranks it was promoted to: real steps
            # without peers, so that the framework's lazy set-up is done before this process
            # meets the job (DDP rebuilds its buckets with a broadcast in its second step; a
            # fresh DDP would send it while its peers run a normal step: tm_launch.worker.spare.ddp_rebuild).
            yield from spare.warm_up(start)
            if spare.entering is None:
                spare.park()
        spare.enter_if_promoted()
        if spare.held is not None:
            spare.use_held()
        state = self.state
        if state.step is None:
            state.step = start
        if not self._live_marked:
            self.agent.mark_live()  # the agent repairs this job in place from now on
            self._live_marked = True
            optimizer_steps.the_script_reports()  # the live loop counts its steps
        self.status.state = WorkerState.RUNNING
        closing = False
        while True:
            self.gens.at_boundary()
            if state.step >= total:
                break
            t0 = time.perf_counter()
            self.group.last_submit = 0.0
            self.guard.boundary_ok = state.per_rank.begin_step(state.step, self.snapshots.publish_mirror)
            self._survey_replicas()
            self.discovery.begin_step()
            self._snapshot_boundary()
            state.commit.begin(state.step)
            self.guard.start_step()
            state.poison.armed = self.guard.in_step = True
            self.audit.run(state.step)  # after a change: replicas still agree (else StateLost)
            closing = False
            try:
                yield state.step
            except GeneratorExit:
                closing = True
            finally:
                state.poison.armed = False
            # Closed before the step's first effect asked for the vote: by an exception out of the
            # body (the interpreter closes the generator as it unwinds the loop's frame), or a
            # break before the optimizer step. Nothing was applied: no vote. Voting here waited
            # for peers blocked in this step's collectives on this rank, until the collective
            # timeout (the script error then took minutes to surface).
            committed = False if closing and state.commit.decision is None else self.guard.effect_allowed()
            self.guard.in_step = False
            self.discovery.end_step(committed, state.step)  # a step that runs again: found objects put back
            if committed:
                state.stats.record(state.step, time.perf_counter() - t0, t0, self.group)
                state.step += 1
                self._note_step_done()
                self.status.report()
            if closing:
                break
        self.status.set(WorkerState.LEFT if closing and not self._loop_ended else WorkerState.FINISHED)

    def end_loop(self) -> None:
        """The loop around ``steps()`` ended as it should before the steps ran out (a
        framework's loop reaching its last step): closing the generator next counts this
        worker finished, so a crash on the process's way out is not a failure (see ``steps``)."""
        self._loop_ended = True

    def _note_step_done(self) -> None:
        """Stamps for the downtime breakdown (``tm_launch.joblog``): when the last clean step
        ended (the origin of the next change, sent in the ``entered`` record) and, once per
        generation, when its first step completed (``first_step/<gen>``: one write per generation)."""
        now = time.time()
        if self.step_ok:
            self.state.step_done_at = now
        if self._first_step_gen != self.generation:
            self._first_step_gen = self.generation
            self.agent.report_first_step(self.generation, FirstStepRecord(time=now, step=self.state.step))

    def _survey_replicas(self) -> None:
        """The first boundaries after a fresh start: measure which ranks hold the same copy of
        each object (``replica_survey``), armed like the step; before this step's snapshot, so
        that what was found unreplicated is in it."""
        if not self.survey.due():
            return
        self.state.poison.armed = True
        try:
            if self.survey.run():
                self.snapshots.set_remote(self.gens.exchange.unreplicated(self.rank, self.world_size), -1)
        finally:
            self.state.poison.armed = False

    def _snapshot_boundary(self) -> None:
        """The start of a step: take its snapshot (``snapshots``), once this generation knows
        which of this rank's objects no live rank replicates."""
        snapshots, state = self.snapshots, self.state
        if snapshots.every <= 0:
            return
        if snapshots.remote_generation != self.generation:
            first = snapshots.remote_generation < 0
            snapshots.set_remote(self.gens.exchange.unreplicated(self.rank, self.world_size), self.generation)
            if first and snapshots.enabled:
                when = "overlapping the next step" if snapshots.overlap_send else "before each step commits"
                log.info(
                    f"snapshots every {snapshots.every} step(s): {'+'.join(sorted(snapshots.remote))} (held by no other rank) "
                    f"{snapshots.describe_placement()} {when}, everything registered kept locally"
                )
        snapshots.boundary(state.step, state.objects, state.per_rank.at_step_start)

    def _refused(self, refused: SnapshotRefused) -> None:
        """The job cannot run as configured: say so once, tell the agent (it fails the job: no
        restart would help), end this process."""
        log.info(f"tm-launch: error: {refused}")
        self.agent.report_refused(RefusedRecord(why=str(refused)))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_REFUSED)

    def _state_lost(self, lost: StateLost) -> None:
        """No live rank can give some rank its state: tell the agent (the job restarts every
        worker from the script's own checkpoint) and end this process without touching its
        communicators (peers are ending theirs the same way)."""
        log.info(f"{lost}: this job cannot continue live without wrong weights; every worker restarts from the script's checkpoint")
        self.agent.report_state_lost(StateLostRecord(step=lost.step, ranks=lost.ranks, why=str(lost)))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_STATE_LOST)
