"""This node's session with etcd: its registration and lease, whether etcd answers, the fencing
rule that follows from both, the retry policy for everything the running agent asks of etcd, and
the reports the planner must see.

The lease keeper thread only records what happens (the last refresh that got through, refreshes
failing, the lease gone); what that means for the workers (keep training, fence, register again)
is decided by the main loop through ``apply_fencing_rule``, so one thread owns the workers' fate.

Every request the main loop makes goes through ``session.members`` (a ``PatientMembership``):
a request etcd does not answer is retried in place under ``etcd_retry``'s policy (``back_off``),
with the fencing rule applied while it waits; fencing (``Fenced``) and giving up on an etcd that
is gone while this node has nothing left to run (``EtcdGone``) are the only ways out. The agent's
other threads (the lease keeper, the event log, the watch streams) retry on their own with the
same delays (``etcd_retry.retry_delay``) and leave the decisions to the loop. Only the requests
made before the agent runs (the first read, the first registration) use ``direct``: their
failure is the start-up refusal.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

from rendezvous.kv import KVError, Lease, LeaseExpired
from rendezvous.membership import Membership, UnreadablePlan
from rendezvous.operator_log import OperatorLog
from rendezvous.plan import NodeInfo, Plan

from ..logs import logger
from ..waits import Every
from .etcd_retry import GIVE_UP, gone_after, outage_decision, retry_delay
from .fencing import FENCE, REREGISTER, lease_decision, peers_cut_off, settling_after_outage

log = logger(__name__)


class Fenced(Exception):
    """This node lost its lease: it no longer owns any rank."""


class EtcdGone(Exception):
    """etcd has been silent for ``etcd_retry.gone_after`` and this node has nothing left to run."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class Patient:
    """An object that asks etcd (``Membership``, its ``OperatorLog``) as the running agent's loop
    uses it: every method call that etcd does not answer is retried in place by
    ``EtcdSession.retrying`` (the one retry policy), so no request of the loop can raise an etcd
    error into it. Calls from other threads, and attributes that are not methods, go straight to
    the object (``direct``)."""

    def __init__(self, direct: Membership | OperatorLog, session: EtcdSession):
        self.direct = direct
        self._session = session
        self._owner = threading.get_ident()  # the thread the fencing rule may act on: the loop's

    def __getattr__(self, name: str):
        attr = getattr(self.direct, name)
        if not callable(attr) or threading.get_ident() != self._owner:
            return attr
        return lambda *args, **kwargs: self._session.retrying(lambda: attr(*args, **kwargs))


class PatientMembership(Patient):
    """``Membership`` as the running agent's loop uses it (``Patient``), its ``operator_log``
    too: a progress record or an alarm the loop writes is a request like any other."""

    def __init__(self, members: Membership, session: EtcdSession):
        super().__init__(members, session)
        self.operator_log = Patient(members.operator_log, session)


class EtcdSession:
    def __init__(
        self,
        members: Membership,
        node_id: str,
        lease_ttl: float,
        stall_limit: float,
        say: Callable[..., None],
        local_progress: Callable[[], tuple[bool, float | None]],
        worker_exits: Callable[[], dict[int, int | None]] = dict,
        followed: Callable[[], Plan | None] = lambda: None,
        ask_peers: Callable[[], list[float | None]] = list,
        share_contact: Callable[[float], None] = lambda when: None,
    ):
        self.direct = members  # before the agent runs: a failure here is the start-up refusal
        self.members = PatientMembership(members, self)
        self.node_id = node_id
        self.ttl = lease_ttl
        self.stall_limit = stall_limit  # a worker stalled longer than this is stuck in a collective
        self.say = say
        self.local_progress = local_progress  # (recovering, seconds since the last step): the fencing rule's input
        self.worker_exits = worker_exits  # local rank -> exit code, None while it runs
        self.followed = followed  # the generation the agent follows (the executor's plan)
        self.ask_peers = ask_peers  # when etcd last answered each peer this node asks (I/O: peer_link)
        self.share_contact = share_contact  # tell the peers when etcd last answered this node (its store)
        self.etcd_ok_at = time.time()  # the last request of this agent that etcd answered
        self.shared_contact = 0.0
        self.asked_peers: tuple[float, bool] = (0.0, False)  # (when, whether they were cut off too)
        self.failed_in_a_row = 0  # requests of the loop that etcd did not answer, since one it did
        self.sparing: str | None = None  # said once: a fence not done because etcd is down for the peers too
        self.info: NodeInfo | None = None
        self.lease: Lease | None = None
        self.given_back: Lease | None = None  # the lease ``close`` revoked
        self.lost_lease = threading.Event()
        # etcd reachability, for the fencing rule (see fencing.py) and to say once when it goes
        # away and once when it is back, whichever thread notices first.
        self.etcd_ok, self.etcd_down_at, self.etcd_back_at = True, 0.0, None
        self._etcd_lock = threading.Lock()
        self.lease_ok_at = time.time()  # the last lease refresh that got through
        self.lease_failing = False  # the last lease refresh did not get through
        self.etcd_wait, self.etcd_seen = None, 0.0  # progress lines while etcd is unreachable
        self.unreadable_plan = ""  # said once while state/plan stays unreadable
        self.planner_marked: tuple | None = None  # (lease, planners) of the marker written (Membership.mark_planner)
        self.reported = False  # a report was written since the last snapshot: plan on a view that includes it

    # -- lease ----------------------------------------------------------------------------------
    def register(self, info: NodeInfo) -> None:
        """Register this node on a fresh lease and keep the lease alive from a thread."""
        self.info = info
        try:
            self.lease = self.direct.register(info, self.ttl)
        except ValueError as e:
            raise SystemExit(f"tm-launch: error: {e}") from None
        threading.Thread(target=self._keep_lease, daemon=True).start()

    def _keep_lease(self) -> None:
        """Refresh the lease; record when it last got through. Deciding what a failing refresh
        means (keep training, fence, rejoin) is the main loop's job: see apply_fencing_rule."""
        interval = max(self.ttl / 3.0, 0.1)
        lease = self.lease
        failed = 0  # refreshes in a row that did not get through: the next comes sooner (etcd_retry)
        while not self.lost_lease.is_set() and lease is self.lease:
            time.sleep(retry_delay(failed, self.ttl, random.random()) if failed else interval)
            if lease is not self.lease:
                return
            asked = time.time()
            try:
                alive = lease.refresh()
            except Exception as e:  # KVError, or a client library's own error: not through either way
                failed += 1
                self.lease_failing = True
                self.note_etcd(False, e if isinstance(e, KVError) else KVError(f"{type(e).__name__}: {e}"))
                continue
            failed = 0
            self.note_etcd(True)
            if time.time() - asked > self.ttl / 3 or time.time() - self.lease_ok_at > 0.6 * self.ttl:
                self.note_impaired()  # a renewal that came late: every lease may have lapsed, not just one
            if not alive:
                self.lease_failing = True  # no lease keeps this node now: the fencing rule's clock runs
                self.lost_lease.set()
                return
            self.lease_ok_at, self.lease_failing = time.time(), False

    def close(self) -> None:
        """Give the lease back at exit, so the others see this node go at once, not after the TTL.
        Once: a node leaving the job gives it back early (``PlanExecutor._leave``), then exits."""
        lease = self.lease
        if lease is None or lease is self.given_back or self.lost_lease.is_set():
            return
        self.given_back = lease
        try:
            lease.revoke()
        except KVError:
            pass

    # -- reachability ---------------------------------------------------------------------------
    def note_etcd(self, ok: bool, error: Exception | None = None) -> None:
        """Say once when etcd stops answering and once when it answers again (not per retry)."""
        if ok:
            self.etcd_ok_at = time.time()
        with self._etcd_lock:
            if ok == self.etcd_ok:
                return
            self.etcd_ok = ok
            if not ok:
                self.etcd_down_at = time.time()
            else:
                self.etcd_back_at = time.time()
            down_for = time.time() - self.etcd_down_at
        if ok:
            self.say(f"etcd reachable again after {down_for:.1f}s", kind="etcd_back", down_s=down_for)
        else:
            self.say(f"lost contact with etcd: {error}; this node's workers keep training, retrying", kind="etcd_down", publish=False)

    def note_impaired(self) -> None:
        """etcd answered, but late, or this node's own lease lapsed: etcd was frozen (SIGSTOP, a
        paused VM, an election that hung requests instead of refusing them) or this agent
        stalled. Neither shows as a failed request, and both can expire every lease at once, so
        planners hold back replacements as after an outage (``settling``)."""
        with self._etcd_lock:
            self.etcd_back_at = time.time()

    def answered(self) -> None:
        """A read of the job's state got through."""
        self.unreadable_plan = ""
        self.failed_in_a_row = 0
        self.note_etcd(True)

    def retrying(self, request: Callable[[], object]):
        """``request()``, asked again under the retry policy until etcd answers: the one place a
        running agent's loop retries etcd. Leaves only by the fencing rule (``Fenced``), by
        ``EtcdGone`` (etcd silent for ``etcd_retry.gone_after`` and nothing left to run), or by
        ``LeaseExpired`` (a write on a lease etcd no longer has: the loop registers again, which
        this request cannot wait for)."""
        retried = False
        while True:
            asked = time.time()
            try:
                result = request()
            except LeaseExpired:
                self.lease_failing = True
                self.lost_lease.set()
                raise
            except UnreadablePlan:
                raise  # etcd answered: the loop says it once and waits for an operator
            except KVError as e:
                self.back_off(e, self.followed())
                retried = True
                continue
            if retried:  # etcd answered the request it had failed (many calls read only local copies)
                self.failed_in_a_row = 0
                self.note_etcd(True)
            if time.time() - asked > self.ttl / 3:
                self.note_impaired()  # a read that hung while etcd was frozen: do not plan on the leases it shows
            return result

    def back_off(self, error: Exception, plan: Plan | None) -> None:
        """Wait before asking etcd again (``etcd_retry.retry_delay``: from 50 ms, doubling, to a
        second), applying the fencing rule meanwhile: a worker that starts recovering must get
        this node fenced at once, not at the next retry. Said once when etcd goes (and once when
        it is back), with a progress line every few seconds between; an unreadable plan is said
        once: it stays until an operator restores it. Raises ``EtcdGone`` once etcd has been
        silent for ``etcd_retry.gone_after`` while this node has nothing left to run."""
        if isinstance(error, UnreadablePlan):
            if str(error) != self.unreadable_plan:
                self.unreadable_plan = str(error)
                self.say(f"etcd: {error}", kind="plan_unreadable", publish=False)
        else:
            self.note_etcd(False, error)
            if self.etcd_wait is None or time.time() - self.etcd_seen > 5 * self.ttl:
                self.etcd_wait = Every()
            self.etcd_seen = time.time()
            if self.etcd_wait.due():
                self.say(
                    f"etcd still unreachable after {self.etcd_wait.elapsed:.0f} s: {error}; retrying",
                    kind="etcd_unreachable",
                    publish=False,
                    elapsed_s=round(self.etcd_wait.elapsed, 1),
                )
            self.failed_in_a_row += 1
            self._give_up_if_gone(error, plan)
        until = time.time() + (
            retry_delay(self.failed_in_a_row, self.ttl, random.random()) if self.failed_in_a_row else min(1.0, self.ttl / 3)
        )
        while True:
            self.apply_fencing_rule(plan)
            left = until - time.time()
            if left <= 0:
                return
            time.sleep(min(0.05, left))

    def _give_up_if_gone(self, error: Exception, plan: Plan | None) -> None:
        """``EtcdGone`` when ``etcd_retry.outage_decision`` says this agent has asked long enough."""
        exits = self.worker_exits()
        active = plan is not None and self.node_id in plan.nodes and not plan.finished
        running = active and any(code is None for code in exits.values())
        with self._etcd_lock:
            silent_for = None if self.etcd_ok else time.time() - self.etcd_down_at
        if outage_decision(silent_for=silent_for, ttl=self.ttl, workers_running=running) != GIVE_UP:
            return
        finished = bool(exits) and all(code == 0 for code in exits.values())
        what = "its workers finished" if finished else ("its workers ended" if exits else "it runs no worker: a spare, or not started yet")
        raise EtcdGone(
            f"etcd unreachable for {silent_for:.0f}s ({error}), and this node has nothing left to run ({what}): stopped "
            f"retrying after {gone_after(self.ttl):.0f}s. If the job goes on, its state is in etcd: start this node again once etcd is back",
            0 if finished else 1,
        )

    def settling(self) -> bool:
        """Right after an etcd outage, or while this agent's own renewal is late: planners wait
        for every node to re-register first."""
        since_back = time.time() - self.etcd_back_at if self.etcd_back_at else None
        renewal_age = time.time() - self.lease_ok_at if self.lease is not None else None
        return settling_after_outage(since_back, self.ttl, renewal_age)

    # -- fencing --------------------------------------------------------------------------------
    def apply_fencing_rule(self, plan: Plan | None, snap=None) -> None:
        """Apply the fencing rule (fencing.lease_decision) for ``plan``, the generation this agent
        follows. With ``snap`` (a fresh read, so etcd answers) a lost lease is either rejoined or
        fenced; without, only unreachability counts. Raises Fenced."""
        me = self.node_id
        if self.etcd_ok_at - self.shared_contact >= 0.05:
            self.shared_contact = self.etcd_ok_at
            self.share_contact(self.etcd_ok_at)
        lost = self.lost_lease.is_set() and snap is not None
        if not lost and not self.lease_failing:
            return
        latest = snap.view.plan if snap is not None else None
        replaced = bool(
            lost
            and plan is not None
            and latest is not None
            and me in plan.nodes
            and latest.generation > plan.generation
            and me not in latest.nodes
        )
        recovering, stalled = self.local_progress()
        facts = dict(
            lease_gone=lost,
            # etcd's silence counts while it lasts: once etcd answers again, a lease it no longer
            # has is the lost-lease branch's (register again, or fence if a plan replaced us)
            unreachable_for=(time.time() - self.lease_ok_at) if self.lease_failing and not self.etcd_ok else None,
            ttl=self.ttl,
            active=plan is not None and me in plan.nodes and not plan.finished,
            replaced=replaced,
            recovering=recovering,
            stalled_for=stalled,
            stall_limit=self.stall_limit,
        )
        decision = lease_decision(**facts)
        if decision == FENCE and not replaced and not lost:
            # Before stopping the workers for etcd's silence: is etcd down for the peers too?
            decision = lease_decision(**facts, peers_cut_off=self._peers_cut_off())
            if decision == FENCE and self._etcd_answers_now():
                decision = lease_decision(**{**facts, "unreachable_for": None})  # the peers heard from etcd because it is back
            if decision != FENCE and facts["unreachable_for"] is not None and self.sparing is None:
                self.sparing = f"{facts['unreachable_for']:.1f}s"
                self.say(
                    f"etcd unreachable for {self.sparing} while this node's workers "
                    f"{'recover from a failed collective' if recovering else 'make no progress'}, and the peers asked cannot "
                    "reach etcd either: nobody can take this node's ranks until it is back, so its workers keep waiting",
                    kind="etcd_down_everywhere",
                    publish=False,
                )
        if decision != FENCE:
            if not self.lease_failing:
                self.sparing = None
        if decision == FENCE:
            if lost:
                raise Fenced(f"lease expired and generation {latest.generation} no longer has this node")
            raise Fenced(
                f"etcd unreachable for {time.time() - self.lease_ok_at:.1f}s (lease TTL {self.ttl:g}s) "
                f"while this node's workers {'are recovering from a failed collective' if recovering else 'made no progress'}"
            )
        if decision == REREGISTER and lost:
            try:  # a request like any other: etcd may go again meanwhile (retried, with this rule)
                self.lease = self.members.register(self.info, self.ttl, again=True)
            except ValueError:
                raise Fenced("lease expired and another agent registered this node id") from None
            self.lease_ok_at, self.lease_failing = time.time(), False
            self.lost_lease.clear()
            self.note_impaired()  # if ours lapsed, others' may have too: they register again meanwhile
            threading.Thread(target=self._keep_lease, daemon=True).start()
            self.say(
                "lease had expired (etcd unreachable or this agent stalled) but nobody took this node's ranks: registered again",
                kind="rejoined",
            )

    def _etcd_answers_now(self) -> bool:
        """One last request before fencing for etcd's silence (the peers say etcd answers them:
        it may just have come back while this agent waited out a retry's delay)."""
        try:
            self.direct.kv.current_revision(timeout=min(1.0, self.ttl / 3))
        except Exception:
            return False
        self.note_etcd(True)
        return True

    def _peers_cut_off(self) -> bool:
        """``fencing.peers_cut_off`` on the peers' answers, asked at most every quarter second
        (each ask connects to a few peers' agents)."""
        when, verdict = self.asked_peers
        if time.time() - when >= 0.25:
            verdict = peers_cut_off(self.etcd_ok_at, self.ask_peers(), self.ttl)
            self.asked_peers = (time.time(), verdict)
        return verdict

    def record_fenced(self, why: str) -> None:
        """After fencing: once etcd answers, cordon this node (state/failed, so it is never
        picked as a spare and `ctl status` shows why) and say in one line what happened."""
        me = self.node_id
        deadline = time.time() + max(60.0, 12 * self.ttl)
        while True:
            try:
                latest = self.direct.snapshot().view.plan
                self.direct.cordon(me, f"fenced: {why}")
                self.direct.operator_log.event(me, "fenced", message=f"fenced: {why}; cordoned")  # for `ctl events`
                break
            except KVError:
                if time.time() > deadline:
                    log.error(
                        "node %s fenced (%s) and etcd still unreachable; its lease has expired, so the job counts it as lost", me, why
                    )
                    return
                time.sleep(min(1.0, self.ttl / 3))
        self.note_etcd(True)
        successor = next((new for new, old in (latest.replaced if latest else {}).items() if old == me), None)
        taken = f"{successor} took its ranks in generation {latest.generation}" if successor else "its ranks are no longer its own"
        log.error(
            "node %s was fenced (%s); %s; it is cordoned as failed: fix the node, then `tm-launch ctl uncordon %s` to offer it as a spare again",
            me,
            why,
            taken,
            me,
        )

    # -- what the planner must see ------------------------------------------------------------
    def mark_planner(self, planners: tuple[str, ...]) -> None:
        """Keep this node's planner marker in step with whether it plans, and with whom (the
        followers learn from it that they must start planning). Leased: it goes when this node
        goes, and is written again on a new lease; agents that do not plan wake only for a new
        plan or a change of planners."""
        if self.node_id in planners:
            if self.planner_marked != (self.lease, planners):
                self.members.mark_planner(self.node_id, self.lease, planners)
                self.planner_marked = (self.lease, planners)
        elif self.planner_marked is not None:
            self.members.unmark_planner(self.node_id)
            self.planner_marked = None

    def report_failure(self, generation: int, node: str, why: str, kind: str) -> None:
        self.members.report_failure(generation, node, why, kind=kind)
        self.reported = True

    def cordon(self, node: str, why: str) -> None:
        self.members.cordon(node, why)
        self.reported = True

    def request_drain(self, node: str, why: str) -> None:
        self.members.request_drain(node, why)
        self.reported = True

    def take_reported(self) -> bool:
        """Whether a report was written since the last call. The snapshot read before it predates
        it: a plan made from that snapshot would leave the report out, and a report for a
        superseded generation is never read, so the loop reads again before planning."""
        reported, self.reported = self.reported, False
        return reported
