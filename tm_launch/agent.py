"""The per-node agent: register, follow the generations, run and watch this node's workers.

One loop, woken by any change under the job's ``state/`` keys or every ``--monitor-interval``:

1. read the job's state (one etcd range read) and, if the plan moved on, act on it:
   start workers (fresh or sandboxed), forward the new generation to live workers, or stop;
2. watch local workers (exits, hangs) and health alarms, and report what it finds to etcd;
3. run the pure planner on the same view and try to publish its plan by compare-and-swap.

Only a few designated agents plan (``planner.planners``: the first 3 alive in join order; the
others take over when those are gone), so an event costs O(1) CASes, not one per node; the CAS
makes exactly one plan per generation. A lease-keeper thread keeps this node registered; when
the lease is lost the agent stops its workers (fencing) and exits.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import shutil
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

from health.alarms import DEGRADED, FATAL, Alarm
from health.config import HealthConfig
from rendezvous.kv import KV, KVError
from rendezvous.membership import Membership, UnreadablePlan

from .communicators import nccl_error_handling
from .fencing import FENCE, REREGISTER, lease_decision, settling_after_outage
from .plan import FAILED, SUCCEEDED, NodeInfo, Plan
from .planner import Limits, View, finished_without, next_plan, planners, spares
from .timeline import append_samples, cause_kind
from .waits import Every
from .workers import OutputSpec, WorkerSet, describe_exit

log = logging.getLogger("tm_launch.agent")


@dataclass
class AgentConfig:
    node_id: str
    addr: str
    nproc: int
    limits: Limits
    cmd: list[str]
    run_id: str
    role: str = "default"
    lease_ttl: float = 5.0
    monitor_interval: float = 0.1
    join_timeout: float = 600.0
    last_call: float = 1.0
    spares_wanted: int = 0
    live_enabled: bool = True
    collective_timeout: float = 120.0
    sandbox_steps: int = 2
    output: OutputSpec | None = None
    health: HealthConfig | None = None
    event_log: str | None = None
    metrics_port: int | None = None  # serve Prometheus metrics on addr:port (None: off)


class Fenced(Exception):
    """This node lost its lease: it no longer owns any rank."""


class Agent:
    def __init__(self, cfg: AgentConfig, kv: KV):
        self.cfg = cfg
        self.kv = kv
        self.members = Membership(kv)
        self.store = dist.TCPStore(cfg.addr, 0, None, True, wait_for_workers=False)
        self.workers = WorkerSet(cfg.cmd, cfg.output or OutputSpec(role=cfg.role), cfg.run_id)
        self.plan: Plan | None = None  # the last generation this agent acted on
        self.lease = None
        self.info: NodeInfo | None = None
        self.lost_lease = threading.Event()
        # etcd reachability, for the fencing rule (see fencing.py) and to say once when it goes
        # away and once when it is back, whichever thread notices first.
        self.etcd_ok, self.etcd_down_at, self.etcd_back_at = True, 0.0, None
        self._etcd_lock = threading.Lock()
        self.lease_ok_at = time.time()  # the last lease refresh that got through
        self.lease_failing = False      # the last lease refresh did not get through
        self.step_seen: tuple[dict, float] = ({}, time.time())  # local workers' steps, when they last moved
        self.alarms: queue.Queue[Alarm] = queue.Queue()
        self.reported_gen = -1
        self.done_gen = -1
        self.live_seen = False
        self.min_reached_at: float | None = None
        self.started = time.time()
        self.last_progress = 0.0
        self.timings: dict[int, dict] = {}
        self.monitor = None
        self.probed_gen, self.probed_at = -1, 0.0
        self.wrote = False  # this iteration reported something: plan on a view that includes it
        self.recovering_since: float | None = None  # a local worker waits for a new generation
        self.keepers_done_at: float | None = None  # a joiner saw its keepers finish without it
        self.state_changed = True  # the last watch saw a change under state/: re-read etcd
        self.planning = True  # this agent is one of the designated planners (see planner.planners)
        self.planner_marked = False  # state/planners/<me> is written (Membership.wait_plan)
        self._statuses_cache: dict | None = None
        self.master_store, self.master_gen = None, -1  # this node's env:// store for a fresh generation
        self.scratch = tempfile.mkdtemp(prefix="tm-launch-")  # error files when there is no --log-dir
        self.latest_file = os.path.join(self.scratch, "generations")  # grows by a line per directive
        self.straggler_gen, self.stragglers, self.straggler_window = -1, None, -1  # local rank -> [last step seen, when it changed]
        self.metrics = None  # tm_launch.metrics.AgentMetrics with --metrics-port
        self.step_series: list = []  # this node's bounded log/steps/<node> series
        self.join_wait = Every()  # progress lines while the first generation forms
        self.drain_wait: Every | None = None  # progress lines while a drain waits for a spare
        self.etcd_wait, self.etcd_seen = None, 0.0  # progress lines while etcd is unreachable
        self.unreadable_plan = ""  # said once while state/plan stays unreadable

    # -- logging --------------------------------------------------------------------------------
    def say(self, message: str, kind: str = "info", publish: bool = True, **fields) -> None:
        """stderr for people, ``--event-log`` for programs (every line, every kind), and etcd's
        log/events for ``ctl events`` (kinds other than "info"; not with ``publish=False``, for
        messages said while etcd is unreachable: they must not wait on it)."""
        stamp = time.strftime("%H:%M:%S", time.localtime()) + f".{int(time.time() * 1000) % 1000:03d}"
        print(f"[tm-launch {self.cfg.node_id} {stamp}] {message}", file=sys.stderr, flush=True)
        record = {"time": time.time(), "node": self.cfg.node_id, "kind": kind, "message": message, **fields}
        if self.cfg.event_log:
            with open(self.cfg.event_log, "a") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")
        if self.metrics is not None:
            self.metrics.on_event(kind, fields)
        if kind != "info" and publish:
            try:
                self.members.event(self.cfg.node_id, kind, message=message, **fields)
            except KVError:
                pass

    # -- start ------------------------------------------------------------------------------------
    def run(self) -> int:
        current = self.members.plan()  # not a whole snapshot: N joiners would read N records each
        if current and current.finished:
            raise SystemExit(f"tm-launch: error: run id '{self.cfg.run_id}' already finished ({current.state}); start the job with a new --rdzv-id")
        self._start_metrics()
        self.info = info = NodeInfo(
            id=self.cfg.node_id, host=socket.gethostname(), addr=self.cfg.addr, store_port=self.store.port,
            nproc=self.cfg.nproc, pid=os.getpid(), joined=time.time(),
        )
        try:
            self.lease = self.members.register(info, self.cfg.lease_ttl)
        except ValueError as e:
            raise SystemExit(f"tm-launch: error: {e}") from None
        threading.Thread(target=self._keep_lease, daemon=True).start()
        self._start_health()
        self.say(f"joined run '{self.cfg.run_id}' ({self.cfg.nproc} worker(s) per node, nnodes {self.cfg.limits.min_nodes}:{self.cfg.limits.max_nodes})", kind="joined")
        try:
            return self._loop()
        except Fenced as e:
            self.workers.stop(grace=0)
            self.say(f"lost membership: {e}; stopped this node's workers (fencing)", kind="fenced", publish=False)
            self._record_fenced(str(e))
            return 1
        except KeyboardInterrupt:
            self.workers.stop()
            return 130
        finally:
            if self.monitor is not None:
                self.monitor.stop()
            if self.metrics is not None:
                self.metrics.stop()
            self.workers.stop(grace=2)
            shutil.rmtree(self.scratch, ignore_errors=True)
            try:
                if self.lease is not None and not self.lost_lease.is_set():
                    self.lease.revoke()
            except KVError:
                pass

    def _keep_lease(self) -> None:
        """Refresh the lease; record when it last got through. Deciding what a failing refresh
        means (keep training, fence, rejoin) is the main loop's job: see _check_lease."""
        interval = max(self.cfg.lease_ttl / 3.0, 0.1)
        lease = self.lease
        while not self.lost_lease.is_set() and lease is self.lease:
            time.sleep(interval)
            try:
                alive = lease.refresh()
            except KVError as e:
                self.lease_failing = True
                self._note_etcd(False, e)
                continue
            self._note_etcd(True)
            if not alive:
                self.lost_lease.set()
                return
            self.lease_ok_at, self.lease_failing = time.time(), False

    def _note_etcd(self, ok: bool, error: Exception | None = None) -> None:
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

    def _local_progress(self) -> tuple[bool, float | None]:
        """(a local worker is recovering from a failed collective, seconds since a local worker
        last finished a step, None without running workers). Local store only: works without etcd."""
        if not self.workers:
            return False, None
        self._statuses_cache = None
        statuses = self._statuses()
        steps = {lr: s.get("step") for lr, s in statuses.items()}
        now = time.time()
        if steps != self.step_seen[0]:
            self.step_seen = (steps, now)
        recovering = any(s.get("state") == "recovering" for s in statuses.values())
        running = recovering or any(s.get("state") == "running" for s in statuses.values())
        return recovering, (now - self.step_seen[1]) if running else None

    def _check_lease(self, snap=None) -> None:
        """Apply the fencing rule (fencing.lease_decision). With ``snap`` (a fresh read, so etcd
        answers) a lost lease is either rejoined or fenced; without, only unreachability counts."""
        me, plan = self.cfg.node_id, self.plan
        lost = self.lost_lease.is_set() and snap is not None
        if not lost and not self.lease_failing:
            return
        latest = snap.view.plan if snap is not None else None
        replaced = bool(lost and plan is not None and latest is not None and me in plan.nodes
                        and latest.generation > plan.generation and me not in latest.nodes)
        recovering, stalled = self._local_progress()
        decision = lease_decision(
            lease_gone=lost, unreachable_for=(time.time() - self.lease_ok_at) if self.lease_failing else None,
            ttl=self.cfg.lease_ttl, active=plan is not None and me in plan.nodes and not plan.finished,
            replaced=replaced, recovering=recovering, stalled_for=stalled, stall_limit=self.cfg.collective_timeout,
        )
        if decision == FENCE:
            if lost:
                raise Fenced(f"lease expired and generation {latest.generation} no longer has this node")
            raise Fenced(f"etcd unreachable for {time.time() - self.lease_ok_at:.1f}s (lease TTL {self.cfg.lease_ttl:g}s) "
                         f"while this node's workers {'are recovering from a failed collective' if recovering else 'made no progress'}")
        if decision == REREGISTER and lost:
            try:
                self.lease = self.members.register(self.info, self.cfg.lease_ttl)
            except ValueError:
                raise Fenced("lease expired and another agent registered this node id") from None
            self.lease_ok_at, self.lease_failing = time.time(), False
            self.lost_lease.clear()
            threading.Thread(target=self._keep_lease, daemon=True).start()
            self.say("lease had expired (etcd unreachable or this agent stalled) but nobody took this node's ranks: registered again", kind="rejoined")

    def _record_fenced(self, why: str) -> None:
        """After fencing: once etcd answers, cordon this node (state/failed, so it is never
        picked as a spare and `ctl status` shows why) and say in one line what happened."""
        me = self.cfg.node_id
        deadline = time.time() + max(60.0, 12 * self.cfg.lease_ttl)
        while True:
            try:
                latest = self.members.snapshot().view.plan
                self.members.cordon(me, f"fenced: {why}")
                self.members.event(me, "fenced", message=f"fenced: {why}; cordoned")  # for `ctl events`
                break
            except KVError:
                if time.time() > deadline:
                    print(f"tm-launch: error: node {me} fenced ({why}) and etcd still unreachable; its lease has expired, "
                          "so the job counts it as lost", file=sys.stderr, flush=True)
                    return
                time.sleep(min(1.0, self.cfg.lease_ttl / 3))
        self._note_etcd(True)
        successor = next((new for new, old in (latest.replaced if latest else {}).items() if old == me), None)
        taken = f"{successor} took its ranks in generation {latest.generation}" if successor else "its ranks are no longer its own"
        print(f"tm-launch: error: node {me} was fenced ({why}); {taken}; it is cordoned as failed: "
              f"fix the node, then `tm-launch ctl uncordon {me}` to offer it as a spare again", file=sys.stderr, flush=True)

    def _start_health(self) -> None:
        cfg = self.cfg.health
        if cfg is None or not cfg.nvml:
            return
        from health.nvml_monitor import NvmlMonitor, gpus_for_local_ranks

        gpus = gpus_for_local_ranks(self.cfg.nproc, os.environ.get("CUDA_VISIBLE_DEVICES"))
        self.monitor = NvmlMonitor(self.cfg.node_id, gpus, cfg, self.alarms.put)
        if not self.monitor.start():
            self.monitor = None

    def _start_metrics(self) -> None:
        if self.cfg.metrics_port is None:
            return
        from .metrics import AgentMetrics, MetricsError

        self.metrics = AgentMetrics(self.cfg.node_id)
        try:
            port = self.metrics.serve(self.cfg.addr, self.cfg.metrics_port)
        except MetricsError as e:
            self.metrics = None
            raise SystemExit(f"tm-launch: error: {e}") from None
        self.say(f"Prometheus metrics at http://{self.cfg.addr}:{port}/metrics")

    def _update_metrics(self, snap) -> None:
        """Once per loop, from the snapshot already read: generation, role, spares."""
        if self.metrics is None or snap.view.plan is None:
            return
        view, me = snap.view, self.cfg.node_id
        plan = self.plan or view.plan
        role = "failed" if me in view.failed else "draining" if me in view.drains and me in plan.nodes else "active" if me in plan.nodes else "spare"
        self.metrics.on_state(plan.generation, role, len(spares(view)))

    # -- the loop ---------------------------------------------------------------------------------
    def _loop(self) -> int:
        snap, fresh_until = None, 0.0
        while True:
            self._check_lease()
            if snap is None or self.state_changed or (self.planning and time.time() >= fresh_until) or self.lost_lease.is_set():
                try:
                    snap = self.members.snapshot()
                except KVError as e:
                    self._etcd_down(e)
                    continue
                self.unreadable_plan = ""
                self._note_etcd(True)
                self._check_lease(snap)
                # Re-read etcd when the watch saw a change, else (planners only) once a second:
                # time-based rules (the join window, the grace of an exit report) still move on.
                fresh_until = time.time() + 1.0
            self._statuses_cache = None
            try:
                code = self._tick(snap)
            except KVError as e:  # etcd went away mid-iteration: nothing is half-done, go round again
                self._etcd_down(e)
                snap = None
                continue
            if code is not None:
                return code

    def _tick(self, snap) -> int | None:
        """One pass of the loop over one consistent view; an exit code when the agent is done."""
        view = snap.view
        if view.plan is not None and (self.plan is None or view.plan.generation != self.plan.generation):
            code = self._follow(view.plan, view)
            if code is not None:
                return code
        if view.plan is None:
            self._check_join_timeout(view)
        elif self.plan is not None and self.cfg.node_id not in self.plan.nodes and not self.workers and view.live:
            self._be_spare(self.plan, view)  # the job turned out to be live: warm up now
        self._watch_workers(view)
        self._probe_peers(view)
        self._report_entry()
        self._watch_alarms()
        self._publish_progress()
        self._update_metrics(snap)
        self._note_drain_wait(view)
        me = self.cfg.node_id
        self.planning = me in planners(view)
        if self.planning and not self.planner_marked:  # leased: it goes when this node goes
            self.members.mark_planner(me, self.lease)
        elif self.planner_marked and not self.planning:
            self.members.unmark_planner(me)
        self.planner_marked = self.planning
        if self.wrote:
            # The snapshot predates this iteration's own report: a plan made from it would
            # leave the report out, and a report for a superseded generation is never read.
            self.wrote, self.state_changed = False, True
            return None
        decision = next_plan(self._with_last_call(view), self.cfg.limits) if self.planning else None
        since_back = time.time() - self.etcd_back_at if self.etcd_back_at else None
        if decision is not None and decision.state != SUCCEEDED and view.plan is not None and settling_after_outage(since_back, self.cfg.lease_ttl):
            decision = None  # right after an etcd outage: let every node re-register first
        if decision is not None and self.members.publish(decision, snap.plan_entry):
            self._announce(decision)
            self.state_changed = True  # look at the new state at once
            return None
        # Our own writes (reports, cordons) move the revision past the snapshot's too, so the
        # wait returns at once and the next iteration plans on them. An agent that does not
        # plan wakes only for a new plan or planner, except group rank 0, a joiner, and a spare that
        # has yet to learn the job is live (it must warm up): joins and losses cost the others nothing.
        rank0 = view.plan is not None and view.plan.nodes[:1] == (me,)  # it reports waiting drains
        joining = view.plan is not None and view.plan.live and me in view.plan.joiners  # watches its keepers finish
        follow_only = not self.planning and not rank0 and not joining and (view.plan is None or me in view.plan.nodes or view.live)
        wait = self.members.wait_plan if follow_only else self.members.wait
        self.state_changed = wait(snap.revision, self.cfg.monitor_interval)
        return None

    def _etcd_down(self, error: Exception) -> None:
        """Wait a little before asking etcd again, applying the fencing rule meanwhile: a worker
        that starts recovering must get this node fenced at once, not at the next retry. Said once
        when etcd goes (and once when it is back), with a progress line every few seconds between;
        an unreadable plan is said once: it stays until an operator restores it."""
        if isinstance(error, UnreadablePlan):
            if str(error) != self.unreadable_plan:
                self.unreadable_plan = str(error)
                self.say(f"etcd: {error}", kind="plan_unreadable", publish=False)
        else:
            self._note_etcd(False, error)
            if self.etcd_wait is None or time.time() - self.etcd_seen > 5 * self.cfg.lease_ttl:
                self.etcd_wait = Every()
            self.etcd_seen = time.time()
            if self.etcd_wait.due():
                self.say(f"etcd still unreachable after {self.etcd_wait.elapsed:.0f} s: {error}; retrying", kind="etcd_unreachable",
                         publish=False, elapsed_s=round(self.etcd_wait.elapsed, 1))
        until = time.time() + min(1.0, self.cfg.lease_ttl / 3)
        while time.time() < until:
            self._check_lease()
            time.sleep(0.05)

    def _with_last_call(self, view: View) -> View:
        if view.plan is not None:
            return view
        n = len(spares(view))
        if n >= self.cfg.limits.min_nodes:
            self.min_reached_at = self.min_reached_at or time.time()
        else:
            self.min_reached_at = None
        passed = self.min_reached_at is not None and time.time() - self.min_reached_at >= self.cfg.last_call
        return dataclasses.replace(view, last_call_passed=passed)

    def _check_join_timeout(self, view: View) -> None:
        waited = time.time() - self.started
        if self.join_wait.due():
            joined = sorted(view.alive)
            self.say(
                f"waiting for {self.cfg.limits.min_nodes} node(s) to join run '{self.cfg.run_id}': {len(joined)} joined "
                f"({', '.join(joined) or 'none'}); {waited:.0f} s of {self.cfg.join_timeout:.0f} s", kind="waiting",
                waiting_for="nodes", joined=joined, elapsed_s=round(waited, 1), limit_s=self.cfg.join_timeout,
            )
        if waited > self.cfg.join_timeout:
            raise SystemExit(
                f"tm-launch: error: waited {waited:.0f}s for {self.cfg.limits.min_nodes} node(s) to join run "
                f"'{self.cfg.run_id}', {len(view.alive)} joined; start the other nodes or lower --nnodes"
            )

    def _announce(self, plan: Plan) -> None:
        if plan.finished:
            return  # every agent says it when it follows the plan
        moves = ", ".join(f"{new} takes the ranks of {old}" for new, old in plan.replaced.items()) or "no spare used"
        mode = "live (survivors keep their processes)" if plan.live else "restart (all workers start afresh)"
        self.say(
            f"published generation {plan.generation}: {plan.cause}; {moves}; {mode}",
            kind="plan", generation=plan.generation, cause=plan.cause, replaced=plan.replaced,
            removed=list(plan.removed), live=plan.live, planned=plan.planned, nodes=list(plan.nodes),
        )

    # -- acting on a plan -----------------------------------------------------------------------
    def _follow(self, plan: Plan, view: View) -> int | None:
        """Do what generation ``plan`` asks of this node; an exit code when the agent is done."""
        me = self.cfg.node_id
        previous, self.plan = self.plan, plan
        if plan.state == SUCCEEDED:
            self._stop_workers("job finished")
            self.say(f"job finished successfully (generation {plan.generation})")
            return 0
        if plan.state == FAILED:
            self._stop_workers("job failed")
            self.say(f"generation {plan.generation}: job failed: {plan.reason}", kind="job_failed", generation=plan.generation)
            return 1
        if previous is not None and self.metrics is not None:
            self.metrics.on_generation(self._change_kind(plan))
        if previous is None and me in plan.nodes:
            self.say(f"generation {plan.generation}: active, group rank {plan.group_rank(me)}, ranks {plan.ranks(me)} of {plan.world_size}")
        if me in plan.removed:
            return self._leave(plan)
        if me not in plan.nodes:
            self._be_spare(plan, view)
            return None
        if not plan.live or not self.cfg.live_enabled:
            self._stop_workers(f"generation {plan.generation} restarts every worker")
            self._start_workers(plan, sandbox=False)
        elif me in plan.joiners and not (self.workers and self.workers.kind == "sandbox"):
            self._stop_workers("restarting this node's workers as joiners")
            self._start_workers(plan, sandbox=True)
        if me in plan.joiners and previous is not None and me not in (previous.nodes if previous else ()):
            self.say(f"generation {plan.generation}: promoted from spare to group rank {plan.group_rank(me)} (ranks {plan.ranks(me)})", kind="promoted", generation=plan.generation)
        self._direct(plan)
        self._warn_spares(view, plan)
        if plan.live and self.cfg.live_enabled and me not in plan.joiners and not self.workers and previous is not None and me in previous.nodes:
            # This node's workers died in the previous generation, but the plan was made before
            # that report was seen: it counts on workers that are gone. Report it again here.
            self.reported_gen = plan.generation
            why = f"this node's workers died in generation {previous.generation}, before generation {plan.generation} took them into account"
            self.say(f"generation {plan.generation}: {why}; reporting the failure", kind="worker_failed", generation=plan.generation)
            self.members.report_failure(plan.generation, me, why, kind="signal")
            self.wrote = True
        return None

    def _change_kind(self, plan: Plan) -> str:
        """Why generation ``plan`` exists, as a short label (reads the previous generation's reports)."""
        try:
            reports = self.members.reports_for(plan.generation - 1) if plan.generation > 0 else {}
        except KVError:
            reports = {}
        return cause_kind(dataclasses.asdict(plan), reports)

    def _leave(self, plan: Plan) -> int:
        me = self.cfg.node_id
        planned = plan.planned and plan.live and self.workers
        if planned:
            self._direct(plan)  # the leavers' workers hand over at the switch step, then exit
            deadline = time.time() + max(60.0, self.cfg.collective_timeout)
            ticker = Every()
            while any(code is None for code in self.workers.poll().values()) and time.time() < deadline:
                if ticker.due():
                    running = [lr for lr, code in self.workers.poll().items() if code is None]
                    self.say(f"generation {plan.generation}: drained; waiting for local worker(s) {running} to hand over their state "
                             f"and exit ({ticker.elapsed:.0f} s of {deadline - time.time() + ticker.elapsed:.0f} s)",
                             kind="waiting", waiting_for="leavers", elapsed_s=round(ticker.elapsed, 1))
                time.sleep(0.05)
        self._stop_workers("this node left the job")
        successor = next((new for new, old in plan.replaced.items() if old == me), None)
        how = f"replaced by {successor}" if successor else "removed"
        if plan.planned:
            self.say(f"generation {plan.generation}: drained, {how}; exiting", kind="left", generation=plan.generation)
            return 0
        self.say(f"generation {plan.generation}: {how} after a failure ({plan.cause}); exiting", kind="left", generation=plan.generation)
        return 1

    def _be_spare(self, plan: Plan, view: View) -> None:
        if self.plan is not None and (view.live or self.live_seen) and self.cfg.live_enabled and not self.workers:
            self.say(f"spare: warming up {self.cfg.nproc} worker(s) in the sandbox (world size {plan.world_size})", kind="sandbox")
            self._start_workers(plan, sandbox=True)
        elif not self.workers:
            self.say(f"spare: waiting (generation {plan.generation} has {len(plan.nodes)} active node(s))")
        self._direct(plan)

    def _note_drain_wait(self, view: View) -> None:
        """A drain waits for a spare (it never shrinks the job): group rank 0's agent says so."""
        plan = view.plan
        if plan is None or plan.finished or not plan.nodes or plan.nodes[0] != self.cfg.node_id:
            return
        waiting = [n for n in plan.nodes if n in view.drains]
        if not waiting or spares(view):
            self.drain_wait = None
            return
        if self.drain_wait is None:
            self.drain_wait = Every()
        if self.drain_wait.due():
            self.say(f"generation {plan.generation}: drain of {', '.join(waiting)} waits for a spare node, none is available "
                     f"({self.drain_wait.elapsed:.0f} s so far; start a spare or `tm-launch ctl uncordon` one)",
                     kind="waiting", waiting_for="spare", draining=waiting, elapsed_s=round(self.drain_wait.elapsed, 1))

    def _warn_spares(self, view: View, plan: Plan) -> None:
        have = len(spares(dataclasses.replace(view, plan=plan)))
        if have < self.cfg.spares_wanted and plan.nodes and plan.nodes[0] == self.cfg.node_id:
            self.say(f"warning: the job wants {self.cfg.spares_wanted} spare node(s) and has {have}", kind="warning")

    def _direct(self, plan: Plan) -> None:
        """Hand generation ``plan`` to this node's workers through the local store."""
        me = self.cfg.node_id
        joiner_ranks = [r for n in plan.joiners for r in plan.ranks(n)]
        directive = {
            "generation": plan.generation, "active": me in plan.nodes, "ranks": plan.ranks(me),
            "world_size": plan.world_size, "store": plan.store, "joiner_ranks": joiner_ranks,
            "all_fresh": set(plan.joiners) >= set(plan.nodes), "planned": plan.planned, "live": plan.live,
            "stop": plan.finished,
        }
        self.store.set(f"node/plan/{plan.generation}", json.dumps(directive))
        current = self.store.add("node/latest", 0)
        if plan.generation > current:
            self.store.add("node/latest", plan.generation - current)
        # Workers check this file's size at every step boundary (a stat, no round trip).
        with open(self.latest_file, "a") as f:
            f.write(f"{plan.generation}\n")

    def _env(self, plan: Plan, local_rank: int, sandbox: bool) -> dict[str, str]:
        me = self.cfg.node_id
        ranks = plan.ranks(me) or list(range(self.cfg.nproc))
        group_rank = plan.group_rank(me)
        env = dict(os.environ)
        env.update({
            "LOCAL_RANK": str(local_rank),
            "RANK": str(ranks[local_rank]),
            "GROUP_RANK": str(group_rank if group_rank is not None else -1),
            "ROLE_RANK": str(ranks[local_rank]),
            "ROLE_NAME": self.cfg.role,
            "LOCAL_WORLD_SIZE": str(self.cfg.nproc),
            "WORLD_SIZE": str(plan.world_size),
            "GROUP_WORLD_SIZE": str(len(plan.nodes)),
            "ROLE_WORLD_SIZE": str(plan.world_size),
            "MASTER_ADDR": str(plan.store.get("addr", "")),
            "MASTER_PORT": str(plan.store.get("port", "")),
            # Every generation is a new worker group, so torchrun's restart counter is the
            # generation number (the env:// store itself is new per generation: see _master).
            "TORCHELASTIC_RESTART_COUNT": str(plan.generation),
            "TORCHELASTIC_MAX_RESTARTS": str(self.cfg.limits.max_restarts),
            "TORCHELASTIC_RUN_ID": self.cfg.run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": nccl_error_handling(self.cfg.live_enabled, os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")),
            "TORCHELASTIC_ERROR_FILE": self._error_file(plan.generation, local_rank),
            "TM_NODE_ID": me,
            "TM_LOCAL_ADDR": self.cfg.addr,
            "TM_GENERATION": str(plan.generation),
            "TM_LATEST_FILE": self.latest_file,
            "TM_SANDBOX": "1" if sandbox else "0",
            "TM_SANDBOX_STEPS": str(self.cfg.sandbox_steps),
            "TM_COLLECTIVE_TIMEOUT": str(self.cfg.collective_timeout),
            "TM_SETUP_TIMEOUT": str(self.cfg.join_timeout),
            "TM_STRAGGLER_WINDOW": str(self.cfg.health.straggler_window if self.cfg.health else 20),
        })
        if self.cfg.live_enabled:
            env["TM_AGENT_STORE"] = f"{self.cfg.addr}:{self.store.port}"
        else:
            env.pop("TM_AGENT_STORE", None)
        return env

    def _error_file(self, generation: int, local_rank: int) -> str:
        """Where a worker decorated with torch's @record writes its exception (torchrun's layout)."""
        base = (self.cfg.output.log_dir if self.cfg.output and self.cfg.output.log_dir else None) or self.scratch
        path = os.path.join(base, self.cfg.run_id, f"attempt_{generation}", str(local_rank), "error.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return path

    def _root_cause(self, local_rank: int) -> str:
        """The first line of the worker's @record error file, when it wrote one."""
        path = self._error_file(self.workers.generation, local_rank)
        try:
            with open(path) as f:
                message = json.load(f)["message"]
            text = message.get("message", "") if isinstance(message, dict) else str(message)
            return text.strip().splitlines()[0][:300] if text.strip() else ""
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return ""

    def _master(self, plan: Plan) -> tuple[str, int]:
        """MASTER_ADDR/PORT for a generation of fresh workers: a new TCPStore every generation.

        torch's env:// init does not prefix its keys per attempt (torchrun makes a new store per
        restart), so reusing one store would hand new workers the old workers' addresses. The
        plan's store node hosts it and publishes the port; the others wait for it."""
        if plan.store.get("node") == self.cfg.node_id:
            if self.master_gen != plan.generation:
                self.master_store = dist.TCPStore(self.cfg.addr, 0, None, True, wait_for_workers=False)
                self.master_gen = plan.generation
                self.members.publish_store(plan.generation, self.cfg.addr, self.master_store.port)
            return self.cfg.addr, self.master_store.port
        limit = max(60.0, self.cfg.lease_ttl * 4)
        deadline = time.time() + limit
        ticker = Every()
        while time.time() < deadline:
            where = self.members.store_for(plan.generation)
            if where:
                return where["addr"], int(where["port"])
            if self.lost_lease.is_set():
                raise Fenced("lease expired")
            if ticker.due():
                self.say(f"generation {plan.generation}: waiting for {plan.store.get('node')} to publish the workers' env:// store "
                         f"({ticker.elapsed:.0f} s of {limit:.0f} s)", kind="waiting", waiting_for="store", elapsed_s=round(ticker.elapsed, 1))
            time.sleep(0.02)
        raise SystemExit(f"tm-launch: error: generation {plan.generation}'s store host {plan.store.get('node')} never published its store; is that node alive?")

    def _start_workers(self, plan: Plan, sandbox: bool) -> None:
        self._direct(plan)
        master = None if sandbox else self._master(plan)
        envs = {lr: self._env(plan, lr, sandbox) for lr in range(self.cfg.nproc)}
        if master:
            for env in envs.values():
                env["MASTER_ADDR"], env["MASTER_PORT"] = master[0], str(master[1])
        for lr in range(self.cfg.nproc):
            # The previous process's last status and heartbeat must not be read as the new
            # one's: the hang watchdog would kill a worker that is still starting up.
            for key in ("status", "beat"):
                self.store.delete_key(f"worker/{lr}/{key}")
        self._statuses_cache = None
        self.workers.start(envs, plan.generation, "sandbox" if sandbox else "fresh")
        self.reported_gen = -1

    def _stop_workers(self, why: str) -> None:
        if self.workers:
            self.say(f"stopping {len(self.workers.workers)} worker(s): {why}")
            self.workers.stop()

    # -- watching ---------------------------------------------------------------------------------
    def _watch_workers(self, view: View) -> None:
        plan = self.plan
        if plan is None or not self.workers:
            return
        self._note_live()
        me = self.cfg.node_id
        failed = self.workers.failed()
        active = me in plan.nodes and not plan.finished
        if failed and self._statuses().get(failed[0], {}).get("state") == "finished":
            # Training finished in that process; a crash on the way out (interpreter teardown)
            # must not turn a finished job into a failover that nobody can take part in.
            local_rank, code = failed
            self.say(f"generation {plan.generation}: worker {local_rank} finished its steps, then {describe_exit(code)} while exiting; counting it as done", kind="warning")
            self.workers.forget(local_rank)
            failed = self.workers.failed()
        if failed and self.reported_gen != plan.generation:
            local_rank, code = failed
            why = f"worker {local_rank} (pid {self.workers.pids()[local_rank]}) {describe_exit(code)}"
            cause = self._root_cause(local_rank)
            if cause:
                why += f": {cause}"
            self.workers.stop(grace=0)
            if active:
                self.reported_gen = plan.generation
                self._report_dead_peers(plan, view)  # a dead peer, not this node, may be the cause
                self.say(f"generation {plan.generation}: {why}; reporting the failure", kind="worker_failed", generation=plan.generation, local_rank=local_rank, exit_code=code)
                self.members.report_failure(plan.generation, me, why, kind="signal" if code < 0 else "exit")
                self.wrote = True
            else:
                self.say(f"spare: sandbox {why}; it will be started again", kind="spare_failed")
            return
        if active and self.done_gen != plan.generation and self.workers.all_succeeded():
            self.done_gen = plan.generation
            self.members.mark_done(plan.generation, me)
            self.say(f"generation {plan.generation}: this node's workers finished; waiting for the others")
        if active and self.done_gen != plan.generation and self._nothing_left(view):
            self.done_gen = plan.generation
            self.workers.stop(grace=0)
            self.members.mark_done(plan.generation, me)
            self.say(f"generation {plan.generation}: the nodes that kept their workers finished training before this "
                     "node's workers got in; nothing left for them to do", kind="warning", generation=plan.generation)
        if active:
            self._watch_hangs(plan)

    def _nothing_left(self, view: View) -> bool:
        """A joiner whose keepers all finished (planner.finished_without) while none of its
        workers entered the generation, for 2 s on end: a worker that got in writes its entry
        key the moment its state arrived, long before its peers' exits reach etcd."""
        plan = self.plan
        if not finished_without(view, self.cfg.node_id) or any(
                self.store.check([f"worker/{lr}/entered/{plan.generation}"]) for lr in self.workers.workers):
            self.keepers_done_at = None  # the pure check first: this runs on every loop iteration
            return False
        self.keepers_done_at = self.keepers_done_at or time.time()
        return time.time() - self.keepers_done_at >= 2.0

    def _probe_peers(self, view: View) -> None:
        """A local worker saw a collective fail: find out at once whether a peer node died; and if
        no new generation comes (no node was lost, e.g. a transient network error), report this
        node after a while so that the job regroups instead of waiting forever."""
        plan = self.plan
        if plan is None or not (view.live or self.live_seen) or self.cfg.node_id not in plan.nodes:
            return
        if not any(s.get("state") == "recovering" for s in self._statuses().values()):
            self.recovering_since = None
            return
        if self.probed_gen != plan.generation:
            self.recovering_since = time.time()
            self._report_dead_peers(plan, view)
            return
        if time.time() - self.probed_at >= 0.5:
            # Peers can die after the first probe, e.g. a promoted spare killed while the others
            # wait for it in the communicator setup: keep probing while recovering.
            self._report_dead_peers(plan, view)
        patience = max(10.0, 2 * self.cfg.lease_ttl)
        if self.recovering_since and time.time() - self.recovering_since > patience and self.reported_gen != plan.generation:
            self.reported_gen = plan.generation
            why = f"a collective failed {patience:.0f}s ago but no peer node was lost; restarting this node's workers"
            self.say(f"generation {plan.generation}: {why}", kind="worker_failed", generation=plan.generation)
            self.members.report_failure(plan.generation, self.cfg.node_id, why, kind="exit")
            self.wrote = True

    def _report_dead_peers(self, plan: Plan, view: View) -> bool:
        """Report active peers whose agent refuses connections. A dead agent's port refuses at
        once, so a node loss is known in milliseconds instead of after the lease TTL; anything
        short of a refusal (a timeout, a partition) is left to the lease, the authority."""
        self.probed_gen, self.probed_at = plan.generation, time.time()
        found = False
        for node in plan.nodes:
            info = view.alive.get(node)
            if node == self.cfg.node_id or info is None or node in view.reports:
                continue
            try:
                socket.create_connection((info.addr, info.store_port), timeout=0.5).close()
            except ConnectionRefusedError:
                why = f"agent unreachable at {info.addr}:{info.store_port} (connection refused): node lost"
                self.say(f"generation {plan.generation}: {node}: {why}", kind="node_lost", generation=plan.generation, lost=node)
                self.members.report_failure(plan.generation, node, why, kind="lost")
                self.wrote = True
                # Unregister it too: its lease outlives it by a few seconds, and a later
                # generation must not promote (or wait for) a node already known dead.
                self.members.leave(node)
                found = True
            except OSError:
                continue
        return found

    def _report_entry(self) -> None:
        """Once this node's live workers entered the current generation, log the phase timings."""
        plan = self.plan
        if plan is None or not plan.live or plan.generation in self.timings or self.cfg.node_id not in plan.nodes:
            return
        records = []
        for lr in self.workers.workers:
            key = f"worker/{lr}/entered/{plan.generation}"
            if not self.store.check([key]):
                return
            records.append(json.loads(self.store.get(key)))
        if not records:
            return
        comm = max(r["communicator"] for r in records)
        state = max(r["state"] for r in records)
        received = any(r["received"] for r in records)
        since = time.time() - plan.created
        self.timings[plan.generation] = {"communicator": comm, "state": state}
        if self.metrics is not None and plan.generation > 0:
            try:
                times = [float(r.get("time", 0)) for r in self.members.reports_for(plan.generation - 1).values()]
            except (KVError, TypeError, ValueError):
                times = []
            fault = min(times) if times and not plan.planned else plan.created
            self.metrics.on_downtime(self._change_kind(plan), time.time() - fault)
        self.say(
            f"generation {plan.generation}: workers entered {since:.3f}s after the plan "
            f"(communicators {comm * 1000:.0f} ms, state {'received' if received else 'sent/kept'} in {state * 1000:.0f} ms)",
            kind="entered", generation=plan.generation, communicator_s=comm, state_s=state, received=received, after_plan_s=since,
        )

    def _note_live(self) -> None:
        if self.live_seen:
            return
        for lr in self.workers.workers:
            if self.store.check([f"worker/{lr}/live"]):
                self.live_seen = True
                self.members.set_live()
                return

    def _statuses(self) -> dict[int, dict]:
        """This node's workers' last reports (read once per loop iteration)."""
        if self._statuses_cache is not None:
            return self._statuses_cache
        out = {}
        for lr in self.workers.workers:
            key = f"worker/{lr}/status"
            if self.store.check([key]):
                try:
                    out[lr] = json.loads(self.store.get(key))
                except ValueError:
                    continue
        self._statuses_cache = out
        return out

    def _watch_hangs(self, plan: Plan) -> None:
        """Kill a worker that stopped beating (SIGSTOP, a wedged process): its peers then fail
        fast and the node is replaced. A worker waiting in a collective keeps beating, so ranks
        blocked on a hung peer are never mistaken for the hung one."""
        cfg = self.cfg.health
        if cfg is None or not self.live_seen:
            return
        from health.hang import hang_timeout

        now = time.time()
        for lr, status in self._statuses().items():
            if status.get("state") not in ("running", "recovering") or lr not in self.workers.workers:
                continue
            key = f"worker/{lr}/beat"
            if not self.store.check([key]):
                continue
            silent = now - float(self.store.get(key))
            recent = status.get("step_times") or ([status["step_time"]] if status.get("step_time") else [])
            limit = hang_timeout(cfg, recent, status.get("steps_run") or 0, False)
            if silent > limit and self.workers.poll().get(lr) is None:
                self.say(
                    f"generation {plan.generation}: worker {lr} (pid {self.workers.pids()[lr]}) silent for {silent:.1f}s "
                    f"(hang limit {limit:.1f}s): killing it", kind="hang", generation=plan.generation, local_rank=lr,
                )
                self.workers.kill(lr)

    def _watch_alarms(self) -> None:
        while True:
            try:
                alarm = self.alarms.get_nowait()
            except queue.Empty:
                return
            record = alarm.to_json()
            self.members.alarm(self.cfg.node_id, f"{alarm.signal}-gpu{alarm.gpu}", record)
            self.say(f"alarm {alarm.severity}: {alarm.message}", kind="alarm", alarm=record)
            plan = self.plan
            if plan is None or self.cfg.node_id not in plan.nodes:
                if alarm.severity == FATAL:
                    self.members.cordon(self.cfg.node_id, f"{alarm.signal}: {alarm.message}")
                    self.wrote = True
                continue
            if alarm.severity == FATAL:
                self.members.cordon(self.cfg.node_id, f"{alarm.signal}: {alarm.message}")
                self.wrote = True
                self.workers.stop(grace=0)
            elif alarm.severity == DEGRADED:
                self.members.request_drain(self.cfg.node_id, f"{alarm.signal}: {alarm.message}")
                self.wrote = True

    def _publish_progress(self) -> None:
        now = time.time()
        if now - self.last_progress < 1.0 or self.plan is None:
            return
        self.last_progress = now
        statuses = self._statuses() if self.workers else {}
        role = "active" if self.cfg.node_id in self.plan.nodes else "spare"
        record = {
            "node": self.cfg.node_id, "role": role, "generation": self.plan.generation,
            "workers": {str(lr): {k: s.get(k) for k in ("step", "state", "rank", "step_time", "windows")} for lr, s in statuses.items()},
            "time": now,
        }
        if self.metrics is not None:
            self.metrics.on_statuses(statuses)
        # Sampled at publish time, also when a worker's status did not change: a step count that
        # stays flat for seconds (a pause, a hang, a wait for the next generation) must draw flat.
        rows = [
            [round(now, 2), s.get("generation"), s.get("rank"), s.get("step"),
             None if s.get("step_time") is None else round(s["step_time"], 5), s.get("state")]
            for s in statuses.values() if s.get("state") in ("running", "recovering", "finished") and s.get("step") is not None
        ]
        try:
            self.members.progress(self.cfg.node_id, record, self.lease)
            unchanged = bool(rows) and [r[1:] for r in self.step_series[-len(rows):]] == [r[1:] for r in rows]
            if rows and not (unchanged and all(r[5] == "finished" for r in rows)):  # after the end: no more writes
                self.step_series = append_samples(self.step_series, rows)
                self.members.steps(self.cfg.node_id, self.step_series)
            self._find_stragglers()
        except KVError:
            pass

    def _find_stragglers(self) -> None:
        """Group rank 0's agent compares every rank's compute time, window by window (C4-style),
        and asks for a planned migration of a node whose rank stays slow."""
        plan, cfg = self.plan, self.cfg.health
        if cfg is None or not cfg.straggler or not self.live_seen or not plan.nodes or plan.nodes[0] != self.cfg.node_id:
            return
        from health.straggler import StragglerDetector

        if self.straggler_gen != plan.generation:
            self.straggler_gen, self.stragglers = plan.generation, StragglerDetector(cfg)
            self.straggler_window, self.flagged = -1, set()
        by_window: dict[int, dict[int, float]] = {}
        owner: dict[int, str] = {}
        for node, record in self.members.all_progress().items():
            if node not in plan.nodes or record.get("generation") != plan.generation:
                continue
            for worker in record.get("workers", {}).values():
                rank, windows = worker.get("rank"), worker.get("windows") or {}
                try:  # etcd content is input: a malformed record is skipped, never fatal
                    if not isinstance(rank, int) or not isinstance(windows, dict):
                        raise ValueError("rank or windows")
                    parsed = {int(w): float(c) for w, c in windows.items()}
                except (ValueError, TypeError, OverflowError):
                    continue
                owner[rank] = node
                for w, compute in parsed.items():
                    by_window.setdefault(w, {})[rank] = compute
        for w in sorted(by_window):
            if w <= self.straggler_window or len(by_window[w]) < plan.world_size:
                continue
            self.straggler_window = w
            for rank in self.stragglers.add_window(by_window[w]):
                node = owner.get(rank)
                if node is None or node in self.flagged:
                    continue
                self.flagged.add(node)  # one alarm per node and generation: the drain is pending
                alarm = self.stragglers.alarm_for(rank, node)
                self.members.alarm(node, f"straggler-rank{rank}", alarm.to_json())
                self.members.request_drain(node, alarm.message)
                self.wrote = True
                self.say(f"alarm degraded: {alarm.message} on {node}: requesting a planned migration", kind="alarm", alarm=alarm.to_json())
                self.stragglers.reset(rank)
