"""The in-worker runtime: ``tm_launch.init()``, ``job.register()``, ``job.steps()``.

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

A framework's loop cannot be wrapped in ``job.steps()``: its integration (``tm_launch.worker.live_loop``,
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

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..protocol import EXIT_REFUSED, EXIT_STATE_LOST, Directive, FirstStepRecord, RefusedRecord, StateLostRecord, WorkerEnv, WorkerState
from . import c10d_glue, communicators, cuda_warmup, ddp_rebuild, optimizer_steps, rehearsal_dump, sharding_decisions
from .agent_client import AgentClient, first_line, log
from .commit import StepCommit
from .generations import Generations, StateLost
from .groups import FAKE_NAMES, LiveGroup, LocalBackend, StepPoison, asks_fake, in_process_backend
from .snapshots import Snapshots
from .snapshots.service import SnapshotRefused
from .step_report import LiveStatus, StepReporter, StepStats, process_reporter
from .training_state import TrainingState
from .transfer import cpu_copy, human_size
from .zero import ZeroPartition, is_zero

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its agent dies: a dead node must not keep ranks."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


_LIVE: LiveJob | None = None  # one per process: a script run again after a rank change gets it back


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


def init(backend: str | None = None):
    """Start this worker's part of the job; returns a ``Job`` (see module docstring)."""
    global _LIVE
    if _LIVE is not None:
        return _LIVE
    env = WorkerEnv.from_environ()
    if env.live:
        _LIVE = rehearsal_dump.arm(LiveJob(env, backend))  # tm-launch rehearse: nothing unless its variables are set
        return _LIVE
    return rehearsal_dump.arm(PlainJob(backend))


def report_step(step: int) -> None:
    """``tm_launch.report_step(step)``: ``job.report_step(step)`` for scripts that never call
    ``init()`` (they call ``init_process_group`` themselves); nothing under plain torchrun."""
    optimizer_steps.the_script_reports()
    report_counted_step(step)


def report_counted_step(step: int) -> None:
    """A step this process finished, told to the agent: the script's own report, or its
    optimizers' count for a script that says nothing (``tm_launch.worker.optimizer_steps``)."""
    if _LIVE is not None:
        _LIVE.report_finished_step(step)
        return
    reporter = process_reporter()
    if reporter is not None:
        reporter.step(step)


class RankChanged(BaseException):
    """A promoted spare takes ranks other than those it warmed up as: ``tm_launch.worker`` runs
    the script again from the top, for the ranks it got (a BaseException: scripts' ``except
    Exception`` must not swallow it)."""


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


class PlainJob:
    """The same API over a normal process group, for torchrun and tm-launch's restart mode
    (``--no-live``: there it reports its steps to the agent, ``tm_launch.worker.step_report``)."""

    in_sandbox = False
    step_ok = True

    def __init__(self, backend: str | None):
        if not dist.is_initialized():  # None: torch's own default (gloo for CPU tensors, NCCL for CUDA)
            dist.init_process_group(backend=backend)
            atexit.register(_destroy_default_group)
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self._objects: dict = {}

    @property
    def group(self):
        """The default group (not held here: at exit it must be freed, see ``_destroy_default_group``)."""
        return dist.group.WORLD

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    def register(self, replicas=None, per_rank: bool = False, **objects) -> None:
        self._objects.update(objects)

    def new_group(self, ranks, backend=None):
        return dist.new_group(list(ranks), backend=backend)

    def commit(self) -> bool:
        return True

    def steps(self, total: int, start: int = 0):
        optimizer_steps.the_script_reports()
        for step in range(start, total):
            yield step
            self.report_step(step + 1)
        self.end_loop()  # the steps ran out: finished

    def end_loop(self) -> None:
        """The loop ended as it should before ``steps()`` ran out (``LiveJob.end_loop``): the
        worker is finished (told to the agent under ``--no-live``; nothing under torchrun)."""
        reporter = process_reporter()
        if reporter is not None:
            reporter.finished()

    def report_step(self, step: int) -> None:
        """This worker finished step ``step`` (the global step count): told to the agent under
        ``tm-launch --no-live``, nothing under plain torchrun."""
        optimizer_steps.the_script_reports()
        reporter = process_reporter()
        if reporter is not None:
            reporter.step(step)


def _destroy_default_group() -> None:
    """At exit, the group ``PlainJob`` started, if the script did not destroy it: left to the
    interpreter's teardown, gloo's worker thread can reach for the GIL after finalization began,
    and Python 3.11 ends such a thread with a forced unwind that C++ turns into SIGABRT
    ("terminate called without an active exception"; 7 of 30 two-rank runs of a bare gloo
    script exited so here, none with the group destroyed first)."""
    if dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()  # the group's last holder may sit in a cycle: its destructor joins those threads now


class LiveJob:
    """A worker that survives its peers: substitution happens inside ``steps()``."""

    def __init__(self, env: WorkerEnv, backend: str | None = None):
        overridden = communicators.live_process_environment()  # first: before this process starts threads
        if overridden and env.local_rank == 0:
            log(overridden)
        die_with_parent()
        self.local_rank = env.local_rank
        # Every group of the job serves these devices (an unusable choice raises before anything starts).
        self.devices = communicators.job_devices(backend, self.local_rank)
        self._c10d_names = communicators.c10d_names(self.devices)
        self.agent = AgentClient(env)
        self.node = env.node_id
        self._sandbox_steps = env.sandbox_steps
        world = env.world_size
        # A spare warms up as the last node's ranks: rank-0-only side effects of the script's
        # set-up stay with the real rank 0, and a failed last node needs no second set-up.
        spare = env.starts_as_spare
        rank = world - env.local_world_size + self.local_rank if spare else env.rank
        poison = StepPoison()
        world_group = LiveGroup(None, rank, world, poison, name=c10d_glue.unique_name(None), backend=self._c10d_names)
        self.state = TrainingState(world=world_group, poison=poison, commit=StepCommit(), stats=StepStats(env.straggler_window))
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
        self._in_step = False
        self._restart_steps: StepReporter | None = None  # report_step() outside job.steps() (restart mode)
        self._live_marked = False
        self._entering: Directive | None = None  # a generation to finish entering once the script re-ran
        self._held: list | None = None  # communicators entered before the loop, used from its first step
        self._held_per_rank: dict | None = None  # the per-rank state received with them
        self._first_step_gen = -1  # the generation whose first completed step was reported
        self._boundary_ok = True  # the step's start went as it should (its per-rank mirror reached the holder)
        self._loop_ended = False  # end_loop(): a closed steps() generator means finished, not left
        self._detach(rank)
        c10d_glue.route_new_group(self.new_group)
        sharding_decisions.track_meshes()
        # Imported now, not on the recovery path: the replica sets and the transfer read DTensor
        # layouts, and the module's first import costs ~0.5-0.9 s on a loaded 2-core machine.
        import torch.distributed.tensor  # noqa: F401

        if env.sandbox:
            freeze_what_exists()
        c10d_glue.refuse_rooted_objects_without_peers()
        register_optimizer_step_pre_hook(self._before_optimizer_step)
        self.gens = Generations(self.state, self.agent, self.status, env, self.devices, self.snapshots)
        if spare:  # opened while it warms up, not in the moment it is promoted
            self._keep_connections_ready()
        atexit.register(self._close)
        self.agent.watch(self._on_directive)
        if not env.sandbox:
            # Every rank of this generation starts here, like init_process_group: DDP's own
            # broadcast from rank 0 makes the state consistent, nothing to agree on.
            self.gens.enter(self.agent.wait_directive(env.generation - 1), agree=False)
        self.status.report(force=True)

    def _detach(self, rank: int) -> None:
        """Serve every collective locally (sandbox, or a script re-running for its new ranks)."""
        world = self.group.size()
        self.group.swap(LocalBackend(rank, world), rank, world, self.generation)
        c10d_glue.install_world(self.group)
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

    @property
    def step_ok(self) -> bool:
        """False while the current step is interrupted: it did not commit (it will run again) or
        a collective after its commit failed (what it logs may be this rank's value only)."""
        return not self.state.poison.active and self.state.commit.decision is not False

    def register(self, replicas=None, per_rank: bool = False, **objects) -> None:
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
        a rank that joins in its place continues from it (``tm_launch.worker.per_rank``)."""
        if per_rank:
            self.state.per_rank.objects.update(objects)
            return
        for name, obj in objects.items():
            declared = _replica_ranks(replicas, self.world_size)
            scheduler = _wrapped(obj, "scheduler", _SCHEDULERS)  # accelerate's AcceleratedScheduler steps the one it wraps
            if scheduler is not None:
                _guard(scheduler, "step", self._effect_allowed, None)
            elif isinstance(obj, torch.amp.GradScaler):
                _guard(obj, "update", self._effect_allowed, _reset_scaler)
            elif is_zero(obj):  # each rank's own partition: held by this rank alone
                obj, declared = ZeroPartition(obj), (self.rank,)
            self.state.objects[name] = obj
            self.state.declared[name] = declared

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
            name=c10d_glue.unique_name(ranks),
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
                sub.swap(self.gens.build(ranks, me, self.generation, key=sub.store_key), ranks.index(me), len(ranks), self.generation)
        self.state.subgroups.append(sub)
        c10d_glue.register(sub, ranks)
        return sub

    def commit(self) -> bool:
        """Take the current step's job-wide vote now (it is taken anyway at the first optimizer,
        scheduler or scaler step, or at the end of the body); True when the step committed.
        Guard effects of your own with it: ``if job.commit(): write_metrics()``."""
        return self._effect_allowed()

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
            if self._entering is not None:  # the script ran again for the ranks this spare took
                d, self._entering = self._entering, None
                try:
                    self.gens.enter(d)
                except self.gens.Superseded:
                    self._park()
            else:
                self._park()
        except StateLost as lost:  # as in steps(): every worker restarts from the checkpoint
            self._state_lost(lost)
        self._held = [(g, g.inner) for g in self.state.groups if g.inner is not None and not g.in_process]
        for g, _ in self._held:
            g.swap(LocalBackend(g.rank(), g.size(), keeps_own_objects=True), g.rank(), g.size(), g.generation, keep_old=True)
        self._held_per_rank = {name: cpu_copy(obj.state_dict()) for name, obj in self.state.per_rank.objects.items()}
        self.status.set(WorkerState.ENTERING)

    def _use_held(self) -> None:
        """The loop reached its first step: talk to the job through the communicators entered
        before it, with the per-rank state received then (its set-up may have drawn random numbers)."""
        held, self._held = self._held, None
        for g, inner in held:
            if g.generation == self.generation:
                g.swap(inner, g.rank(), g.size(), g.generation)
            else:  # entered again meanwhile: that generation's communicator is not needed any more
                communicators.release(inner)
        for name, state in (self._held_per_rank or {}).items():
            self.state.per_rank.objects[name].load_state_dict(state)
        self._held_per_rank = None

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
        if self.in_sandbox:
            # A spare warms up, and warms up again as the ranks it was promoted to: real steps
            # without peers, so that the framework's lazy set-up is done before this process
            # meets the job (DDP rebuilds its buckets with a broadcast in its second step; a
            # fresh DDP would send it while its peers run a normal step: tm_launch.worker.ddp_rebuild).
            yield from self._warm_up(start)
            if self._entering is None:
                self._park()
        if self._entering is not None:  # the script ran again for the ranks this spare took
            entering, self._entering = self._entering, None
            try:
                self.gens.enter(entering)
            except self.gens.Superseded:  # no longer promoted before it got in: a spare again
                self._park()
        if self._held is not None:
            self._use_held()
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
            self._boundary()
            if state.step >= total:
                break
            t0 = time.perf_counter()
            self.group.last_submit = 0.0
            self._boundary_ok = state.per_rank.begin_step(state.step, self.snapshots.publish_mirror)
            self._snapshot_boundary()
            state.commit.begin(state.step)
            state.poison.armed = self._in_step = True
            closing = False
            try:
                yield state.step
            except GeneratorExit:
                closing = True
            finally:
                state.poison.armed = False
            committed = self._effect_allowed()
            self._in_step = False
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

    def _snapshot_boundary(self) -> None:
        """The start of a step: take its snapshot (``snapshots``), once this generation knows
        which of this rank's objects no live rank replicates."""
        snapshots, state = self.snapshots, self.state
        if snapshots.every <= 0:
            return
        if snapshots.remote_generation != self.generation:
            first = snapshots.remote_generation < 0
            snapshots.set_remote(self.gens.unreplicated(self.rank, self.world_size), self.generation)
            if first and snapshots.enabled:
                when = "overlapping the next step" if snapshots.overlap_send else "before each step commits"
                log(
                    f"snapshots every {snapshots.every} step(s): {'+'.join(sorted(snapshots.remote))} (held by no other rank) "
                    f"{snapshots.describe_placement()} {when}, everything registered kept locally"
                )
        snapshots.boundary(state.step, state.objects, state.per_rank.at_step_start)

    def _refused(self, refused: SnapshotRefused) -> None:
        """The job cannot run as configured: say so once, tell the agent (it fails the job: no
        restart would help), end this process."""
        log(f"tm-launch: error: {refused}")
        self.agent.report_refused(RefusedRecord(why=str(refused)))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_REFUSED)

    def _state_lost(self, lost: StateLost) -> None:
        """No live rank can give some rank its state: tell the agent (the job restarts every
        worker from the script's own checkpoint) and end this process without touching its
        communicators (peers are ending theirs the same way)."""
        log(f"{lost}: this job cannot continue live without wrong weights; every worker restarts from the script's checkpoint")
        self.agent.report_state_lost(StateLostRecord(step=lost.step, ranks=lost.ranks, why=str(lost)))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_STATE_LOST)

    # -- steps ---------------------------------------------------------------------------------
    def _warm_up(self, start: int):
        """Real steps on local backends (kernels, allocator, the framework's lazy set-up):
        ``--sandbox-steps`` of them for a spare that parks next; one, then DDP's bucket rebuild
        (``tm_launch.worker.ddp_rebuild``), for a spare promoted to other ranks, which runs the script
        again for them while the job waits. What they leave in the registered objects is
        overwritten when the process enters the job: a joiner always receives its state from a
        live replica (where none exists, every worker restarts), so no copy of the start state
        is kept: a spare costs no extra memory. A spare parks after them with its CUDA pools
        handed back; one running the script again for the ranks it was promoted to enters at
        once and keeps them for its first steps."""
        self.status.state = WorkerState.WARMUP
        again = self._entering is not None  # the script runs again for ranks it was promoted to
        if again:  # its new meshes take over DTensor's decisions cached with the old ones
            sharding_decisions.adopt_meshes()
        for i in range(1 if again else self._sandbox_steps):
            self.status.report(force=True)
            yield start + i
        if again:  # the job waits for this process: one step, and DDP's second-step set-up now
            ddp_rebuild.rebuild_buckets_now()
        self.state.clear_step_effects()
        if self._entering is not None:  # promoted before these steps: it enters now and trains
            return
        left = cuda_warmup.leave_no_trace()  # None: CUDA never used here
        if left is not None:
            log(
                f"warm-up done: CUDA pools released, {human_size(left['allocated'])} allocated "
                f"({human_size(left['reserved'])} reserved) for the model and optimizer"
            )

    def _effect_allowed(self) -> bool:
        """The current step's job-wide decision (voted on first use); outside a step, True."""
        if not self._in_step:
            return True
        state = self.state
        if state.commit.decision is None:
            for g in state.groups:
                g.settle()
            state.poison.release_broken()  # peers blocked in a failed communicator fail now, before the vote waits
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()  # a step commits only once its GPU work is complete
            if not self._boundary_ok:
                state.poison.set(RuntimeError("the step's per-rank state did not reach its snapshot holder (it is gone)"))
            ok = not state.poison.active
            if (
                not state.commit.decide(
                    ok, lambda: self.agent.latest() > self.generation, self._before_vote_counts, peer_gone=self._unplanned_newer
                )
                and ok
            ):
                state.poison.set(RuntimeError("the step did not commit: a peer failed before voting"))
        return bool(state.commit.decision)

    def _before_vote_counts(self) -> bool:
        """What must be true before this rank's vote counts (the voter thread runs it): the
        step's snapshot is complete here and on the holder, and the per-rank state after the step
        is on the holder (a joiner that replaces this rank starts from it)."""
        step = self.state.commit.step
        if not self.snapshots.ready_to_commit(step, give_up=self._unplanned_newer):
            return False
        mirror = self.state.per_rank.vote_mirror(step)
        return mirror is None or self.snapshots.publish_mirror(*mirror)

    def _unplanned_newer(self) -> bool:
        """The agent handed over a newer generation because a peer is gone (not a planned switch)."""
        latest = self.agent.latest()
        return latest > self.generation and not self.agent.directive(latest).planned

    def _before_optimizer_step(self, optimizer, args, kwargs):
        """Every optimizer's step asks for the commit; on a step that did not commit its
        gradients are dropped, so torch's optimizers leave parameters and state untouched."""
        if not self._in_step or self.in_sandbox:
            return None
        if not any(optimizer is obj for obj in self.state.carried()):
            raise RuntimeError(
                f"tm-launch: an optimizer ({type(optimizer).__name__}) stepped in job.steps() but is not registered: a rank "
                "that joins would not receive its state. Register it: job.register(optimizer=opt)"
            )
        if not self._effect_allowed():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
        return None

    def _on_directive(self, d: Directive) -> None:
        """Watcher thread: an unplanned generation means a peer is gone; a vote waiting for it
        is settled as aborted at once, the communicators it changes are given up (gloo's
        connections shut down, NCCL aborted: a collective waiting for the lost rank fails now,
        not when its sockets close or at the collective timeout), and a survivor starts
        building its world communicator. A planned one switches at an agreed step instead; a
        finished job ends its collectives as they are."""
        if d.planned:  # a drained rank hands over at the switch step instead
            return
        self.state.commit.abort(d.generation)
        if not d.stop:
            try:
                ended = self.gens.abort_changed(d)
                if ended:
                    log(
                        f"generation {d.generation}: gave up {len(ended)} communicator(s) it changes (a collective waiting on a lost rank ends now)"
                    )
            except Exception as e:  # noqa: BLE001 -- the watcher must live on; the step boundary still recovers
                log(f"aborting the communicators generation {d.generation} changes failed: {e}")
            self.gens.build_ahead_as_survivor(d)  # its world connects while the interrupted step ends

    def _boundary(self) -> None:
        state = self.state
        if state.poison.active:
            error = first_line(state.poison.error)
            self.status.recovering(f"a collective failed ({error})")
            what = (
                "committed; a collective after its commit failed"
                if state.commit.decision
                else "interrupted, nothing applied; it runs again"
            )
            log(f"step {state.commit.step} {what} ({error}); waiting for the next generation")
            state.clear_step_effects()
            for g in state.groups:
                g.release_if_broken()
            if not state.commit.decision:  # it runs again, with the RNG and data it started with
                state.per_rank.restore()
            committed = bool(state.commit.decision)
            d = self.agent.wait_directive(self.generation)
            state.poison.clear()
            # A committed step lets the peers whose collectives all succeeded begin the next one:
            # they may wait for this rank in a subgroup ``d`` keeps, as for a rank late to its
            # boundary (``Generations.follow``).
            self.gens.follow(d, interrupted=True, committed=committed)
            self.status.state = WorkerState.RUNNING
            return
        if self.gens.pending is not None or self.agent.newer_than(self.generation):
            latest = self.agent.latest()
            if latest > self.generation:
                self.gens.follow(self.agent.directive(latest), interrupted=False)

    def _park(self) -> None:
        """A warmed-up spare waits here until a generation names its node."""
        self.status.set(WorkerState.PARKED)
        after = self.generation
        while True:
            d = self.agent.wait_directive(after, repeat=False)
            if d.stop:
                sys.exit(0)
            if not d.active:
                self._keep_connections_ready(d)
            if d.active:
                os.environ["GROUP_RANK"] = str(-1 if d.group_rank is None else d.group_rank)  # a spare's was -1
            if d.active and d.rank_of(self.local_rank) != self.rank:
                self._take_other_ranks(d)
            if d.active:
                try:
                    self.gens.enter(d)
                    return
                except self.gens.Superseded as newer:  # promoted, then replaced before it got in
                    d = newer.directive
                    self.status.set(WorkerState.PARKED)
            after = d.generation

    def _keep_connections_ready(self, d: Directive | None = None) -> None:
        """A spare's connections to the store of the plan it waits beside (``d``; None: the one
        its agent handed over last, if any) and to that store's standby, for the day it is
        promoted: the world communicator, its subgroups, the vote, its abort path and the
        lookup of snapshot servers' addresses (``tm_launch.worker.store_clients``)."""
        if d is None:
            latest = self.agent.latest()
            if not self.agent.has_directive(latest):
                return
            d = self.agent.directive(latest)
        networked = sum(1 for g in self.state.subgroups if not g.in_process)
        self.gens.clients.prepare([d.store, d.standby], at_least=4 + networked)

    def _take_other_ranks(self, d: Directive) -> None:
        """Promoted to ranks this process did not warm up as: drop everything the script built
        for the old ranks and run it again from the top for the new ones (``tm_launch.worker``)."""
        rank = d.rank_of(self.local_rank)
        log(f"promoted to rank {rank} (warmed up as rank {self.rank}): running the script again for rank {rank}")
        for g in self.state.subgroups:
            c10d_glue.unregister(g)
        sharding_decisions.retire_meshes()
        self.state.forget_script()
        self.snapshots.forget()
        self._detach(rank)
        forget_framework_ranks()
        self._entering = d  # still in the sandbox (no peers) until steps() enters generation d
        self.gens.build_ahead(d)  # its world communicator connects while the script runs again
        raise RankChanged(f"promoted to rank {rank}")


def forget_framework_ranks() -> None:
    """Frameworks that cache this process's rank once per process (accelerate's ``PartialState``
    singleton reads ``dist.get_rank()`` when first built) must read it again when the script
    runs again for other ranks: their state is dropped, the script's next ``Accelerator()``
    builds it anew."""
    accelerate_state = sys.modules.get("accelerate.state")
    if accelerate_state is not None:
        accelerate_state.AcceleratorState._reset_state(reset_partial_state=True)
        accelerate_state.GradientState._reset_state()


_SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def _wrapped(obj, attr: str, kind):
    """``obj`` if it is a ``kind``, else the ``kind`` a framework's wrapper holds as ``obj.<attr>``."""
    if isinstance(obj, kind):
        return obj
    inner = getattr(obj, attr, None)
    return inner if isinstance(inner, kind) else None


def _guard(obj, method: str, allowed, on_skip) -> None:
    """``obj.<method>`` runs only on a step that commits (``on_skip(obj)`` runs instead).

    The object's class is swapped for a subclass overriding the method, not the method set on
    the instance: an LR scheduler's ``state_dict()`` is its ``__dict__``, so an instance
    attribute would travel (unpicklable) to a joiner and be loaded over its own."""
    cls = type(obj)
    if getattr(cls, "_tm_guarded", None) == method:
        return
    original = getattr(cls, method)

    def guarded(self, *args, **kwargs):
        if allowed():
            return original(self, *args, **kwargs)
        if on_skip is not None:
            on_skip(self)
        return None

    obj.__class__ = type(cls.__name__, (cls,), {method: guarded, "_tm_guarded": method, "__module__": cls.__module__})


def _reset_scaler(scaler) -> None:
    """A skipped ``GradScaler.update()`` must still forget the step's per-optimizer records, or
    the step's re-run fails with 'step() has already been called since the last update()'."""
    from collections import defaultdict

    from torch.amp.grad_scaler import _refresh_per_optimizer_state

    scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
