"""This node's session with etcd: its registration and lease, whether etcd answers, the fencing
rule that follows from both, and the reports the planner must see.

The lease keeper thread only records what happens (the last refresh that got through, refreshes
failing, the lease gone); what that means for the workers (keep training, fence, register again)
is decided by the main loop through ``apply_fencing_rule``, so one thread owns the workers' fate.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from rendezvous.kv import KVError, Lease
from rendezvous.membership import Membership, UnreadablePlan
from rendezvous.plan import NodeInfo, Plan

from ..logs import logger
from ..waits import Every
from .fencing import FENCE, REREGISTER, lease_decision, settling_after_outage

log = logger(__name__)


class Fenced(Exception):
    """This node lost its lease: it no longer owns any rank."""


class EtcdSession:
    def __init__(
        self,
        members: Membership,
        node_id: str,
        lease_ttl: float,
        stall_limit: float,
        say: Callable[..., None],
        local_progress: Callable[[], tuple[bool, float | None]],
    ):
        self.members = members
        self.node_id = node_id
        self.ttl = lease_ttl
        self.stall_limit = stall_limit  # a worker stalled longer than this is stuck in a collective
        self.say = say
        self.local_progress = local_progress  # (recovering, seconds since the last step): the fencing rule's input
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
            self.lease = self.members.register(info, self.ttl)
        except ValueError as e:
            raise SystemExit(f"tm-launch: error: {e}") from None
        threading.Thread(target=self._keep_lease, daemon=True).start()

    def _keep_lease(self) -> None:
        """Refresh the lease; record when it last got through. Deciding what a failing refresh
        means (keep training, fence, rejoin) is the main loop's job: see apply_fencing_rule."""
        interval = max(self.ttl / 3.0, 0.1)
        lease = self.lease
        while not self.lost_lease.is_set() and lease is self.lease:
            time.sleep(interval)
            try:
                alive = lease.refresh()
            except KVError as e:
                self.lease_failing = True
                self.note_etcd(False, e)
                continue
            self.note_etcd(True)
            if not alive:
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

    def answered(self) -> None:
        """A read of the job's state got through."""
        self.unreadable_plan = ""
        self.note_etcd(True)

    def back_off(self, error: Exception, plan: Plan | None) -> None:
        """Wait a little before asking etcd again, applying the fencing rule meanwhile: a worker
        that starts recovering must get this node fenced at once, not at the next retry. Said once
        when etcd goes (and once when it is back), with a progress line every few seconds between;
        an unreadable plan is said once: it stays until an operator restores it."""
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
        until = time.time() + min(1.0, self.ttl / 3)
        while time.time() < until:
            self.apply_fencing_rule(plan)
            time.sleep(0.05)

    def settling(self) -> bool:
        """Right after an etcd outage: planners wait for every node to re-register first."""
        since_back = time.time() - self.etcd_back_at if self.etcd_back_at else None
        return settling_after_outage(since_back, self.ttl)

    # -- fencing --------------------------------------------------------------------------------
    def apply_fencing_rule(self, plan: Plan | None, snap=None) -> None:
        """Apply the fencing rule (fencing.lease_decision) for ``plan``, the generation this agent
        follows. With ``snap`` (a fresh read, so etcd answers) a lost lease is either rejoined or
        fenced; without, only unreachability counts. Raises Fenced."""
        me = self.node_id
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
        decision = lease_decision(
            lease_gone=lost,
            unreachable_for=(time.time() - self.lease_ok_at) if self.lease_failing else None,
            ttl=self.ttl,
            active=plan is not None and me in plan.nodes and not plan.finished,
            replaced=replaced,
            recovering=recovering,
            stalled_for=stalled,
            stall_limit=self.stall_limit,
        )
        if decision == FENCE:
            if lost:
                raise Fenced(f"lease expired and generation {latest.generation} no longer has this node")
            raise Fenced(
                f"etcd unreachable for {time.time() - self.lease_ok_at:.1f}s (lease TTL {self.ttl:g}s) "
                f"while this node's workers {'are recovering from a failed collective' if recovering else 'made no progress'}"
            )
        if decision == REREGISTER and lost:
            try:
                self.lease = self.members.register(self.info, self.ttl)
            except ValueError:
                raise Fenced("lease expired and another agent registered this node id") from None
            self.lease_ok_at, self.lease_failing = time.time(), False
            self.lost_lease.clear()
            threading.Thread(target=self._keep_lease, daemon=True).start()
            self.say(
                "lease had expired (etcd unreachable or this agent stalled) but nobody took this node's ranks: registered again",
                kind="rejoined",
            )

    def record_fenced(self, why: str) -> None:
        """After fencing: once etcd answers, cordon this node (state/failed, so it is never
        picked as a spare and `ctl status` shows why) and say in one line what happened."""
        me = self.node_id
        deadline = time.time() + max(60.0, 12 * self.ttl)
        while True:
            try:
                latest = self.members.snapshot().view.plan
                self.members.cordon(me, f"fenced: {why}")
                self.members.event(me, "fenced", message=f"fenced: {why}; cordoned")  # for `ctl events`
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
