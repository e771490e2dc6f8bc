"""Following the plan: what each new generation asks of this node.

Start fresh workers (restart mode, or a live generation this node joins), warm spares up in the
sandbox, hand the generation to workers that keep running, or leave (a drained node waits for its
workers to hand their state over first). ``plan`` is the last generation this node acted on;
the rest of the agent reads it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from rendezvous.kv import KVError
from rendezvous.plan import FAILED, SUCCEEDED, Plan
from rendezvous.planner import View, spares

from .. import settings
from ..waits import Every
from . import store_server
from .config import AgentConfig
from .failures import FailureWatch
from .observers import MetricsFeed
from .session import EtcdSession, Fenced
from .supervisor import WorkerSupervisor


class PlanExecutor:
    def __init__(
        self,
        cfg: AgentConfig,
        session: EtcdSession,
        supervisor: WorkerSupervisor,
        failures: FailureWatch,
        metrics: MetricsFeed,
        say: Callable[..., None],
    ):
        self.cfg = cfg
        self.session = session
        self.supervisor = supervisor
        self.failures = failures
        self.metrics = metrics
        self.say = say
        self.plan: Plan | None = None  # the last generation this agent acted on
        self.master_store, self.master_gen = None, -1  # this node's env:// store for a fresh generation

    def follow(self, plan: Plan, view: View) -> int | None:
        """Do what generation ``plan`` asks of this node; an exit code when the agent is done."""
        me, sup = self.cfg.node_id, self.supervisor
        previous, self.plan = self.plan, plan
        if plan.state == SUCCEEDED:
            sup.stop("job finished")
            self.say(f"job finished successfully (generation {plan.last_run})")
            return 0
        if plan.state == FAILED:
            sup.stop("job failed")
            self.say(f"generation {plan.last_run}: job failed: {plan.reason}", kind="job_failed", generation=plan.last_run)
            return 1
        if previous is not None:
            self.metrics.on_generation(plan)
        if previous is None and me in plan.nodes:
            self.say(f"generation {plan.generation}: active, group rank {plan.group_rank(me)}, ranks {plan.ranks(me)} of {plan.world_size}")
        if me in plan.removed:
            return self._leave(plan, hosted_store=previous is not None and previous.store.get("node") == me)
        if me not in plan.nodes:
            self.be_spare(plan, view)
            return None
        if not plan.live or self.cfg.no_live:
            sup.stop(f"generation {plan.generation} restarts every worker")
            self._start_workers(plan, sandbox=False)
        elif me in plan.joiners and not (sup.workers and sup.workers.kind == "sandbox"):
            sup.stop("restarting this node's workers as joiners")
            self._start_workers(plan, sandbox=True)
        if me in plan.joiners and previous is not None and me not in (previous.nodes if previous else ()):
            self.say(
                f"generation {plan.generation}: promoted from spare to group rank {plan.group_rank(me)} (ranks {plan.ranks(me)})",
                kind="promoted",
                generation=plan.generation,
            )
        sup.direct(plan)
        self._warn_spares(view, plan)
        if (
            plan.live
            and not self.cfg.no_live
            and me not in plan.joiners
            and not sup.workers
            and previous is not None
            and me in previous.nodes
        ):
            self.failures.report_workers_gone(plan, previous)
        return None

    def be_spare(self, plan: Plan, view: View) -> None:
        """A spare warms its workers up in the sandbox once the job is known to be live."""
        sup = self.supervisor
        if self.plan is not None and (view.live or sup.live_seen) and not self.cfg.no_live and not sup.workers:
            self.say(f"spare: warming up {self.cfg.nproc} worker(s) in the sandbox (world size {plan.world_size})", kind="sandbox")
            self._start_workers(plan, sandbox=True)
        elif not sup.workers:
            self.say(f"spare: waiting (generation {plan.generation} has {len(plan.nodes)} active node(s))")
        sup.direct(plan)

    def _leave(self, plan: Plan, hosted_store: bool) -> int:
        """This node is out of ``plan``: its workers hand over (a drain) or are stopped, then the
        agent exits; ``hosted_store``: its agent hosted the store of the generation it leaves."""
        me, sup = self.cfg.node_id, self.supervisor
        planned = plan.planned and plan.live and sup.workers
        if not planned:
            # The registration goes first: the next plan no longer names this node as removed,
            # and a plan made while it still stops its workers and flushes its events took it
            # for a spare (seen in a chaos soak: promoted again 0.2 s after it left, and the job
            # waited for its lease to lapse, then for a cold spare).
            self.session.close()
        if planned:
            sup.direct(plan)  # the leavers' workers hand over at the switch step, then exit
            self._wait_saying(
                lambda: all(code is not None for code in sup.workers.poll().values()),
                max(60.0, settings.stall_bound(self.cfg.collective_timeout)),
                "leavers",
                lambda: (
                    f"generation {plan.generation}: drained; waiting for local worker(s) "
                    f"{[lr for lr, code in sup.workers.poll().items() if code is None]} to hand over their state and exit"
                ),
                poll=0.05,
            )
        sup.stop("this node left the job")
        successor = next((new for new, old in plan.replaced.items() if old == me), None)
        how = f"replaced by {successor}" if successor else "removed"
        if plan.planned:
            self.say(f"generation {plan.generation}: drained, {how}; exiting", kind="left", generation=plan.generation)
        else:
            self.say(
                f"generation {plan.generation}: {how} after a failure ({plan.cause}); exiting", kind="left", generation=plan.generation
            )
        if hosted_store and plan.live:
            self._keep_store_for_joiners(plan)
        return 0 if plan.planned else 1

    def _keep_store_for_joiners(self, plan: Plan) -> None:
        """This agent's store holds the per-rank mirrors of the steps committed in the generation
        it leaves (``tm_launch.worker.state.per_rank``): a rank that takes over from one that left fetches its
        RNG and data position there. So the store keeps serving, with the workers stopped and the
        registration given back (no longer a spare nor a planner), until every node of a later
        live generation has completed a step in it (its stamps, ``OperatorLog.stamped_nodes``: the
        mirrors are in that generation's store by then), the job ended or restarted, or
        max(60 s, --collective-timeout) passed. An agent that left at once took the mirrors along
        whenever the joiner fetched after it was gone, and every worker restarted from the
        script's checkpoint."""
        self.session.close()
        members = self.session.direct  # not retried: the deadline below bounds this wait, etcd or not
        deadline = time.time() + max(60.0, settings.stall_bound(self.cfg.collective_timeout))
        self.say(
            f"generation {plan.generation}: serving this node's store until the new generation completes a step "
            "(the ranks taking over fetch their per-rank state there)"
        )
        while time.time() < deadline:
            try:
                current = members.plan()
                if (
                    current is None
                    or current.finished
                    or not current.live
                    or set(current.nodes) <= members.operator_log.stamped_nodes(current.generation)
                ):
                    return
            except KVError:
                pass  # etcd away for a moment: the deadline still ends the wait
            time.sleep(0.1)

    def _warn_spares(self, view: View, plan: Plan) -> None:
        have = len(spares(dataclasses.replace(view, plan=plan)))
        if have < self.cfg.spares and plan.nodes and plan.nodes[0] == self.cfg.node_id:
            self.say(f"warning: the job wants {self.cfg.spares} spare node(s) and has {have}", kind="warning")

    def _start_workers(self, plan: Plan, sandbox: bool) -> None:
        self.supervisor.direct(plan)
        if self.failures.reported_gen != -1:  # this node's own workers failed: torchrun's restart count goes up
            self.supervisor.workers.restarts += 1
        master = None if sandbox else self.master(plan)
        self.supervisor.start(plan, sandbox, master)
        self.failures.workers_started()

    def master(self, plan: Plan) -> tuple[str, int]:
        """MASTER_ADDR/PORT for a generation of fresh workers: a new TCPStore every generation.

        torch's env:// init does not prefix its keys per attempt (torchrun makes a new store per
        restart), so reusing one store would hand new workers the old workers' addresses. The
        plan's store node hosts it and publishes the port; the others wait for it."""
        members = self.session.members
        if plan.store.get("node") == self.cfg.node_id:
            if self.master_gen != plan.generation:
                self.master_store = store_server.serve(self.cfg.addr)  # every worker connects at once
                self.master_gen = plan.generation
                members.publish_store(plan.generation, self.cfg.addr, self.master_store.port)
            return self.cfg.addr, self.master_store.port

        def published() -> dict | None:
            where = members.store_for(plan.generation)
            if not where and self.session.lost_lease.is_set():
                raise Fenced("lease expired")
            return where

        where = self._wait_saying(
            published,
            max(60.0, self.cfg.lease_ttl * 4),
            "store",
            lambda: f"generation {plan.generation}: waiting for {plan.store.get('node')} to publish the workers' env:// store",
            poll=0.02,
        )
        if where:
            return where["addr"], int(where["port"])
        raise SystemExit(
            f"tm-launch: error: generation {plan.generation}'s store host {plan.store.get('node')} never published its store; is that node alive?"
        )

    def _wait_saying(self, done: Callable[[], object], limit: float, waiting_for: str, what: Callable[[], str], poll: float):
        """Poll ``done`` every ``poll`` seconds until it returns something true (returned) or
        ``limit`` seconds passed (None), saying every few seconds what this node waits for
        (``what()``) and for how long: a wait that says nothing looks like a hung agent. Time
        ``done`` spent waiting for etcd to answer (its requests are retried under the retry
        policy) does not count: an etcd outage must not end a wait for a peer."""
        deadline = time.time() + limit
        ticker = Every()
        while time.time() < deadline:
            asked = time.time()
            got = done()
            deadline += max(time.time() - asked - 1.0, 0.0)
            if got:
                return got
            if ticker.due():
                self.say(
                    f"{what()} ({ticker.elapsed:.0f} s of {limit:.0f} s)",
                    kind="waiting",
                    waiting_for=waiting_for,
                    elapsed_s=round(ticker.elapsed, 1),
                )
            time.sleep(poll)
        return None
