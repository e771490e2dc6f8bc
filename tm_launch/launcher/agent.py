"""The per-node agent: register, follow the generations, run and watch this node's workers.

One loop, woken the moment anything happens (a worker exits or reports, something under the
job's ``state/`` keys changes: ``tm_launch.launcher.wakeup``; the next active node's agent dies:
``tm_launch.launcher.peer_link``), and at least every ``--monitor-interval``:

1. read the job's state (one etcd range read, or the copy its watch stream keeps up to date; an
   agent that only follows plans reads what changed: ``Membership.refresh``) and, if the plan
   moved on, act on it:
   start workers (fresh or sandboxed), forward the new generation to live workers, or stop;
2. watch local workers (exits, hangs) and health alarms, and report what it finds to etcd;
3. run the pure planner on the same view and try to publish its plan by compare-and-swap.

Only a few designated agents plan (``planner.planners``: the first 3 alive in join order; the
others take over when those are gone), so an event costs O(1) CASes, not one per node; the CAS
makes exactly one plan per generation. A lease-keeper thread keeps this node registered; when
the lease is lost the agent stops its workers (fencing) and exits.

The loop composes parts that each own their state: ``session`` (lease, etcd reachability, the
fencing rule, reports), ``supervisor`` (worker processes and the agent store), ``failures``
(reports about workers' ends and dead peers), ``plan_executor`` (acting on a new plan) and the
``observers`` (alarms, progress and stragglers, entry timings, downtime stamps, metrics,
waiting drains, a warm spare's marker).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time

from rendezvous.kv import KV, KVError, LeaseExpired
from rendezvous.membership import Membership
from rendezvous.plan import SUCCEEDED, NodeInfo, Plan
from rendezvous.planner import View, follows_only, next_plan, spares

from .. import settings
from ..waits import Every
from .collective_watch import CollectiveWatch
from .config import AgentConfig
from .events import EventLog
from .failures import FailureWatch
from .fencing import lapsed_but_alive, plans_while_settling
from .observers import (
    AlarmWatch,
    DowntimeStamps,
    DrainWaitNote,
    EntryReport,
    MetricsFeed,
    ProgressPublisher,
    StragglerWatch,
    WarmSpareMarker,
)
from .peer_link import ETCD_CONTACT, PeerLink, last_etcd_contacts, probe_targets, successor
from .plan_executor import PlanExecutor
from .session import EtcdGone, EtcdSession, Fenced
from .supervisor import WorkerSupervisor
from .wakeup import StateWatch, Wakeup

JOINED_NAMED = 16  # the waiting line names this many nodes, then counts

__all__ = ["Agent", "AgentConfig"]  # AgentConfig: what tm_launch.cli builds an Agent from


class Agent:
    def __init__(self, cfg: AgentConfig, kv: KV):
        self.cfg = cfg
        self.kv = kv
        members = Membership(kv)
        self.metrics = MetricsFeed(cfg.node_id, members)
        self.events = EventLog(cfg.node_id, cfg.event_log, members, self.metrics)
        say = self.say = self.events.say
        # Every source of news wakes the loop at once (tm_launch.launcher.wakeup): worker exits, workers'
        # reports, etcd changes; the --monitor-interval tick is only the upper bound.
        self.wakeup = Wakeup()
        self.state_watch = StateWatch(self.wakeup)
        self.supervisor = WorkerSupervisor(cfg, say, self.wakeup)
        self.peer_addrs: list[tuple[str, int]] = []  # the agents this node asks before fencing for etcd's silence
        self.agent_addrs: dict[str, tuple[str, int]] = {}  # every node's agent store seen registered (for lapsed leases)
        self.said_lapsed: set[str] = set()  # nodes said to have lapsed alive
        self.session = EtcdSession(
            members,
            cfg.node_id,
            cfg.lease_ttl,
            settings.stall_bound(cfg.collective_timeout),
            say,
            self.supervisor.local_progress,
            worker_exits=lambda: self.supervisor.workers.poll() if self.supervisor.workers else {},
            followed=lambda: self.executor.plan,
            ask_peers=lambda: last_etcd_contacts(self.peer_addrs),
            share_contact=lambda when: self.supervisor.store.set(ETCD_CONTACT, repr(when)),
        )
        self.failures = FailureWatch(cfg, self.session, self.supervisor, say)
        self.collectives = CollectiveWatch(cfg, self.session, self.supervisor, say)  # stuck collectives (C4)
        self.executor = PlanExecutor(cfg, self.session, self.supervisor, self.failures, self.metrics, say)
        self.alarms = AlarmWatch(cfg, self.session, self.supervisor, say, wake=lambda: self.wakeup.set("alarm"))
        self.progress = ProgressPublisher(cfg.node_id, self.session, self.supervisor, self.metrics, StragglerWatch(cfg, self.session, say))
        self.entry = EntryReport(cfg.node_id, self.supervisor, self.metrics, say)
        self.stamps = DowntimeStamps(cfg.node_id, self.session, self.supervisor)
        self.drain_wait = DrainWaitNote(cfg.node_id, say)
        self.warm_marker = WarmSpareMarker(cfg.node_id, self.session, self.supervisor)
        self.peer_link = PeerLink(wake=lambda: self.wakeup.set("peer"))  # the next active node's agent
        # The loop's own state: when to read etcd again, and whether this node plans.
        self.started = time.time()  # both again when it runs: the join timeout counts from there
        self.join_wait = Every()  # progress lines while the first generation forms
        self.min_reached_at: float | None = None  # MIN nodes alive since (the join window's last call)
        self.state_changed = True  # the last watch saw a change under state/: re-read etcd
        self.planning = True  # this agent is one of the designated planners (see planner.planners)

    # -- start ------------------------------------------------------------------------------------
    def run(self) -> int:
        current = self.session.direct.plan()  # not a whole snapshot: N joiners would read N records each
        if current and current.finished:
            raise SystemExit(
                f"tm-launch: error: run id '{self.cfg.run_id}' already finished ({current.state}); start the job with a new --rdzv-id"
            )
        self.started, self.join_wait = time.time(), Every()
        self.metrics.serve(self.cfg.addr, self.cfg.metrics_port, self.say)
        self.session.register(
            NodeInfo(
                id=self.cfg.node_id,
                host=socket.gethostname(),
                addr=self.cfg.addr,
                store_port=self.supervisor.store.port,
                nproc=self.cfg.nproc,
                pid=os.getpid(),
                joined=time.time(),
            )
        )
        self.alarms.start()
        self.say(
            f"joined run '{self.cfg.run_id}' ({self.cfg.nproc} worker(s) per node, nnodes {self.cfg.limits.min_nodes}:{self.cfg.limits.max_nodes})",
            kind="joined",
        )
        try:
            return self._loop()
        except Fenced as e:
            self.supervisor.workers.stop(grace=0)
            self.say(f"lost membership: {e}; stopped this node's workers (fencing)", kind="fenced", publish=False)
            self.session.record_fenced(str(e))
            return 1
        except EtcdGone as e:
            self.supervisor.workers.stop(grace=0)
            self.say(f"giving up on etcd: {e}", kind="etcd_gone", publish=False)
            print(f"tm-launch: error: node {self.cfg.node_id}: {e}", file=sys.stderr, flush=True)
            return e.code
        except KeyboardInterrupt:
            self.supervisor.workers.stop()
            return 130
        finally:
            self.state_watch.close()
            self.peer_link.close()
            self.alarms.stop()
            self.metrics.stop()
            self.supervisor.close()
            self.events.close()  # the last events reach etcd while the session still holds it
            self.session.close()

    # -- the loop ---------------------------------------------------------------------------------
    def _loop(self) -> int:
        """Read, tick, repeat. Every etcd request in here goes through ``session.members``, which
        retries it in place under the one retry policy (``EtcdSession.retrying``); the ``except``
        below is a second net for anything that still raises (the iteration is then run again
        from a fresh read) and the way back after a lease etcd no longer has (register anew)."""
        session = self.session
        snap, fresh_until = None, 0.0
        while True:
            reading = False
            try:
                session.apply_fencing_rule(self.executor.plan)
                if snap is None or self.state_changed or (self.planning and time.time() >= fresh_until) or session.lost_lease.is_set():
                    reading = True  # after a lost lease, a read that shows whether etcd answers (not the mirror)
                    snap = session.members.refresh(snap, self.cfg.node_id, fresh=session.lost_lease.is_set())
                    snap = session.members.with_records(snap, self._peers(snap.view.plan))
                    self._note_peer_addrs(snap)
                    session.answered()
                    session.apply_fencing_rule(self.executor.plan, snap)  # may register anew: retried like any request
                    # Re-read etcd when the watch saw a change, else (planners only) once a second:
                    # time-based rules (the join window, the grace of an exit report) still move on.
                    fresh_until = time.time() + 1.0
                    reading = False
                self.supervisor.new_iteration()
                code = self._tick(snap)
            except LeaseExpired:
                snap = None  # a write named the lease etcd no longer has: read afresh and register anew
                continue
            except KVError as e:  # an unreadable plan (said once), or anything the retries did not hold
                session.back_off(e, self.executor.plan)
                if not reading:
                    snap = None
                continue
            if code is not None:
                return code

    def _lapsed_but_alive(self, view) -> bool:
        """``fencing.lapsed_but_alive`` for the active nodes whose lease lapsed (no report, no
        cordon), asked of their agents' stores; said once per such node."""
        lapsed = [n for n in view.plan.nodes if n not in view.alive and n not in view.reports and n not in view.failed]
        addrs = [self.agent_addrs[n] for n in lapsed if n in self.agent_addrs]
        if not addrs:
            return False
        contacts = last_etcd_contacts(addrs)
        request_timeout = self.kv.options.timeout if hasattr(self.kv, "options") else 0.0
        if not lapsed_but_alive(contacts, time.time(), self.cfg.lease_ttl, request_timeout):
            return False
        news = set(lapsed) - self.said_lapsed
        if news:
            self.said_lapsed |= news
            self.say(
                f"{', '.join(sorted(news))}: lease lapsed, but its agent answers and etcd answered it within "
                f"{2 * self.cfg.lease_ttl + request_timeout:g}s (a late renewal): not replaced, waiting for it to register again",
                kind="lapsed_alive",
                nodes=sorted(news),
            )
        return True

    def _note_peer_addrs(self, snap) -> None:
        """The agents this node would ask, before fencing itself for etcd's silence, whether etcd
        answers them (``fencing.peers_cut_off``): the peers it probes (``peer_link.probe_targets``)."""
        alive = snap.view.alive
        self.peer_addrs = [(alive[n].addr, alive[n].store_port) for n in self._peers(snap.view.plan) if n in alive]
        self.agent_addrs.update((n, (info.addr, info.store_port)) for n, info in alive.items())

    def _tick(self, snap) -> int | None:
        """One pass of the loop over one consistent view; an exit code when the agent is done."""
        view, me = snap.view, self.cfg.node_id
        followed = self.executor.plan
        if view.plan is not None and (followed is None or view.plan.generation != followed.generation):
            code = self._follow(view, view.now)
            if code is not None:
                return code
        plan = self.executor.plan
        if view.plan is None:
            self._check_join_timeout(snap)
        elif plan is not None and me not in plan.nodes and not self.supervisor.workers and view.live:
            self.executor.be_spare(plan, view)  # the job turned out to be live: warm up now
        self._link_to_successor(plan, view)
        self.failures.watch_workers(plan, view)
        self.collectives.check(plan, view)
        self.failures.probe_peers(plan, view)
        dropped = self.peer_link.take_dropped()
        if dropped is not None and self.failures.report_if_lost(plan, view, dropped):
            self.peer_link.answered(dropped)  # the link broke, the peer lives: watch it again
        self.entry.report(plan)
        self.stamps.write()
        self.alarms.handle(plan)
        self.progress.publish(plan)
        self.metrics.on_state(view, plan, snap.spares_alive)
        self.drain_wait.note(view)
        self.warm_marker.update(plan)
        self.planning = me in snap.planners
        if self.session.take_reported():
            self.state_changed = True  # plan on a view that includes this iteration's reports
            return None
        decision = next_plan(self._with_last_call(view), self.cfg.limits) if self.planning else None
        if (
            decision is not None
            and decision.state != SUCCEEDED
            and view.plan is not None
            and self.session.settling()
            and not plans_while_settling(
                live=decision.live,
                finished=decision.finished,
                removed=set(decision.removed),
                replaced=set(decision.replaced.values()),
                reported=set(view.reports) | set(view.failed),
            )
        ):
            decision = None  # right after an etcd outage: let every node re-register first
        if decision is not None and decision.state != SUCCEEDED and view.plan is not None and self._lapsed_but_alive(view):
            decision = None  # a lease lapsed on a late renewal: its node registers again
        sent_at = time.time()
        if decision is not None and self.session.members.publish(
            decision, snap.plan_entry, view.alive, len(spares(dataclasses.replace(view, plan=decision)))
        ):
            self._announce(decision)
            self.stamps.plan_published(decision, sent_at, view)
            self.state_changed = True  # look at the new state at once
            # Its own plan is followed now, not after reading it back from etcd on the next
            # iteration (10-25 ms on a loaded 2-core machine, on every change this node plans).
            return self._follow(dataclasses.replace(view, plan=decision), time.time())
        # Our own writes (reports, cordons) move the revision past the snapshot's too, so the
        # wait returns at once and the next iteration plans on them. An agent that does not
        # plan wakes only for a new plan, a marker naming it a planner or no planner left
        # (rendezvous.marker_watch), except group rank 0, a joiner, and a spare that has yet to
        # learn the job is live (it must warm up): joins and losses cost the others nothing.
        self.session.mark_planner(snap.planners)
        follow_only = follows_only(view, me, self.planning)
        members = self.session.members
        if follow_only:
            self.state_watch.arm("plan", lambda: members.watch_plan(me), snap.revision)
        else:
            self.state_watch.arm(StateWatch.WIDEST, members.watch, snap.revision)
        # A peer's connection ended: read etcd again before probing it (it may have left the plan).
        self.state_changed = bool({"etcd", "peer"} & self.wakeup.wait(self.cfg.monitor_interval))
        return None

    def _peers(self, plan: Plan | None) -> list[str]:
        """The nodes whose agents this one connects to: its successor, kept open, and the peers
        it probes (``peer_link.probe_targets``, the successor first). A view that only follows
        plans holds their records and no others (``Membership.with_records``)."""
        if plan is None or plan.finished:
            return []
        return probe_targets(plan.nodes, self.cfg.node_id)

    def _link_to_successor(self, plan: Plan | None, view: View) -> None:
        """Keep a connection to the next active node's agent (``tm_launch.launcher.peer_link``): its death
        is then known when it happens, whatever its workers and ours are doing."""
        me = self.cfg.node_id
        node = successor(plan.nodes, me) if plan is not None and not plan.finished else None
        info = view.alive.get(node) if node is not None else None
        self.peer_link.watch((node, info.addr, info.store_port) if info is not None else None, plan.generation if plan is not None else -1)

    def _with_last_call(self, view: View) -> View:
        """The planner's view with the join window applied: with MIN nodes alive the first plan
        waits ``--last-call`` seconds for more to join."""
        if view.plan is not None:
            return view
        n = len(spares(view))
        if n >= self.cfg.limits.min_nodes:
            self.min_reached_at = self.min_reached_at or time.time()
        else:
            self.min_reached_at = None
        passed = self.min_reached_at is not None and time.time() - self.min_reached_at >= self.cfg.last_call
        return dataclasses.replace(view, last_call_passed=passed)

    def _check_join_timeout(self, snap) -> None:
        """Say every few seconds who has joined while generation 0 forms, and give up after
        ``--join-timeout``. A node that only follows (``snap.partial``) holds no records: it
        counts the nodes instead (one small read, only when it speaks)."""
        waited = time.time() - self.started
        timed_out = waited > self.cfg.join_timeout
        if not self.join_wait.due() and not timed_out:
            return
        joined = None if snap.partial else sorted(snap.view.alive)
        count = self.session.members.joined() if joined is None else len(joined)
        if not timed_out:
            named = joined[:JOINED_NAMED] if joined is not None else None  # a line (and event) per node: O(1) each
            names = "" if named is None else f" ({', '.join(named) or 'none'}{', ...' if count > len(named) else ''})"
            self.say(
                f"waiting for {self.cfg.limits.min_nodes} node(s) to join run '{self.cfg.run_id}': {count} joined"
                f"{names}; {waited:.0f} s of {self.cfg.join_timeout:.0f} s",
                kind="waiting",
                waiting_for="nodes",
                joined=named,
                joined_count=count,
                elapsed_s=round(waited, 1),
                limit_s=self.cfg.join_timeout,
            )
            return
        raise SystemExit(
            f"tm-launch: error: waited {waited:.0f}s for {self.cfg.limits.min_nodes} node(s) to join run "
            f"'{self.cfg.run_id}', {count} joined; start the other nodes or lower --nnodes"
        )

    def _follow(self, view, seen_at: float) -> int | None:
        """Do what ``view.plan`` asks of this node; an exit code when the agent is done."""
        self.stamps.plan_seen(view.plan, seen_at)
        code = self.executor.follow(view.plan, view)
        if code is not None:
            self.stamps.flush()
        return code

    def _announce(self, plan: Plan) -> None:
        if plan.finished:
            return  # every agent says it when it follows the plan
        moves = ", ".join(f"{new} takes the ranks of {old}" for new, old in plan.replaced.items()) or "no spare used"
        if plan.live:
            mode = "live (survivors keep their processes)"
        elif plan.generation == 0:
            mode = "all workers start; failures are repaired in place once they enter tm_launch's live loop"
        else:
            mode = f"restart (all workers start afresh: {plan.restart_why or 'not live'})"
        self.say(
            f"published generation {plan.generation}: {plan.cause}; {moves}; {mode}",
            kind="plan",
            generation=plan.generation,
            cause=plan.cause,
            replaced=plan.replaced,
            removed=list(plan.removed),
            live=plan.live,
            restart_why=plan.restart_why,
            planned=plan.planned,
            nodes=list(plan.nodes),
        )
