"""The generation protocol inside a worker: entering a generation, and planned switches.

Entering generation N: build the world communicator on a fresh ``tm/g<N>/`` prefix of the
generation's store (the plan names the node hosting it), point the commit vote at the new
store, then agree: every rank says which step it holds, which ranks hold the same state and
which subgroups it cannot keep (``subgroups_to_rebuild``: their membership changed, or it closed
their communicator). Every member of such a group rebuilds it; any other group keeps its
communicator (delta setup). ``recovery.plan_recovery`` then decides which step and who sends
what to whom. Ranks behind receive their own state from a replica of the same shard; a
shard that no live rank holds at the newest step stops the job with one clear line, never a
silent restart from the script's start state.

A planned switch (drain, straggler) has two phases: agree on a switch step and build the new
world communicator in the background while training goes on, then swap at that boundary.

It acts on the worker's ``TrainingState`` (the groups, the registered objects, the step, the
commit) and tells the agent what it does through ``AgentClient`` and ``LiveStatus``.

Every group is built by ``communicators.build`` with the job's devices (``LiveJob.devices``, from
``tm_launch.init(backend=...)``): gloo for CPU tensors, NCCL too for CUDA tensors. Communicators
left behind are given up by ``LiveGroup.swap`` (``communicators.release``); an unplanned
generation gives up those whose membership it changes as soon as the directive watcher sees it
(``abort_changed``), so a step waiting for a dead rank fails at once.
"""

from __future__ import annotations

import datetime
import math
import threading
import time

import torch
import torch.distributed as dist

from ..protocol import Directive, EnteredRecord, StoreAddress, WorkerEnv, WorkerState
from . import c10d_glue, communicators, connections
from .agent_client import AgentClient, first_line, log
from .commit import commit_store
from .groups import LocalBackend
from .recovery import Holding, ObjectState, plan_recovery
from .replicas import fingerprints, replica_set
from .snapshots import Snapshots
from .step_report import LiveStatus
from .store_clients import StoreClients
from .training_state import TrainingState
from .transfer import allgather_objects, human_size, recv_state, send_state


class Superseded(Exception):
    """A newer generation arrived while this process was entering an older one."""

    def __init__(self, directive: Directive):
        super().__init__(f"generation {directive.generation}")
        self.directive = directive


class StateLost(RuntimeError):
    """No live rank holds some rank's state (or replicas disagree): continuing would train on
    wrong weights. Every rank computes the same transfer plan, so every rank raises it alike;
    the job then restarts every worker from the script's own checkpoint (restart mode)."""

    def __init__(self, message: str, step: int, ranks: list):
        super().__init__(message)
        self.step, self.ranks = step, list(ranks)


def membership_changed(ranks, d: Directive, rank: int, old_rank: int) -> bool:
    """Does generation ``d`` change the membership of group ``ranks`` (global ranks; None: the
    world) for this process, which takes rank ``rank`` in ``d`` (-1: none) after ``old_rank``?
    The world always: a generation exists because a rank failed, left or was replaced. A
    subgroup when one of its ranks is served by a new process (a joiner: the rank failed or was
    replaced), when every process is new, or when this process changes rank. Any other
    subgroup keeps its communicator (delta setup)."""
    if ranks is None or d.all_fresh or rank != old_rank:
        return True
    return bool(set(d.joiner_ranks).intersection(ranks))


def subgroups_to_rebuild(
    memberships: list, d: Directive, rank: int, old_rank: int, unusable: set, in_process: set = frozenset()
) -> frozenset:
    """The subgroups (indices in creation order; ``memberships[i]``: the group's global ranks)
    that this process, taking ``rank`` in ``d`` after ``old_rank``, cannot keep: those it is a
    member of whose membership changed for it, or whose communicator it no longer has
    (``unusable``: closed after a failed collective, closed on entering late, the sandbox's local
    stand-in). Never one served in the process (``in_process``: one member, or torch's "fake"
    backend), which has no communicator to build. Each member decides this from what it alone
    knows, yet a group is built by all of its members or by none (a setup waits for every
    member): the ranks gather these sets (``Holding.rebuild``) and every member rebuilds the union."""
    return frozenset(
        i
        for i, ranks in enumerate(memberships)
        if rank in ranks and i not in in_process and (i in unusable or membership_changed(ranks, d, rank, old_rank))
    )


class Generations:
    Superseded = Superseded

    def __init__(self, state: TrainingState, agent: AgentClient, status: LiveStatus, env: WorkerEnv, devices: tuple, snapshots: Snapshots):
        self.state = state
        self.agent = agent
        self.status = status
        self.snapshots = snapshots
        self.local_rank = env.local_rank
        self.devices = devices  # every group of the job serves these (``communicators.job_devices``)
        self._addr = env.local_addr
        self._timeout = env.collective_timeout
        self._setup_timeout = env.setup_timeout  # joiners may start cold
        self.clients = StoreClients(self._setup_timeout)  # the generation stores' connections, opened ahead
        self.current: Directive | None = None
        self.pending: dict | None = None  # a planned switch being prepared
        self._ahead: tuple | None = None  # (generation, (thread, box)): a world communicator built ahead of enter()
        self._ahead_lock = threading.Lock()  # the directive watcher starts builds ahead; the main thread takes them
        self._entering = -1  # the newest generation the main thread began to enter: none is built ahead for it now

    def close(self) -> None:
        pending = self.pending
        if pending and pending.get("thread") is not None:
            pending["thread"].join(timeout=5)
            communicators.release(pending["built"].get("pg"))  # built for a switch that never came
        self.pending = None
        self._take_ahead(None)
        self.clients.close()

    # -- communicators ---------------------------------------------------------------------------
    def store(self, where: StoreAddress | None) -> dist.Store:
        """A connection of its own to the store ``where`` names (``tm_launch.worker.store_clients``)."""
        return self.clients.take(where)

    def build(self, ranks, global_rank: int, gen: int, d: Directive | None = None, key: str | None = None):
        """A communicator for ``ranks`` (None: the world) in generation ``gen``, via a fresh prefix,
        on the job's devices (``communicators.build``: the one place that builds them). ``key``:
        a subgroup's own name in that prefix (``LiveGroup.store_key``)."""
        d = d or self.current
        name = "world" if ranks is None else key
        store = dist.PrefixStore(f"tm/g{gen}/{name}/", self.store(d.store))
        rank, size = (global_rank, d.world_size) if ranks is None else (ranks.index(global_rank), len(ranks))
        return communicators.build(
            store, rank, size, devices=self.devices, timeout_s=self._timeout, setup_timeout_s=self._setup_timeout, hostname=self._addr
        )

    def abort_changed(self, d: Directive) -> list:
        """Directive watcher, unplanned generation ``d``: give up the communicators of every group
        whose membership ``d`` changes (``LiveGroup.abort_soon``: gloo's connections shut down,
        NCCL aborted off this thread; only communicators of older generations). The groups
        whose communicator was ended."""
        rank, old_rank = d.rank_of(self.local_rank), self.state.rank
        return [g for g in self.state.groups if membership_changed(g.member_ranks, d, rank, old_rank) and g.abort_soon(d.generation)]

    def _build_in_background(self, ranks, global_rank: int, gen: int, d: Directive, key: str | None = None) -> tuple:
        """``build`` in a daemon thread: (thread, box); the box gets ``pg`` or ``error``, and
        ``mark``: the sockets open before the build (``connections.Mark``), from which entering
        with it counts what it opened. A build given up before it finished (``_give_up``) is
        released by its own thread when it does: peers that entered that generation must not
        wait on this rank's sockets until the collective timeout."""
        box: dict = {"mark": connections.Mark(), "lock": threading.Lock()}

        def work():
            try:
                pg = self.build(ranks, global_rank, gen, d, key)
            except BaseException as e:  # noqa: BLE001 -- handed to the thread that waits for it
                box["error"] = e
                return
            with box["lock"]:
                if not box.get("given_up"):
                    box["pg"] = pg
                    return
            communicators.release(pg)  # gloo: its connections shut down; NCCL: aborted off this thread

        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        return thread, box

    def build_ahead(self, d: Directive) -> None:
        """Start building generation ``d``'s world communicator now, for a process that has work
        to do before it can enter ``d`` (a promoted spare running the script again for its new
        ranks): its peers' set-up is not kept waiting for that work, and ``enter(d)`` uses it."""
        with self._ahead_lock:
            self._start_ahead(d)

    def build_ahead_as_survivor(self, d: Directive) -> bool:
        """Directive watcher, an unplanned generation ``d`` that keeps this process at its rank:
        start building ``d``'s world communicator now. The main thread learns of the failure only
        when its step reaches a collective (on a CPU, after the step's compute; on a GPU, after
        an aborted NCCL communicator fails its work), and its set-up then found the communicator
        connected instead of connecting it (NCCL's initialisation is the expensive one). Not for a
        generation the main thread already began to enter (it builds its own): each rank builds a
        generation's world once. True when a build was started."""
        if d.stop or d.planned or not d.active or self.state.in_sandbox or d.rank_of(self.local_rank) != self.state.rank:
            return False
        with self._ahead_lock:
            if d.generation <= self._entering or (self._ahead is not None and self._ahead[0] >= d.generation):
                return False
            self._start_ahead(d)
        return True

    def _start_ahead(self, d: Directive) -> None:
        """(Holding ``_ahead_lock``.) The build for ``d`` replaces any other started ahead."""
        self._give_up(self._ahead)
        self._ahead = (d.generation, self._build_in_background(None, d.rank_of(self.local_rank), d.generation, d))

    def _take_ahead(self, gen: int | None):
        """The build started ahead for generation ``gen``, if any, for the main thread entering
        it (from now on none is started for ``gen`` or older); one for another generation is given
        up. ``None``: give up any."""
        with self._ahead_lock:
            if gen is not None:
                self._entering = max(self._entering, gen)
            ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == gen:
            return ahead[1]
        self._give_up(ahead)
        return None

    @staticmethod
    def _give_up(ahead) -> None:
        """A build started ahead that nobody will enter: released now if it has finished, else by
        its thread when it finishes (``_build_in_background``) or fails at its own timeout."""
        if ahead is not None:
            box = ahead[1][1]
            with box["lock"]:
                box["given_up"] = True
                pg = box.pop("pg", None)
            communicators.release(pg)

    def _build_watching(self, ranks, global_rank: int, gen: int, d: Directive, pending=None, key: str | None = None):
        """``build`` in a thread while this one watches for a newer generation: the setup waits
        for every member, so a member that died would otherwise hold this process for the whole
        setup timeout. An abandoned build is left to fail at its own timeout (a daemon thread).
        ``pending``: a build already started (``_build_in_background``) to wait for instead."""
        pending, box = pending or self._build_in_background(ranks, global_rank, gen, d, key)
        agent = self.agent
        while pending.is_alive():
            pending.join(0.01)
            if pending.is_alive() and agent.latest() > gen:
                raise Superseded(agent.directive(agent.latest()))
        if "error" in box:
            raise box["error"]
        return box["pg"]

    # -- following the agent -------------------------------------------------------------------
    def follow(self, d: Directive, interrupted: bool, committed: bool = False) -> None:
        """Enter ``d`` from a step boundary: after a healthy step (``interrupted`` False) or one a
        failed collective poisoned, which may still have ``committed`` (a collective after the
        commit failed)."""
        if d.stop:
            self._leave()
        if d.planned and not interrupted and self._planned_switch(d):
            return
        if not d.active:
            self._leave()
        self.pending = None
        # After a step that committed, a peer may already be inside the next step, waiting for
        # this rank in a collective of a group that ``d`` does not change (``_enter_once``).
        self.enter(d, late=committed or not interrupted)

    def _leave(self) -> None:
        """This node left the job (drained or replaced): end the script without error."""
        self.status.set(WorkerState.LEFT)
        raise SystemExit(0)

    def _planned_switch(self, d: Directive) -> bool:
        """Two-phase migration. Phase 1: agree on a switch step and build the new communicators in
        the background while training goes on in the current generation; phase 2, at that step
        boundary: leavers exit, everyone else swaps communicators and joiners receive state.
        Returns True while this rank should keep training in the current generation."""
        state, gen = self.state, d.generation
        if self.pending is None or self.pending["generation"] != gen:
            store = self.store(d.store)
            margin = max(2, math.ceil(0.5 / max(state.stats.median() or 0.01, 1e-3)))
            agreed = int(store.compare_set(f"tm/g{gen}/switch", "", str(state.step + margin)))
            thread, built = self._build_in_background(None, d.rank_of(self.local_rank), gen, d) if d.active else (None, {})
            self.pending = {"generation": gen, "switch": agreed, "thread": thread, "built": built}
            log(f"planned migration to generation {gen}: switching at step {agreed}")
        if state.step < self.pending["switch"]:
            return True
        pending, self.pending = self.pending, None
        if not d.active:
            # Its state at the switch step, exactly, on its holder: the rank taking over starts
            # there (the vote-time mirror is not trusted once the script moved per-rank state
            # between steps; a shard no replica holds comes from this rank's snapshot).
            state.per_rank.begin_step(state.step, self.snapshots.publish_mirror)
            try:
                self.snapshots.resend(state.step, state.objects, state.per_rank.states_now(), leaving=True)
            except (RuntimeError, OSError) as e:
                log(f"leaving at step {state.step}: its snapshot did not reach its holder ({first_line(e)})")
            self._leave()
        prebuilt = (pending["thread"], pending["built"]) if pending["thread"] is not None else None
        self.enter(d, prebuilt=prebuilt)
        return True

    # -- entering ------------------------------------------------------------------------------
    def enter(self, d: Directive, prebuilt=None, agree: bool = True, late: bool = False) -> None:
        """Enter generation ``d``; when a peer dies on the way in, enter the generation after it.

        A joiner can die while the others wait for it in the communicator setup (which may wait
        up to the join timeout: joiners can start cold) or fail the agreement/transfer. Either way
        the generation can never complete; the agents publish a newer one (the dead node's
        lease, or this node's report after a while), and this process follows it instead of
        waiting out the setup timeout or crashing with the training state that only it holds.
        ``late``: this rank follows ``d`` from the boundary after a committed step."""
        while True:
            ahead = self._take_ahead(d.generation)
            switching = prebuilt is not None  # a planned switch's build: the old world is healthy to the end
            prebuilt = prebuilt if prebuilt is not None else ahead
            try:
                self._enter_once(d, prebuilt, agree, late, switching)
                return
            except Superseded as newer:
                log(f"generation {d.generation} was superseded by {newer.directive.generation} while entering it")
                d = newer.directive
            except StateLost:
                raise
            except RuntimeError as e:  # gloo/store errors: a peer died while entering
                why = f"entering generation {d.generation} failed ({first_line(e)})"
                self.status.recovering(why)
                log(f"{why}; waiting for the next generation")
                d = self.agent.wait_directive(d.generation)
            prebuilt, agree, late = None, True, False
            if d.stop:
                self._leave()
            if not d.active:
                if self.state.in_sandbox:
                    raise Superseded(d)  # a spare that is no longer promoted parks again
                self._leave()

    def _enter_once(self, d: Directive, prebuilt=None, agree: bool = True, late: bool = False, switching: bool = False) -> None:
        state = self.state
        t0, began = time.perf_counter(), time.time()
        connects_before = self.clients.opened_on_demand
        # Counted from before the communicator's build: one built ahead (a spare running the
        # script again, a planned switch) opened its listener before this call.
        opened = prebuilt[1]["mark"] if isinstance(prebuilt, tuple) else connections.Mark()
        gen, rank, world = d.generation, d.rank_of(self.local_rank), d.world_size
        self.current = d
        old_rank = state.rank
        if not switching and not state.in_sandbox:
            # Unplanned: a peer may still be blocked in a collective of the old world with this
            # rank (it moved on at a healthy boundary, e.g. a cordoned node's plan arrived
            # mid-step); closing it here makes that peer fail now instead of both sides waiting
            # for each other, the peer in the old collective and this rank in the new setup.
            state.world.release()
            if late:
                # Its peers may have begun the next step (this rank's commit of the last one
                # let them) and wait for it in a subgroup that ``d`` keeps: closed here, their
                # wait fails now rather than at the collective timeout, and the gathered
                # ``rebuild`` sets make every member of such a group build it again.
                for sub in state.subgroups:
                    sub.release()
        if isinstance(prebuilt, tuple):  # built in the background (ahead, or a planned switch): (thread, box)
            prebuilt = self._build_watching(None, rank, gen, d, pending=prebuilt)
        inner = prebuilt or self._build_watching(None, rank, gen, d)
        state.world.swap(inner, rank, world, gen)
        c10d_glue.register(state.world, range(world))
        state.commit.use(commit_store(self.store(d.store), gen), rank, world, gen, abort_store=commit_store(self.store(d.store), gen))
        self._meet_snapshot_holders(d, rank, world)
        t_world = time.perf_counter()
        rebuild = self._subgroups_to_rebuild(d, rank, old_rank)
        holdings = self._gather_holdings(inner, rank, world, rebuild) if agree else None
        t_gathered = time.perf_counter()
        if holdings is not None:
            rebuild = frozenset().union(*(h.rebuild for h in holdings))
        rebuilt = 1 + self._rebuild_subgroups(d, rank, rebuild)
        t_comm = time.perf_counter()
        received = self._recover(inner, rank, holdings) if agree else False
        state.in_sandbox = False
        t_done = time.perf_counter()
        self.agent.report_entered(
            gen,
            EnteredRecord(
                communicator=(t_world - t0) + (t_comm - t_gathered),
                state=(t_gathered - t_world) + (t_done - t_comm),
                received=received,
                step=state.step,
                began=began,
                last_step_at=state.step_done_at,  # wall clock: tm_launch.joblog
                store_connects=self.clients.opened_on_demand - connects_before,
                tcp_opened=opened.opened(),
                groups_rebuilt=rebuilt,
            ),
        )
        self.status.report(force=True)
        # The next change's connections, opened now that nothing waits for them: to this store,
        # and to the one that takes over if this store's node is lost.
        self.clients.prepare([d.store, d.standby])

    def _meet_snapshot_holders(self, d: Directive, rank: int, world: int) -> None:
        """Tell the generation where this rank's snapshot server listens (its store's
        ``snap/<rank>``), and point this rank's snapshots at its holder in the new world; the
        other ranks' addresses are read when first needed (``endpoint_of``, cached)."""
        host, port = self.snapshots.server.address
        found: dict = {}
        lock = threading.Lock()
        # A connection of its own (a wait here must not hold up the vote), taken now, inside the
        # change, so that the connections kept ready for the next change count it.
        lookup = commit_store(self.store(d.store), d.generation)
        timeout = datetime.timedelta(seconds=self._setup_timeout)

        def endpoint_of(r: int) -> tuple:
            with lock:
                if r not in found:
                    key = f"snap/{r}"
                    lookup.wait([key], timeout)
                    addr, p = lookup.get(key).decode().rsplit(":", 1)
                    found[r] = (addr, int(p))
                return found[r]

        # Ready for what this rank holds in the new world (with parity: the stripes it keeps)
        # before its address is published: a peer's first snapshot may follow at once.
        self.snapshots.enter(rank, world, endpoint_of)
        self.state.commit.store.set(f"snap/{rank}", f"{host}:{port}")

    def _subgroups_to_rebuild(self, d: Directive, rank: int, old_rank: int) -> frozenset:
        """``subgroups_to_rebuild`` from this process's own view of its subgroups."""
        subs = self.state.subgroups
        unusable = {i for i, sub in enumerate(subs) if sub.inner is None or isinstance(sub.inner, LocalBackend)}
        in_process = {i for i, sub in enumerate(subs) if sub.in_process}
        return subgroups_to_rebuild([sub.member_ranks for sub in subs], d, rank, old_rank, unusable, in_process)

    def _rebuild_subgroups(self, d: Directive, rank: int, rebuild: frozenset) -> int:
        """Delta communicator setup: the subgroups of ``rebuild`` (agreed by every rank,
        ``subgroups_to_rebuild``) are built again; the others keep their communicator object and
        its connections. Groups are built in the order the script created them, the same order
        on every rank (each setup waits for all of its members, so two ranks building in
        different orders would wait for each other). A build that fails leaves its group
        without a communicator, so that the next generation rebuilds it on every member.
        Returns how many it rebuilt."""
        rebuilt = 0
        for i, sub in enumerate(self.state.subgroups):
            ranks = sub.member_ranks
            if sub.in_process:
                continue  # nothing to connect, whoever serves its rank
            if rank not in ranks:
                if sub.inner is not None:
                    sub.swap(None, -1, len(ranks), d.generation)  # not a member (any more)
                continue
            if i in rebuild:
                try:
                    built = self._build_watching(ranks, rank, d.generation, d, key=sub.store_key)
                except BaseException:
                    sub.release()
                    raise
                sub.swap(built, ranks.index(rank), len(ranks), d.generation)
                rebuilt += 1
        return rebuilt

    # -- agreeing on the step, and the state ----------------------------------------------------------
    def object_states(self, rank: int, world: int) -> dict:
        """name -> ``ObjectState`` of every registered object: who replicates it, its fingerprints."""
        state = self.state
        out = {}
        for name, obj in state.objects.items():
            sd = obj.state_dict()
            structure, values = fingerprints({name: sd}, {name} if isinstance(obj, torch.nn.Module) else set())
            out[name] = ObjectState(self._replicas(name, obj, sd, rank, world), structure, values)
        return out

    def unreplicated(self, rank: int, world: int) -> frozenset:
        """The registered objects no other live rank holds a copy of (what snapshots send)."""
        return frozenset(
            name for name, obj in self.state.objects.items() if self._replicas(name, obj, obj.state_dict(), rank, world) == {rank}
        )

    def _replicas(self, name: str, obj, sd: dict, rank: int, world: int) -> frozenset:
        """The ranks holding an identical copy of ``obj``. An optimizer's state is laid out like
        its parameters (and may not exist yet, before its first step): its parameters count too
        (a ZeRO partition's: the partition's)."""
        tensors = [sd]
        if isinstance(getattr(obj, "param_groups", None), list):
            tensors.append([p for group in obj.param_groups for p in group["params"]])
        return replica_set({name: tensors}, self.state.declared, rank, world)

    def _gather_holdings(self, pg, rank: int, world: int, rebuild: frozenset) -> list:
        """Every rank says what it holds (``recovery.Holding``) and which subgroups it cannot
        keep, in one all-gather over the new world."""
        state, snapshots = self.state, self.snapshots
        snapshots.wait_idle()
        objects = self.object_states(rank, world)
        snapshots.set_remote((name for name, o in objects.items() if o.replicas == {rank}), state.generation)
        mine = Holding(
            rank,
            -1 if state.step is None else state.step,
            objects,
            per_rank=bool(state.per_rank),
            local=snapshots.local_digests(),
            held=snapshots.server.held(),
            stripes=snapshots.server.stripes_held(),
            rebuild=rebuild,
        )
        return allgather_objects(pg, world, mine)

    def _recover(self, pg, rank: int, holdings: list) -> bool:
        """Every rank computes the same ``recovery.plan_recovery`` from the holdings. Ranks that
        can return to the chosen step from their own snapshot do; the others receive each
        object from a live replica or from their snapshot's holder, and their per-rank state
        with it."""
        state, snapshots = self.state, self.snapshots
        plan = plan_recovery(holdings)
        if plan.tried:
            log(f"steps the job cannot continue from: {'; '.join(f'{s}: {why}' for s, why in plan.tried.items())}")
        if plan.conflicts:
            a, b = plan.conflicts[0]
            raise StateLost(
                f"ranks {a} and {b} should hold the same state (the registered objects are declared replicated across "
                f"them) but it differs at step {plan.step}: declare which ranks replicate it, e.g. "
                f"job.register(model=m, replicas=dp_group)",
                plan.step,
                [a, b],
            )
        if plan.step < 0:
            raise StateLost(
                "no live rank holds any training state (every process of this generation is new)", -1, list(range(len(holdings)))
            )
        if plan.missing:
            raise StateLost(
                f"no live rank and no snapshot holds the state of rank(s) {plan.missing} at step {plan.step} (every replica "
                f"and both copies of its snapshot are gone: two neighbouring nodes lost at once, or snapshots are off)",
                plan.step,
                plan.missing,
            )
        if plan.step < plan.newest:
            log(
                f"continuing from step {plan.step}, {plan.newest - plan.step} step(s) run again (the newest step a rank "
                f"held was {plan.newest}; see the steps above for why not that one)"
            )
        if rank in plan.restore:
            t0 = time.perf_counter()
            snapshots.restore(plan.step, state.objects, state.per_rank)
            state.step = plan.step
            log(f"returned to step {plan.step} from this rank's own snapshot in {(time.perf_counter() - t0) * 1000:.0f} ms")
        sends = [(dst, names) for dst, sources in sorted(plan.live.items()) for src, names in sorted(sources.items()) if src == rank]
        sender = _Background(lambda: self._send_live(pg, sends))
        received = False
        try:
            if rank in plan.receivers:
                self._receive(pg, rank, plan)
                received = True
        finally:
            sender.join()
        snapshots.settle(plan.step)  # every rank: nothing of a later step may ever be returned to
        if snapshots.needs_resend(plan.step, holdings):
            snapshots.resend(plan.step, state.objects, state.per_rank.states_now())
        holder = next((h.rank for h in holdings if rank in h.held), None)
        ours = holdings[holder].held.get(rank, {}) if holder is not None else {}
        if state.per_rank and not (ours.get("mirrors") or {}).get(plan.step):
            tag, exact, record = state.per_rank.record_now(plan.step)
            snapshots.publish_mirror(tag, exact, record)
        return received

    def _send_live(self, pg, sends: list) -> None:
        """This rank's part of the plan's live transfers: the named objects to each receiver."""
        state = self.state
        for dst, names in sends:
            t0 = time.perf_counter()
            sent = send_state(pg, dst, {n: state.objects[n] for n in names}, state.step)
            log(
                f"sent the training state of step {state.step} ({'+'.join(names)}, {human_size(sent)}) to rank {dst} "
                f"in {(time.perf_counter() - t0) * 1000:.0f} ms"
            )

    def _receive(self, pg, rank: int, plan) -> None:
        """Assemble this rank's state at ``plan.step``: objects from live replicas, from its
        snapshot's holder, and its per-rank state. Received in place: until it is complete this
        rank holds no step at all, so a transfer cut short never makes it a source of half-written
        state."""
        state, snapshots = self.state, self.snapshots
        state.step = None
        for src, names in sorted(plan.live.get(rank, {}).items()):
            t0 = time.perf_counter()
            step, got = recv_state(pg, src, {n: state.objects[n] for n in names})
            log(
                f"received the training state of step {step} ({'+'.join(names)}, {human_size(got)}) from rank {src} "
                f"in {(time.perf_counter() - t0) * 1000:.0f} ms"
            )
        per_rank_done = False
        if rank in plan.images:
            holder, names = plan.images[rank]
            t0 = time.perf_counter()
            image = snapshots.fetch(holder, rank, plan.step, names)
            per_rank_done = self._load_snapshot(image, names)
            log(
                f"received this rank's snapshot of step {plan.step} ({'+'.join(names)}, {human_size(image.nbytes)}) "
                f"from rank {holder} in {(time.perf_counter() - t0) * 1000:.0f} ms"
            )
        if rank in plan.parity:
            group, holders, members, names = plan.parity[rank]
            t0 = time.perf_counter()
            image, moved = snapshots.rebuild(holders, group, rank, plan.step, members)
            per_rank_done = self._load_snapshot(image, names)
            log(
                f"rebuilt this rank's snapshot of step {plan.step} ({'+'.join(names) or 'per-rank state'}, {human_size(image.nbytes)}; "
                f"{human_size(moved)} received) from its group's parity on rank(s) {holders} and the snapshots of rank(s) {sorted(members)} "
                f"in {(time.perf_counter() - t0) * 1000:.0f} ms"
            )
        if rank in plan.mirrors and not per_rank_done:
            holder = plan.mirrors[rank]
            lost = state.per_rank.load_mirror(snapshots.fetch_mirror(holder, rank, plan.step), rank, plan.step)
            if lost:
                raise StateLost(f"{lost}: its RNG or data position exists nowhere else", plan.step, [rank])
        state.step = plan.step

    def _load_snapshot(self, image, names) -> bool:
        """Load ``names`` of a received snapshot and the per-rank state it carries; True if it
        carried per-rank state this rank registered."""
        state = self.state
        if names:
            image.load_into(state.objects, names)
        if image.per_rank is not None and state.per_rank:
            state.per_rank.load(image.per_rank)
            return True
        return False


class _Background:
    """``fn`` on a thread of its own; ``join`` re-raises what it raised."""

    def __init__(self, fn):
        self._error: BaseException | None = None

        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 -- re-raised by join()
                self._error = e

        self._thread = threading.Thread(target=run, name="tm-state-send", daemon=True)
        self._thread.start()

    def join(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error
