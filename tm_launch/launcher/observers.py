"""What the agent watches and tells, without deciding the job's course by itself.

* ``MetricsFeed``: the Prometheus metrics of ``--metrics-port`` (nothing when it is off).
* ``AlarmWatch``: the NVML monitor's alarms -> etcd; a fatal one cordons the node, a degraded
  one asks for a planned migration.
* ``ProgressPublisher``: once a second, this node's workers' progress and its step series to etcd
  (``ctl status``, ``ctl timeline``); group rank 0's agent then looks for stragglers.
* ``StragglerWatch``: C4-style per-window compute-time comparison -> a drain request.
* ``EntryReport``: the phase timings of workers entering a live generation (and its downtime).
* ``DowntimeStamps``: this node's stamps of each generation change, once, to etcd (``ctl timeline``).
* ``DrainWaitNote``: a drain waiting for a spare, said every few seconds.
* ``WarmSpareMarker``: a spare whose workers warmed up and parked says so in etcd (planners
  promote warm spares first).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import time
from collections.abc import Callable

from health.alarms import DEGRADED, FATAL, Alarm
from rendezvous.kv import KVError
from rendezvous.membership import Membership
from rendezvous.plan import Plan
from rendezvous.planner import View, spares

from ..joblog import append_samples, cause_kind, node_stamps, plan_stamps
from ..protocol import WorkerState
from ..waits import Every
from .config import AgentConfig
from .session import EtcdSession
from .supervisor import WorkerSupervisor


class MetricsFeed:
    """tm_launch.launcher.metrics.AgentMetrics once ``serve`` started it; every ``on_*`` does nothing before."""

    def __init__(self, node_id: str, members: Membership):
        self.node_id = node_id
        self.members = members
        self.metrics = None

    def serve(self, addr: str, port: int | None, say: Callable[..., None]) -> None:
        if port is None:
            return
        from .metrics import AgentMetrics, MetricsError

        self.metrics = AgentMetrics(self.node_id)
        try:
            port = self.metrics.serve(addr, port)
        except MetricsError as e:
            self.metrics = None
            raise SystemExit(f"tm-launch: error: {e}") from None
        say(f"Prometheus metrics at http://{addr}:{port}/metrics")

    def stop(self) -> None:
        if self.metrics is not None:
            self.metrics.stop()

    def on_event(self, kind: str, fields: dict) -> None:
        if self.metrics is not None:
            self.metrics.on_event(kind, fields)

    def on_statuses(self, statuses: dict) -> None:
        if self.metrics is not None:
            self.metrics.on_statuses(statuses)

    def on_state(self, view: View, plan: Plan | None, spare_count: int) -> None:
        """Once per loop, from the snapshot already read: generation, role, and the spares it
        counted (``Snapshot.spares_alive``: a node that only follows has them from the plan's
        delta, not from records it does not read)."""
        if self.metrics is None or view.plan is None:
            return
        me = self.node_id
        plan = plan or view.plan
        role = (
            "failed"
            if me in view.failed
            else "draining"
            if me in view.drains and me in plan.nodes
            else "active"
            if me in plan.nodes
            else "spare"
        )
        self.metrics.on_state(plan.generation, role, spare_count)

    def on_generation(self, plan: Plan) -> None:
        if self.metrics is not None:
            self.metrics.on_generation(self.change_kind(plan))

    def on_entered(self, plan: Plan) -> None:
        """This node's workers run in ``plan``: downtime from the fault (or the plan) to now."""
        if self.metrics is None or plan.generation <= 0:
            return
        try:
            times = [float(r.get("time", 0)) for r in self.members.reports_for(plan.generation - 1).values()]
        except (KVError, TypeError, ValueError):
            times = []
        fault = min(times) if times and not plan.planned else plan.created
        self.metrics.on_downtime(self.change_kind(plan), time.time() - fault)

    def change_kind(self, plan: Plan) -> str:
        """Why generation ``plan`` exists, as a short label (reads the previous generation's reports)."""
        try:
            reports = self.members.reports_for(plan.generation - 1) if plan.generation > 0 else {}
        except KVError:
            reports = {}
        return cause_kind(dataclasses.asdict(plan), reports)


class AlarmWatch:
    def __init__(
        self,
        cfg: AgentConfig,
        session: EtcdSession,
        supervisor: WorkerSupervisor,
        say: Callable[..., None],
        wake: Callable[[], None] = lambda: None,
    ):
        self.cfg = cfg
        self.session = session
        self.supervisor = supervisor
        self.say = say
        self.alarms: queue.Queue[Alarm] = queue.Queue()  # filled by the monitor's thread
        self.wake = wake  # the agent's loop acts on an alarm the moment it is raised
        self.monitor = None

    def start(self) -> None:
        cfg = self.cfg.health
        if cfg is None or not cfg.nvml:
            return
        from health.nvml_monitor import NvmlMonitor, gpus_for_local_ranks

        gpus = gpus_for_local_ranks(self.cfg.nproc, os.environ.get("CUDA_VISIBLE_DEVICES"))
        self.monitor = NvmlMonitor(self.cfg.node_id, gpus, cfg, self._raised)
        if not self.monitor.start():
            self.monitor = None
            return
        self.supervisor.progress.gpu = self.monitor.gpu_activity  # GPU activity is progress evidence too

    def _raised(self, alarm: Alarm) -> None:  # on the monitor's thread
        self.alarms.put(alarm)
        self.wake()

    def stop(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()

    def handle(self, plan: Plan | None) -> None:
        """Publish every pending alarm; act on the severe ones (``plan``: the one followed)."""
        me = self.cfg.node_id
        while True:
            try:
                alarm = self.alarms.get_nowait()
            except queue.Empty:
                return
            record = alarm.to_json()
            self.session.members.operator_log.alarm(me, f"{alarm.signal}-gpu{alarm.gpu}", record)
            self.say(f"alarm {alarm.severity}: {alarm.message}", kind="alarm", alarm=record)
            if plan is None or me not in plan.nodes:
                if alarm.severity == FATAL:
                    self.session.cordon(me, f"{alarm.signal}: {alarm.message}")
                continue
            if alarm.severity == FATAL:
                self.session.cordon(me, f"{alarm.signal}: {alarm.message}")
                self.supervisor.workers.stop(grace=0)
            elif alarm.severity == DEGRADED:
                self.session.request_drain(me, f"{alarm.signal}: {alarm.message}")


class StragglerWatch:
    """Group rank 0's agent compares every rank's compute time, window by window (C4-style),
    and asks for a planned migration of a node whose rank stays slow."""

    def __init__(self, cfg: AgentConfig, session: EtcdSession, say: Callable[..., None]):
        self.cfg = cfg
        self.session = session
        self.say = say
        self.generation, self.detector, self.window = -1, None, -1  # the last window compared
        self.flagged: set[str] = set()  # nodes with a drain pending in this generation

    def check(self, plan: Plan, live_seen: bool) -> None:
        cfg = self.cfg.health
        if cfg is None or not cfg.straggler or not live_seen or not plan.nodes or plan.nodes[0] != self.cfg.node_id:
            return
        from health.straggler import StragglerDetector

        if self.generation != plan.generation:
            self.generation, self.detector = plan.generation, StragglerDetector(cfg)
            self.window, self.flagged = -1, set()
        by_window: dict[int, dict[int, float]] = {}
        owner: dict[int, str] = {}
        for node, record in self.session.members.operator_log.all_progress().items():
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
            if w <= self.window or len(by_window[w]) < plan.world_size:
                continue
            self.window = w
            for rank in self.detector.add_window(by_window[w]):
                node = owner.get(rank)
                if node is None or node in self.flagged:
                    continue
                self.flagged.add(node)  # one alarm per node and generation: the drain is pending
                alarm = self.detector.alarm_for(rank, node)
                self.session.members.operator_log.alarm(node, f"straggler-rank{rank}", alarm.to_json())
                self.session.request_drain(node, alarm.message)
                self.say(f"alarm degraded: {alarm.message} on {node}: requesting a planned migration", kind="alarm", alarm=alarm.to_json())
                self.detector.reset(rank)


class ProgressPublisher:
    def __init__(self, node_id: str, session: EtcdSession, supervisor: WorkerSupervisor, metrics: MetricsFeed, stragglers: StragglerWatch):
        self.node_id = node_id
        self.session = session
        self.supervisor = supervisor
        self.metrics = metrics
        self.stragglers = stragglers
        self.last_published = 0.0
        self.step_series: list = []  # this node's bounded log/steps/<node> series

    def publish(self, plan: Plan | None) -> None:
        """At most once a second: this node's progress record, its step series, then stragglers."""
        now = time.time()
        if now - self.last_published < 1.0 or plan is None:
            return
        self.last_published = now
        statuses = self.supervisor.statuses() if self.supervisor.workers else {}
        role = "active" if self.node_id in plan.nodes else "spare"
        record = {
            "node": self.node_id,
            "role": role,
            "generation": plan.generation,
            "workers": {
                str(lr): {
                    "step": s.step,
                    "state": s.state.value,
                    "rank": s.rank,
                    "step_time": s.step_time,
                    "windows": s.windows,
                    "snapshot_bytes": s.snapshot_bytes,
                    "snapshot_sent": s.snapshot_sent,
                    "snapshot_held": s.snapshot_held,
                }
                for lr, s in statuses.items()
            },
            "time": now,
        }
        self.metrics.on_statuses(statuses)
        # Sampled at publish time, also when a worker's status did not change: a step count that
        # stays flat for seconds (a pause, a hang, a wait for the next generation) must draw flat.
        rows = [
            [round(now, 2), s.generation, s.rank, s.step, None if s.step_time is None else round(s.step_time, 5), s.state.value]
            for s in statuses.values()
            if s.state.trained and s.step is not None
        ]
        oplog = self.session.members.operator_log
        try:
            oplog.progress(self.node_id, record, self.session.lease)
            unchanged = bool(rows) and [r[1:] for r in self.step_series[-len(rows) :]] == [r[1:] for r in rows]
            if rows and not (unchanged and all(r[5] in ("finished", "left") for r in rows)):  # after the end: no more writes
                self.step_series = append_samples(self.step_series, rows)
                oplog.steps(self.node_id, self.step_series)
            self.stragglers.check(plan, self.supervisor.live_seen)
        except KVError:
            pass


class EntryReport:
    """Once this node's live workers entered the current generation, log the phase timings."""

    def __init__(self, node_id: str, supervisor: WorkerSupervisor, metrics: MetricsFeed, say: Callable[..., None]):
        self.node_id = node_id
        self.supervisor = supervisor
        self.metrics = metrics
        self.say = say
        self.timings: dict[int, dict] = {}  # generation -> slowest communicator and state phases

    def report(self, plan: Plan | None) -> None:
        if plan is None or not plan.live or plan.generation in self.timings or self.node_id not in plan.nodes:
            return
        records = self.supervisor.entered(plan.generation)
        if not records:
            return
        comm = max(r.communicator for r in records)
        state = max(r.state for r in records)
        received = any(r.received for r in records)
        connects = sum(r.store_connects for r in records)  # opened on the way in (tm_launch.worker.comms.store_clients)
        opened = [r.tcp_opened for r in records if r.tcp_opened is not None]  # per worker (tm_launch.worker.comms.connections)
        since = time.time() - plan.created
        self.timings[plan.generation] = {"communicator": comm, "state": state}
        self.metrics.on_entered(plan)
        self.say(
            f"generation {plan.generation}: workers entered {since:.3f}s after the plan "
            f"(communicators {comm * 1000:.0f} ms, state {'received' if received else 'sent/kept'} in {state * 1000:.0f} ms)",
            kind="entered",
            generation=plan.generation,
            communicator_s=comm,
            state_s=state,
            received=received,
            after_plan_s=since,
            store_connects=connects,
            tcp_opened=max(opened) if opened else None,  # the most any one worker of this node opened
            groups_rebuilt=max(r.groups_rebuilt for r in records),
        )


class DowntimeStamps:
    """What this agent knows of each live generation change, for ``tm_launch.joblog``: when it
    read the plan and handed it to its workers, and (from the workers) when they built their
    communicators, entered and completed their first step; as the publishing planner, when the
    failure was reported and when it sent the plan. One etcd write per node and generation, made
    after the workers are back to training (never on the way there), never per step."""

    def __init__(self, node_id: str, session: EtcdSession, supervisor: WorkerSupervisor):
        self.node_id = node_id
        self.session = session
        self.supervisor = supervisor
        self.seen: dict[int, float] = {}  # generation -> when this agent read its plan (record not written yet)
        self.published: dict[int, dict] = {}  # generation -> this planner's stamps (not written yet)

    def plan_seen(self, plan: Plan, at: float) -> None:
        if not plan.live or plan.generation == 0 or plan.finished or self.node_id not in plan.nodes:
            return
        self.seen[plan.generation] = at
        for old in [g for g in self.seen if g < plan.generation - 1]:
            del self.seen[old]  # superseded before its workers ran a step in it: nothing to record

    def plan_published(self, plan: Plan, sent_at: float, view: View) -> None:
        if plan.generation > 0 and not plan.finished:
            self.published[plan.generation] = plan_stamps(self.node_id, sent_at, view.report_times)

    def write(self) -> None:
        """Write what is complete: the planner's stamps, and a generation whose local workers all
        completed a step in it. A KVError leaves the rest for the next call."""
        oplog, sup = self.session.members.operator_log, self.supervisor
        for gen in sorted(self.published):
            oplog.downtime_stamps(gen, None, self.published[gen])
            del self.published[gen]
        for gen in sorted(self.seen):
            firsts = sup.first_steps(gen)
            entered = sup.entered(gen) if firsts else None
            if entered and firsts:
                oplog.downtime_stamps(gen, self.node_id, node_stamps(self.seen[gen], sup.directed_at.get(gen), entered, firsts))
                del self.seen[gen]

    def flush(self) -> None:
        """Before the agent exits: what is complete, if etcd answers."""
        try:
            self.write()
        except KVError:
            pass


class DrainWaitNote:
    """A drain waits for a spare (it never shrinks the job): group rank 0's agent says so."""

    def __init__(self, node_id: str, say: Callable[..., None]):
        self.node_id = node_id
        self.say = say
        self.waiting: Every | None = None  # progress lines while a drain waits for a spare

    def note(self, view: View) -> None:
        plan = view.plan
        if plan is None or plan.finished or not plan.nodes or plan.nodes[0] != self.node_id:
            return
        waiting = [n for n in plan.nodes if n in view.drains]
        if not waiting or spares(view):
            self.waiting = None
            return
        if self.waiting is None:
            self.waiting = Every()
        if self.waiting.due():
            self.say(
                f"generation {plan.generation}: drain of {', '.join(waiting)} waits for a spare node, none is available "
                f"({self.waiting.elapsed:.0f} s so far; start a spare or `tm-launch ctl uncordon` one)",
                kind="waiting",
                waiting_for="spare",
                draining=waiting,
                elapsed_s=round(self.waiting.elapsed, 1),
            )


class WarmSpareMarker:
    """A spare's ``state/warm/<node>`` marker: present while every one of its workers is alive
    and parked (warmed up in the sandbox, waiting to be named), absent otherwise. Planners
    promote warm spares first (``rendezvous.planner.spares``). Written when that changes, and
    again under a new lease (the marker is leased: it goes with a registration that lapsed)."""

    def __init__(self, node_id: str, session: EtcdSession, supervisor: WorkerSupervisor):
        self.node_id = node_id
        self.session = session
        self.supervisor = supervisor
        self.marked_under = None  # the lease the marker was written under; None: no marker

    def update(self, plan: Plan | None) -> None:
        warm = plan is not None and not plan.finished and self.node_id not in plan.nodes and self._parked()
        if warm == (self.marked_under is not None) and (not warm or self.marked_under is self.session.lease):
            return
        members = self.session.members
        try:
            if warm:
                members.mark_warm(self.node_id, self.session.lease)
                self.marked_under = self.session.lease
            else:
                members.unmark_warm(self.node_id)
                self.marked_under = None
        except KVError:
            pass  # etcd is away: the next iteration tries again

    def _parked(self) -> bool:
        sup = self.supervisor
        if not sup.workers or any(code is not None for code in sup.workers.poll().values()):
            return False
        statuses = sup.statuses()
        return len(statuses) == len(sup.workers.workers) and all(s.state == WorkerState.PARKED for s in statuses.values())
