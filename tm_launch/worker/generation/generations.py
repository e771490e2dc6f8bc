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

from ...protocol import Directive, EnteredRecord, WorkerEnv, WorkerState
from .. import torch_patches
from ..agent_client import AgentClient
from ..comms import communicators, connections
from ..comms.groups import LocalBackend
from ..log import first_line, log
from ..snapshots import Snapshots
from ..step_report import LiveStatus
from .commit import commit_store
from .directives import Directives
from .state_exchange import StateExchange, StateLost
from .world_builds import Superseded, WorldBuilds

__all__ = ["Generations", "StateLost", "Superseded", "membership_changed", "subgroups_to_rebuild"]


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

    def __init__(self, state, agent: AgentClient, status: LiveStatus, env: WorkerEnv, devices: tuple, snapshots: Snapshots):
        self.state = state  # the worker's TrainingState (``job.training_state``)
        self.agent = agent
        self.directives = Directives(agent)
        self.status = status
        self.snapshots = snapshots
        self.local_rank = env.local_rank
        self.builds = WorldBuilds(state, self.directives, env, devices)
        self.exchange = StateExchange(state, snapshots)
        self.pending: dict | None = None  # a planned switch being prepared

    def close(self) -> None:
        pending = self.pending
        if pending and pending.get("thread") is not None:
            pending["thread"].join(timeout=5)
            communicators.release(pending["built"].get("pg"))  # built for a switch that never came
        self.pending = None
        self.builds.close()

    def abort_changed(self, d: Directive) -> list:
        """Directive watcher, unplanned generation ``d``: give up the communicators of every group
        whose membership ``d`` changes (``LiveGroup.abort_soon``: gloo's connections shut down,
        NCCL aborted off this thread; only communicators of older generations). The groups
        whose communicator was ended."""
        rank, old_rank = d.rank_of(self.local_rank), self.state.rank
        return [g for g in self.state.groups if membership_changed(g.member_ranks, d, rank, old_rank) and g.abort_soon(d.generation)]

    # -- at a step boundary, and on the directive watcher's thread ----------------------------------
    def on_directive(self, d: Directive) -> None:
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
                ended = self.abort_changed(d)
                if ended:
                    log.info(
                        f"generation {d.generation}: gave up {len(ended)} communicator(s) it changes (a collective waiting on a lost rank ends now)"
                    )
            except Exception as e:  # noqa: BLE001 -- the watcher must live on; the step boundary still recovers
                log.info(f"aborting the communicators generation {d.generation} changes failed: {e}")
            self.builds.build_ahead_as_survivor(d)  # its world connects while the interrupted step ends

    def at_boundary(self) -> None:
        """Between two steps: after a failed collective, wait for the next generation and enter
        it (the step runs again unless it committed); after a healthy step, follow a newer
        generation (a planned switch, or a peer's failure this rank has not met yet)."""
        state = self.state
        if state.poison.active:
            error = first_line(state.poison.error)
            self.status.recovering(f"a collective failed ({error})")
            what = (
                "committed; a collective after its commit failed"
                if state.commit.decision
                else "interrupted, nothing applied; it runs again"
            )
            log.info(f"step {state.commit.step} {what} ({error}); waiting for the next generation")
            state.clear_step_effects()
            for g in state.groups:
                g.release_if_broken()
            if not state.commit.decision:  # it runs again, with the RNG and data it started with
                state.per_rank.restore()
            committed = bool(state.commit.decision)
            abandoned = state.poison.abandoned
            d = self.directives.wait_after(state.world.generation)
            state.poison.clear()
            # A committed step lets the peers whose collectives all succeeded begin the next one:
            # they may wait for this rank in a subgroup ``d`` keeps, as for a rank late to its
            # boundary (``Generations.follow``); so does a step this rank left part-way
            # (``StepPoison.abandon``), whose remaining collectives its peers still run.
            self.follow(d, interrupted=True, committed=committed, abandoned=abandoned)
            self.status.state = WorkerState.RUNNING
            return
        generation = state.world.generation
        if self.pending is not None or self.directives.newer_than(generation):
            d = self.directives.newest_after(generation)
            if d is not None:
                self.follow(d, interrupted=False)

    # -- following the agent -------------------------------------------------------------------
    def follow(self, d: Directive, interrupted: bool, committed: bool = False, abandoned: bool = False) -> None:
        """Enter ``d`` from a step boundary: after a healthy step (``interrupted`` False) or one a
        failed collective poisoned, which may still have ``committed`` (a collective after the
        commit failed) or been ``abandoned`` part-way (``StepPoison.abandon``)."""
        if d.stop:
            self._leave()
        if d.planned and not interrupted and self._planned_switch(d):
            return
        if not d.active:
            self._leave()
        self.pending = None
        # After a step that committed, a peer may already be inside the next step, waiting for
        # this rank in a collective of a group that ``d`` does not change (``_enter_once``).
        self.enter(d, late=committed or abandoned or not interrupted)

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
            store = self.builds.store(d.store)
            margin = max(2, math.ceil(0.5 / max(state.stats.median() or 0.01, 1e-3)))
            agreed = int(store.compare_set(f"tm/g{gen}/switch", "", str(state.step + margin)))
            thread, built = self.builds.build_in_background(None, d.rank_of(self.local_rank), gen, d) if d.active else (None, {})
            self.pending = {"generation": gen, "switch": agreed, "thread": thread, "built": built}
            log.info(f"planned migration to generation {gen}: switching at step {agreed}")
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
                log.info(f"leaving at step {state.step}: its snapshot did not reach its holder ({first_line(e)})")
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
            ahead = self.builds.take_ahead(d.generation)
            switching = prebuilt is not None  # a planned switch's build: the old world is healthy to the end
            prebuilt = prebuilt if prebuilt is not None else ahead
            try:
                self._enter_once(d, prebuilt, agree, late, switching)
                return
            except Superseded as newer:
                log.info(f"generation {d.generation} was superseded by {newer.directive.generation} while entering it")
                d = newer.directive
            except StateLost:
                raise
            except RuntimeError as e:  # gloo/store errors: a peer died while entering
                why = f"entering generation {d.generation} failed ({first_line(e)})"
                self.status.recovering(why)
                log.info(f"{why}; waiting for the next generation")
                d = self.directives.wait_after(d.generation)
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
        builds = self.builds
        connects_before = builds.clients.opened_on_demand
        # Counted from before the communicator's build: one built ahead (a spare running the
        # script again, a planned switch) opened its listener before this call.
        opened = prebuilt[1]["mark"] if isinstance(prebuilt, tuple) else connections.Mark()
        gen, rank, world = d.generation, d.rank_of(self.local_rank), d.world_size
        builds.current = d
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
            prebuilt = builds.build_watching(None, rank, gen, d, pending=prebuilt)
        inner = prebuilt or builds.build_watching(None, rank, gen, d)
        state.world.swap(inner, rank, world, gen)
        torch_patches.register(state.world, range(world))
        state.commit.use(commit_store(builds.store(d.store), gen), rank, world, gen, abort_store=commit_store(builds.store(d.store), gen))
        self._meet_snapshot_holders(d, rank, world)
        t_world = time.perf_counter()
        rebuild = self._subgroups_to_rebuild(d, rank, old_rank)
        holdings = self.exchange.gather_holdings(inner, rank, world, rebuild) if agree else None
        t_gathered = time.perf_counter()
        if holdings is not None:
            rebuild = frozenset().union(*(h.rebuild for h in holdings))
        rebuilt = 1 + self._rebuild_subgroups(d, rank, rebuild)
        t_comm = time.perf_counter()
        received = self.exchange.recover(inner, rank, holdings) if agree else False
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
                store_connects=builds.clients.opened_on_demand - connects_before,
                tcp_opened=opened.opened(),
                groups_rebuilt=rebuilt,
            ),
        )
        self.status.report(force=True)
        # The next change's connections, opened now that nothing waits for them: to this store,
        # and to the one that takes over if this store's node is lost.
        builds.clients.prepare([d.store, d.standby])

    def _meet_snapshot_holders(self, d: Directive, rank: int, world: int) -> None:
        """Tell the generation where this rank's snapshot server listens (its store's
        ``snap/<rank>``), and point this rank's snapshots at its holder in the new world; the
        other ranks' addresses are read when first needed (``endpoint_of``, cached)."""
        host, port = self.snapshots.server.address
        found: dict = {}
        lock = threading.Lock()
        # A connection of its own (a wait here must not hold up the vote), taken now, inside the
        # change, so that the connections kept ready for the next change count it.
        lookup = commit_store(self.builds.store(d.store), d.generation)
        timeout = datetime.timedelta(seconds=self.builds.setup_timeout)

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
                    built = self.builds.build_watching(ranks, rank, d.generation, d, key=sub.store_key)
                except BaseException:
                    sub.release()
                    raise
                sub.swap(built, ranks.index(rank), len(ranks), d.generation)
                rebuilt += 1
        return rebuilt
