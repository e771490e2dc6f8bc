"""What this node tells the job about its workers' ends and its peers' deaths.

Turns what the supervisor sees into reports for the planner: a worker that failed (blamed on its
cause: killed by a signal is primary, a non-zero exit may be collateral), workers that finished
(the node is done), a joiner that came too late (nothing left), and peers whose agent refuses
connections while a local collective failed (a node lost, known in milliseconds rather than
after the lease TTL). Each failure is reported once per generation.

A survivor whose workers wait in a generation that does not come together reports itself after a
patience (2 lease TTLs, at least 10 s), and its workers restart: their state goes. Not while the
generation's joiners are alive and still warming up (``joiners_warming_up``): a spare promoted
before it had warmed up takes as long as its imports and model build take, and the survivors'
state is what makes the recovery live.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

from rendezvous.kv import KVError
from rendezvous.plan import Plan
from rendezvous.planner import View, finished_without
from rendezvous.script_errors import SCRIPT_PREFIX

from ..protocol import WorkerState
from ..waits import Every
from .config import AgentConfig
from .exit_notice import counts_as_failure
from .peer_link import probe_targets
from .processes import describe_exit
from .session import EtcdSession
from .supervisor import WorkerSupervisor

WARMING_UP = (WorkerState.SANDBOX.value, WorkerState.WARMUP.value)
# A progress record is written every second, stamped with its node's clock: one older than this
# is an agent whose loop stopped (its lease, kept by a thread of its own, may still run).
FRESH_PROGRESS_S = 10.0


def joiners_warming_up(plan: Plan, progress: dict[str, dict], now: float) -> list[str]:
    """The joiners of ``plan`` whose agents say, in a progress record of the last
    ``FRESH_PROGRESS_S`` (``observers.ProgressPublisher``), that a worker of theirs is still
    warming up in the sandbox. The records are leased: a dead joiner's is gone."""
    warming = []
    for node in plan.joiners:
        record = progress.get(node) or {}
        when = record.get("time")
        fresh = isinstance(when, (int, float)) and now - when < FRESH_PROGRESS_S
        states = [w.get("state") for w in (record.get("workers") or {}).values()]
        if fresh and any(s in WARMING_UP for s in states):
            warming.append(node)
    return warming


class FailureWatch:
    def __init__(self, cfg: AgentConfig, session: EtcdSession, supervisor: WorkerSupervisor, say: Callable[..., None]):
        self.cfg = cfg
        self.session = session
        self.supervisor = supervisor
        self.say = say
        self.reported_gen = -1  # the generation this node last reported a failure of its own in
        self.done_gen = -1  # the generation this node's workers were marked done in
        self.keepers_done_at: float | None = None  # a joiner saw its keepers finish without it
        self.probed_gen, self.probed_at = -1, 0.0  # the last probe of the peers' agents
        self.recovering_since: float | None = None  # a local worker waits for a new generation
        self.warming: tuple[int, float, list[str]] = (-1, 0.0, [])  # generation, when its joiners' progress was read, who warmed up
        self.warming_note = Every()  # the line saying the survivors wait for a joiner's warm-up

    def workers_started(self) -> None:
        """New workers: a failure of theirs is news even in a generation that already had one."""
        self.reported_gen = -1

    def watch_workers(self, plan: Plan | None, view: View) -> None:
        sup = self.supervisor
        if plan is None or not sup.workers:
            return
        if sup.note_live():
            self.session.members.set_live()
        me = self.cfg.node_id
        failed = sup.workers.failed() or self._dying_in_steps()
        active = me in plan.nodes and not plan.finished
        if failed and failed[0] in sup.statuses() and sup.statuses()[failed[0]].state == WorkerState.FINISHED:
            # Training finished in that process; a crash on the way out (interpreter teardown)
            # must not turn a finished job into a failover that nobody can take part in.
            local_rank, code = failed
            self.say(
                f"generation {plan.generation}: worker {local_rank} finished its steps, then {describe_exit(code)} while exiting; counting it as done",
                kind="warning",
            )
            sup.workers.forget(local_rank)
            failed = sup.workers.failed()
        if failed and self.reported_gen != plan.generation:
            local_rank, code = failed
            refused = sup.refused(local_rank)
            if refused is not None and active:
                # The job cannot run as configured (snapshots over their memory limit): no
                # restart helps; the planner fails the job with the worker's own line.
                sup.workers.stop(grace=0)
                self.reported_gen = plan.generation
                self.say(f"generation {plan.generation}: {refused.why}", kind="refused", generation=plan.generation)
                self.session.report_failure(plan.generation, me, refused.why, kind="refused")
                return
            error = sup.script_error(local_rank)
            if error is not None and active:
                self._report_script_error(plan, local_rank, error)
                return
            lost = sup.state_lost(local_rank)
            if lost is not None and active:
                # Not this node's fault: the live state of some rank exists nowhere any more.
                sup.workers.stop(grace=0)
                self.reported_gen = plan.generation
                why = f"{lost.why or 'training state lost'}; every worker restarts from the script's checkpoint"
                self.say(
                    f"generation {plan.generation}: {why}",
                    kind="state_lost",
                    generation=plan.generation,
                    lost_step=lost.step,
                    lost_ranks=lost.ranks,
                )
                self.session.report_failure(plan.generation, me, why, kind="state")
                return
            dying = sup.workers.workers[local_rank] if code is None else None
            if dying is not None:
                why = f"worker {local_rank} (pid {dying.pid}) killed (its exit began without the interpreter's own)"
            else:
                why = f"worker {local_rank} (pid {sup.workers.pids()[local_rank]}) {describe_exit(code)}"
                cause = sup.root_cause(plan.ranks(me))
                if cause:
                    why += f": {cause}"
            if not active:
                sup.workers.stop(grace=0)
                self.say(f"spare: sandbox {why}; it will be started again", kind="spare_failed")
                return
            self.reported_gen = plan.generation
            try:
                self.report_dead_peers(plan, view)  # a dead peer, not this node, may be the cause
                self.say(
                    f"generation {plan.generation}: {why}; reporting the failure",
                    kind="worker_failed",
                    generation=plan.generation,
                    local_rank=local_rank,
                    exit_code=code,
                )
                self.session.report_failure(plan.generation, me, why, kind="signal" if code is None or code < 0 else "exit")
            finally:
                # After the report, not before: stopping and reaping this node's other workers
                # took 32-35 ms with one other worker on a loaded 2-core machine, and the whole
                # recovery waited for it. They are in a generation that is over either way.
                sup.workers.stop(grace=0)
            if dying is not None and dying.poll() is not None:  # reaped by the stop: how it ended, for the log
                self.say(
                    f"generation {plan.generation}: worker {local_rank} (pid {dying.pid}) {describe_exit(dying.poll())}, "
                    f"{(time.time() - dying.notice.began_at) * 1000:.0f} ms after its exit began"
                )
            return
        if active and self.done_gen != plan.generation and sup.workers.all_succeeded():
            self.done_gen = plan.generation
            self.session.members.mark_done(plan.generation, me)
            self.say(f"generation {plan.generation}: this node's workers finished; waiting for the others")
        if active and self.done_gen != plan.generation and self._nothing_left(plan, view):
            self.done_gen = plan.generation
            sup.workers.stop(grace=0)
            self.session.members.mark_done(plan.generation, me)
            self.say(
                f"generation {plan.generation}: the nodes that kept their workers finished training before this "
                "node's workers got in; nothing left for them to do",
                kind="warning",
                generation=plan.generation,
            )
        if active:
            sup.watch_hangs(plan)

    def _report_script_error(self, plan: Plan, local_rank: int, error) -> None:
        """The script raised (its traceback is on the worker's stderr): one line, and a report
        the planner tells a bug from a transient by (``rendezvous.script_errors``). This node's
        other workers stop: the node is replaced (once) or the job ends, as for any failure."""
        sup = self.supervisor
        sup.workers.stop(grace=0)
        self.reported_gen = plan.generation
        self.say(
            f"generation {plan.generation}: rank {error.rank} (worker {local_rank}) raised {error.signature()}; reporting a script error",
            kind="script_error",
            generation=plan.generation,
            rank=error.rank,
            local_rank=local_rank,
            verdict="script error",
            evidence={"exception": error.type, "message": error.message, "step": error.step},
        )
        self.session.report_failure(plan.generation, self.cfg.node_id, SCRIPT_PREFIX + error.signature(), kind="script")

    def _dying_in_steps(self) -> tuple[int, None] | None:
        """(local rank, None) of a worker whose exit began while it was in the job's steps and
        that the interpreter did not end (``exit_notice.counts_as_failure``): reported before the
        kernel has freed its memory and told ``waitid``."""
        for lr, worker in sorted(self.supervisor.workers.workers.items()):
            if worker.began_to_exit():
                status = self.supervisor.status_now(lr)
                if status is not None and counts_as_failure(status.state, status.mode, worker.notice.on_its_own):
                    return lr, None
        return None

    def report_workers_gone(self, plan: Plan, previous: Plan) -> None:
        """This node's workers died in the previous generation, but ``plan`` was made before
        that report was seen: it counts on workers that are gone. Report it again here."""
        self.reported_gen = plan.generation
        why = f"this node's workers died in generation {previous.generation}, before generation {plan.generation} took them into account"
        self.say(f"generation {plan.generation}: {why}; reporting the failure", kind="worker_failed", generation=plan.generation)
        self.session.report_failure(plan.generation, self.cfg.node_id, why, kind="signal")

    def _nothing_left(self, plan: Plan, view: View) -> bool:
        """A joiner whose keepers all finished (planner.finished_without) while none of its
        workers entered the generation, for 2 s on end: a worker that got in writes its entry
        key the moment its state arrived, long before its peers' exits reach etcd."""
        if not finished_without(view, self.cfg.node_id) or self.supervisor.any_entered(plan.generation):
            self.keepers_done_at = None  # the pure check first: this runs on every loop iteration
            return False
        self.keepers_done_at = self.keepers_done_at or time.time()
        return time.time() - self.keepers_done_at >= 2.0

    def probe_peers(self, plan: Plan | None, view: View) -> None:
        """A local worker saw a collective fail, or its commit vote waits long for its peers: find
        out at once whether a peer node died; and, after a failed collective, if no new
        generation comes (no node was lost, e.g. a transient network error), report this node
        after a while so that the job regroups instead of waiting forever."""
        recovering = self.supervisor.recovering()  # only a live worker waits for a generation
        if plan is None or not (view.live or self.supervisor.live_seen or recovering) or self.cfg.node_id not in plan.nodes:
            return
        if not recovering:
            self.recovering_since = None
            if self.supervisor.waiting_for_peers() and time.time() - self.probed_at >= 0.5:
                # A commit vote waits on a peer that failed no collective of ours: dead, or slow?
                # Only a dead one is reported; a slow one is the straggler detector's business.
                self.report_dead_peers(plan, view)
            return
        if self.probed_gen != plan.generation:
            self.recovering_since = time.time()
            self.report_dead_peers(plan, view)
            return
        if time.time() - self.probed_at >= 0.5:
            # Peers can die after the first probe, e.g. a promoted spare killed while the others
            # wait for it in the communicator setup: keep probing while recovering.
            self.report_dead_peers(plan, view)
        patience = max(10.0, 2 * self.cfg.lease_ttl)
        if self.recovering_since and time.time() - self.recovering_since > patience and self.reported_gen != plan.generation:
            if self._waiting_for_warm_up(plan):
                return
            self.reported_gen = plan.generation
            what = self.supervisor.recovering_why() or "a collective failed"
            why = f"{what} {patience:.0f}s ago and no peer node was lost; restarting this node's workers"
            self.say(f"generation {plan.generation}: {why}", kind="worker_failed", generation=plan.generation)
            self.session.report_failure(plan.generation, self.cfg.node_id, why, kind="exit")

    def _waiting_for_warm_up(self, plan: Plan) -> bool:
        """Past the patience: are this generation's joiners alive and still warming up (read at
        most once a second)? For up to ``--join-timeout`` from the plan, as long as the first
        generation may take to form; a warm-up that hangs is then reported like any stall."""
        waited = time.time() - (self.recovering_since or time.time())
        if not plan.live or not plan.joiners or waited > self.cfg.join_timeout:
            return False
        generation, read_at, warming = self.warming
        if generation != plan.generation or time.time() - read_at >= 1.0:
            try:
                progress = self.session.members.operator_log.progress_of(plan.joiners)
            except KVError:
                progress = {}
            warming = joiners_warming_up(plan, progress, time.time())
            self.warming = (plan.generation, time.time(), warming)
        if warming and self.warming_note.due():
            self.say(
                f"generation {plan.generation}: waiting {waited:.0f} s for {', '.join(warming)} to warm up "
                f"(a spare promoted before it had; up to --join-timeout {self.cfg.join_timeout:.0f} s)",
                kind="waiting",
                waiting_for="warm-up",
                joiners=warming,
                elapsed_s=round(waited, 1),
            )
        return bool(warming)

    def report_if_lost(self, plan: Plan | None, view: View, node: str) -> bool:
        """The connection to ``node``'s agent ended (``tm_launch.launcher.peer_link``): report the node
        lost if its agent refuses connections, and only while it is active in the newest plan
        (read now, one key: a node that was replaced, drained or finished closes its connections
        too, and this view may be older than the plan that let it go). True when its agent
        answered: the link broke, the node is alive."""
        me = self.cfg.node_id
        if plan is None or plan.finished or me not in plan.nodes or node not in plan.nodes:
            return False
        newest = self.session.members.plan()
        if newest is None or newest.finished or newest.generation != plan.generation:
            return False
        return node in self.report_dead_peers(plan, view, only=node)

    def report_dead_peers(self, plan: Plan, view: View, only: str | None = None) -> set[str]:
        """Report active peers whose agent refuses connections. A dead agent's port refuses at
        once, so a node loss is known in milliseconds instead of after the lease TTL; anything
        short of a refusal (a timeout, a partition) is left to the lease, the authority. The
        view's record may be older than the peer's registration (a follower's view carries
        records over from generation to generation): a refusal is checked against the record
        read now, one key, before the peer is reported. ``only``: probe that peer alone; else
        the peers at ring distances 1, 2, 4, ... (``peer_link.probe_targets``: log2(N) each).
        Returns the peers whose agent answered."""
        if only is None:  # a probe round (probe_peers counts from it)
            self.probed_gen, self.probed_at = plan.generation, time.time()
        answered = set()
        for node in probe_targets(plan.nodes, self.cfg.node_id) if only is None else [only]:
            info = view.alive.get(node)
            if node == self.cfg.node_id or info is None or node in view.reports:
                continue
            try:
                socket.create_connection((info.addr, info.store_port), timeout=0.5).close()
                answered.add(node)
            except ConnectionRefusedError:
                if self.session.members.node_record(node) not in (None, info):
                    continue  # registered again since the view was read (a new agent, a new port): not lost
                why = f"agent unreachable at {info.addr}:{info.store_port} (connection refused): node lost"
                self.say(f"generation {plan.generation}: {node}: {why}", kind="node_lost", generation=plan.generation, lost=node)
                self.session.report_failure(plan.generation, node, why, kind="lost")
                # Unregister it too: its lease outlives it by a few seconds, and a later
                # generation must not promote (or wait for) a node already known dead.
                self.session.members.leave(node)
            except OSError:
                continue
        return answered
