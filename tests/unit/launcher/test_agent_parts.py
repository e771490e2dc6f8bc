"""The agent's parts on their own, with real objects: a real etcd (the session fixture), a real
agent TCPStore, real sockets. The whole loop is covered by the multi-process tests
(test_live, test_ops, test_health_e2e, test_restart_mode, ...); these pin each part's own state.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time
import uuid

import pytest

from health.config import HealthConfig
from rendezvous.kv import EtcdOptions, KVError, connect
from rendezvous.membership import Membership
from rendezvous.plan import NodeInfo, Plan
from rendezvous.planner import Limits, View
from tm_launch.launcher.config import AgentConfig
from tm_launch.launcher.failures import FailureWatch
from tm_launch.launcher.observers import DowntimeStamps, DrainWaitNote, MetricsFeed
from tm_launch.launcher.session import EtcdSession, Fenced
from tm_launch.launcher.supervisor import WorkerSupervisor
from tm_launch.protocol import LATEST, Directive, EnteredRecord, FirstStepRecord, WorkerKeys, WorkerState, WorkerStatus, directive_key
from tm_launch.waits import Every


class Said(list):
    """A ``say`` that keeps (message, kind) pairs."""

    def __call__(self, message, kind="info", publish=True, **fields):
        self.append((message, kind))

    def kinds(self):
        return [kind for _, kind in self]


@pytest.fixture
def members(etcd_endpoint):
    kv = connect("v3", EtcdOptions(endpoints=(etcd_endpoint,), prefix=f"/tests/parts-{uuid.uuid4().hex[:10]}"))
    yield Membership(kv)
    kv.close()


def node(node_id: str, port: int = 29500) -> NodeInfo:
    return NodeInfo(id=node_id, host="localhost", addr="127.0.0.1", store_port=port, nproc=1, pid=os.getpid(), joined=time.time())


def session_for(members, say, progress=(False, None), ttl=2.0) -> EtcdSession:
    return EtcdSession(members, "n1", lease_ttl=ttl, stall_limit=30.0, say=say, local_progress=lambda: progress)


# ------------------------------------------------------------------------------------------------
# EtcdSession: reachability, the fencing rule, reports


def test_session_says_once_when_etcd_goes_and_once_when_it_is_back(members):
    said = Said()
    s = session_for(members, said)
    for _ in range(3):
        s.note_etcd(False, KVError("connection refused"))
    assert said.kinds() == ["etcd_down"] and not s.etcd_ok
    assert not s.settling()  # etcd never came back yet: nothing to settle
    s.note_etcd(True)
    s.note_etcd(True)
    assert said.kinds() == ["etcd_down", "etcd_back"] and s.etcd_ok
    assert s.settling()  # right after an outage planners wait for every node to re-register


def silent(session: EtcdSession) -> EtcdSession:
    """``session`` as etcd left it: a TTL without a lease refresh, and no answer to anything."""
    session.lease_failing, session.lease_ok_at = True, time.time() - 2.0
    session.note_etcd(False, KVError("connection refused"))
    return session


@pytest.fixture
def unreachable(refusing_port):
    """A ``Membership`` whose etcd does not answer (a port that refuses connections)."""
    from rendezvous.kv.v3 import EtcdV3

    kv = EtcdV3(EtcdOptions(endpoints=(f"127.0.0.1:{refusing_port}",), timeout=0.5))
    yield Membership(kv)
    kv.close()


def test_session_fences_when_etcd_is_silent_and_the_workers_are_stuck(unreachable, members):
    plan = Plan(generation=0, nodes=("n1", "n2"), nproc=1)
    stuck = silent(session_for(unreachable, Said(), progress=(True, None)))
    with pytest.raises(Fenced, match="etcd unreachable .* recovering from a failed collective"):
        stuck.apply_fencing_rule(plan)
    # the same outage while the workers make progress: etcd is what is down, keep training
    training = silent(session_for(unreachable, Said(), progress=(False, 0.1)))
    training.apply_fencing_rule(plan)
    # etcd answers again (the last request before fencing finds it back): the lost lease, if
    # any, is the next fresh read's to decide, not etcd's silence
    back = silent(session_for(members, Said(), progress=(True, None)))
    back.apply_fencing_rule(plan)
    assert back.etcd_ok
    # a spare owns no rank: never fenced for unreachability
    stuck.apply_fencing_rule(Plan(generation=0, nodes=("n2",), nproc=1))


def test_session_registers_again_after_its_lease_expired_unless_replaced(members):
    said = Said()
    s = session_for(members, said, ttl=1.0)
    s.register(node("n1"))
    s.lease.revoke()  # the lease expiring, without waiting for the TTL
    deadline = time.time() + 10
    while not s.lost_lease.is_set() and time.time() < deadline:
        time.sleep(0.05)
    assert s.lost_lease.is_set()
    s.apply_fencing_rule(None)  # without a fresh read only unreachability counts
    assert s.lost_lease.is_set()
    s.apply_fencing_rule(None, members.snapshot())  # etcd answers and nobody took our ranks
    assert not s.lost_lease.is_set() and "rejoined" in said.kinds()
    assert "n1" in members.snapshot().view.alive
    # replaced: a newer plan without this node means another node owns its ranks
    s.lease.revoke()
    while not s.lost_lease.is_set() and time.time() < deadline:
        time.sleep(0.05)
    followed = Plan(generation=0, nodes=("n1",), nproc=1)
    assert members.publish(followed, None)
    assert members.publish(followed.next(nodes=("n2",), removed=("n1",)), members.snapshot().plan_entry)
    with pytest.raises(Fenced, match="generation 1 no longer has this node"):
        s.apply_fencing_rule(followed, members.snapshot())
    s.close()


@pytest.fixture
def one_member(tmp_path):
    """A 1-member etcd cluster (fixed ports, so that it comes back where it was) and a
    ``Membership`` on it, for outages: ``.cluster.kill(0)``, ``.cluster.restart(0)``. Over the
    v2 API, whose TTLs run on wall-clock time: a lease expires during an outage longer than its
    TTL (v3 renews every lease when a member becomes leader)."""
    from rendezvous.etcd_server import EtcdCluster

    cluster = EtcdCluster(size=1).start()
    kv = connect("v2", EtcdOptions(endpoints=tuple(cluster.endpoints), prefix=f"/tests/outage-{uuid.uuid4().hex[:10]}", timeout=1.0))
    m = Membership(kv)
    m.cluster = cluster
    yield m
    kv.close()
    cluster.stop()


def test_a_running_agents_request_waits_out_an_etcd_outage_under_the_retry_policy(one_member):
    """A report written while etcd is down is retried (not raised) until etcd is back: said once
    each way; the lease expired meanwhile is registered again the same way, under the same id.
    (The agent's loop runs in a thread here: etcd must be restarted by the thread that started
    it, which its parent-death signal is tied to.)"""
    import threading

    said, out = Said(), {}
    plan = Plan(generation=0, nodes=("n1", "n2"), nproc=1)
    registered, killed = threading.Event(), threading.Event()

    def agent():
        s = EtcdSession(
            one_member, "n1", lease_ttl=2.0, stall_limit=30.0, say=said, local_progress=lambda: (False, 0.1),
            worker_exits=lambda: {0: None}, followed=lambda: plan,
        )  # fmt: skip
        s.register(node("n1"))
        registered.set()
        killed.wait()
        t0 = time.time()
        s.members.report_failure(0, "n2", "worker 0 killed by SIGKILL")  # returns once etcd took it
        out["waited"] = time.time() - t0
        deadline = time.time() + 10
        while not s.lost_lease.is_set() and time.time() < deadline:  # the lease ran out in the outage
            time.sleep(0.05)
        out["lost"] = s.lost_lease.is_set()
        s.apply_fencing_rule(plan, s.members.snapshot())  # the loop's fresh read: register again
        out["rejoined"] = not s.lost_lease.is_set() and "n1" in one_member.snapshot().view.alive
        s.close()

    thread = threading.Thread(target=agent)
    thread.start()
    assert registered.wait(20)
    one_member.cluster.kill(0)
    killed.set()
    time.sleep(3.0)  # longer than the lease TTL
    one_member.cluster.restart(0)
    thread.join(60)
    assert out.get("waited", 0) >= 2.5 and out["lost"] and out["rejoined"], out
    assert one_member.reports_for(0)["n2"]["reason"] == "worker 0 killed by SIGKILL"
    assert said.kinds().count("etcd_down") == 1 and said.kinds().count("etcd_back") == 1, said
    assert "rejoined" in said.kinds()


@pytest.mark.parametrize("exits, code", [({0: 0, 1: 0}, 0), ({0: 1, 1: -9}, 1), ({}, 1)])
def test_an_agent_with_nothing_left_to_run_gives_up_on_an_etcd_that_is_gone(one_member, exits, code):
    """Workers finished (or failed, or none: a spare) and etcd silent past ``gone_after``: one
    line and an exit, not retries for ever. Workers still running keep the agent asking."""
    from tm_launch.launcher.etcd_retry import gone_after
    from tm_launch.launcher.session import EtcdGone

    plan = Plan(generation=0, nodes=("n1", "n2"), nproc=1)
    s = EtcdSession(
        one_member, "n1", lease_ttl=2.0, stall_limit=30.0, say=Said(), local_progress=lambda: (False, None),
        worker_exits=lambda: exits, followed=lambda: plan,
    )  # fmt: skip
    one_member.cluster.kill(0)
    s.note_etcd(False, KVError("connection refused"))
    s.etcd_down_at = time.time() - gone_after(2.0)  # silent for that long already
    with pytest.raises(EtcdGone, match="etcd unreachable for .* nothing left to run") as gone:
        s.members.plan()
    assert gone.value.code == code
    with pytest.raises(EtcdGone):  # the operator log's requests take the same policy
        s.members.operator_log.progress_of(["n2"])
    running = EtcdSession(
        one_member, "n1", lease_ttl=2.0, stall_limit=30.0, say=Said(), local_progress=lambda: (False, 0.1),
        worker_exits=lambda: {0: None}, followed=lambda: plan,
    )  # fmt: skip
    running.note_etcd(False, KVError("connection refused"))
    running.etcd_down_at = time.time() - 10 * gone_after(2.0)
    running.back_off(KVError("connection refused"), plan)  # workers still run: no EtcdGone, however long


def test_session_reports_make_the_loop_read_again(members):
    s = session_for(members, Said())
    assert members.publish(Plan(generation=0, nodes=("n1", "n2"), nproc=1), None)  # reports are per generation
    assert not s.take_reported()
    s.report_failure(0, "n2", "worker 0 exited with code 1", kind="exit")
    assert s.take_reported() and not s.take_reported()  # once per report
    assert members.snapshot().view.reports == {"n2": "worker 0 exited with code 1"}
    s.request_drain("n2", "degraded")
    s.cordon("n3", "fatal alarm")
    assert s.take_reported()
    view = members.snapshot().view
    assert view.drains == {"n2": "degraded"} and view.failed == {"n3": "fatal alarm"}


# ------------------------------------------------------------------------------------------------
# WorkerSupervisor: the agent store protocol (no worker processes needed)


@pytest.fixture
def supervisor(tmp_path):
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    cfg = AgentConfig(node_id="n2", addr="127.0.0.1", nproc=2, limits=Limits(1, 2, 2, 0), cmd=sleeper, run_id="r")
    sup = WorkerSupervisor(cfg, Said())
    yield sup
    sup.close()


def test_supervisor_directs_a_generation_through_the_store_and_each_workers_queue(supervisor):
    cause = "n2: script error: ValueError: bad at step 4"
    plan = Plan(
        generation=3,
        nodes=("n1", "n2"),
        nproc=2,
        store={"node": "n1", "addr": "127.0.0.1", "port": 1},
        joiners=("n2",),
        live=True,
        cause=cause,
    )
    supervisor.direct(plan)
    directive = Directive.from_json(supervisor.store.get(directive_key(3)))
    assert directive.ranks == (2, 3) and directive.joiner_ranks == (2, 3) and directive.active
    assert directive.cause == cause  # a repeat of it prints no second traceback
    assert supervisor.store.add(LATEST, 0) == 3
    supervisor.direct(plan.next(generation=2))  # an older generation never moves the latest back
    assert supervisor.store.add(LATEST, 0) == 3
    for lr in range(2):  # only the newer generation wakes the workers' watch threads
        assert supervisor.store.queue_len(WorkerKeys(lr).directives) == 1
        assert supervisor.store.queue_pop(WorkerKeys(lr).directives) == b"3"
    env = supervisor.env(plan, 1, sandbox=True)
    assert (env["RANK"], env["GROUP_RANK"], env["WORLD_SIZE"], env["TM_SANDBOX"]) == ("3", "1", "4", "1")
    assert env["TM_AGENT_STORE"] == f"127.0.0.1:{supervisor.store.port}"


def test_supervisor_reads_worker_reports(supervisor):
    assert supervisor.local_progress() == (False, None)  # no workers
    supervisor.store.set(WorkerKeys(0).status, WorkerStatus(state=WorkerState.FINISHED, step=9).to_json())  # a previous process's
    supervisor.start(Plan(generation=0, nodes=("n1",), nproc=2), sandbox=True, master=None)
    assert set(supervisor.workers.workers) == {0, 1} and supervisor.statuses() == {}
    supervisor.store.set(WorkerKeys(0).status, WorkerStatus(state=WorkerState.RUNNING, step=4).to_json())
    supervisor.store.set(WorkerKeys(1).status, "not json")
    supervisor.new_iteration()
    assert supervisor.statuses() == {0: WorkerStatus(state=WorkerState.RUNNING, step=4)}
    first = supervisor.statuses()[0]
    supervisor.new_iteration()
    assert supervisor.statuses()[0] is first  # the same report is parsed once
    recovering, stalled = supervisor.local_progress()
    assert not recovering and 0 <= stalled < 5
    supervisor.store.set(WorkerKeys(0).status, WorkerStatus(state=WorkerState.RECOVERING, step=4).to_json())
    assert not supervisor.recovering()  # read once per loop iteration
    supervisor.new_iteration()
    assert supervisor.recovering()
    assert not supervisor.note_live()
    supervisor.store.set(WorkerKeys(1).live, "1")
    assert supervisor.note_live() and not supervisor.note_live()  # said once
    assert supervisor.entered(5) is None and not supervisor.any_entered(5)
    supervisor.store.set(WorkerKeys(0).entered(5), EnteredRecord(communicator=0.1, state=0.2, received=False).to_json())
    assert supervisor.entered(5) is None and supervisor.any_entered(5)
    supervisor.store.set(WorkerKeys(1).entered(5), EnteredRecord(communicator=0.3, state=0.1, received=True).to_json())
    assert [r.communicator for r in supervisor.entered(5)] == [0.1, 0.3]


def test_no_live_workers_report_to_the_agent_but_never_go_live(tmp_path):
    """--no-live: workers get the agent store (they report steps) and TM_NO_LIVE, which keeps
    tm_launch.init() out of live mode; a worker saying it is live anyway is not believed."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    cfg = AgentConfig(node_id="n2", addr="127.0.0.1", nproc=1, limits=Limits(1, 2, 2, 0), cmd=sleeper, run_id="r", no_live=True)
    sup = WorkerSupervisor(cfg, Said())
    try:
        env = sup.env(Plan(generation=0, nodes=("n2",), nproc=1), 0, sandbox=False)
        assert env["TM_AGENT_STORE"] == f"127.0.0.1:{sup.store.port}" and env["TM_NO_LIVE"] == "1"
        sup.start(Plan(generation=0, nodes=("n2",), nproc=1), sandbox=False, master=None)
        sup.store.set(WorkerKeys(0).live, "1")
        assert not sup.note_live() and not sup.live_seen
    finally:
        sup.close()
    os.environ["TM_NO_LIVE"] = "1"  # inherited from an outer --no-live job: a live job drops it
    try:
        live = WorkerSupervisor(dataclasses.replace(cfg, no_live=False), Said())
        assert "TM_NO_LIVE" not in live.env(Plan(generation=0, nodes=("n2",), nproc=1), 0, sandbox=False)
        live.close()
    finally:
        del os.environ["TM_NO_LIVE"]


def test_hang_watchdog_watches_restart_mode_workers_once_they_reported_a_step(tmp_path):
    """No worker here said it is live. Worker 0 reported a step (restart mode) and stopped
    beating: killed. Worker 1 never reported a step (its script may not report): left alone,
    however silent. The loop running again before the killed worker is reaped (its exit notice
    wakes it) kills it no second time: each holds 1 GiB, which the kernel takes a while to free."""
    ready = tmp_path / "ready"
    sleeper = [
        sys.executable,
        "-c",
        f"import os, time\nheld = b'x' * 2**30\nopen('{ready}' + os.environ['LOCAL_RANK'], 'w')\ntime.sleep(60)",
    ]
    health = HealthConfig(hang_timeout=1, hang_warmup_steps=0)
    cfg = AgentConfig(node_id="n2", addr="127.0.0.1", nproc=2, limits=Limits(1, 2, 2, 0), cmd=sleeper, run_id="r", health=health)
    said = Said()
    sup = WorkerSupervisor(cfg, said)
    try:
        plan = Plan(generation=0, nodes=("n2",), nproc=2)
        sup.start(plan, sandbox=False, master=None)
        sup.store.set(
            WorkerKeys(0).status, WorkerStatus(state=WorkerState.RUNNING, step=5, mode="restart", step_times=[0.1], steps_run=4).to_json()
        )
        sup.store.set(WorkerKeys(1).status, WorkerStatus(state=WorkerState.STARTED, step=None).to_json())
        deadline = time.time() + 30
        while not all(os.path.exists(f"{ready}{lr}") for lr in (0, 1)):
            assert time.time() < deadline
            time.sleep(0.01)
        for lr in (0, 1):
            sup.store.set(WorkerKeys(lr).beat, f"{time.time() - 5:.3f}")
        sup.watch_hangs(plan)
        sup.watch_hangs(plan)
        assert said.kinds() == ["hang"] and "worker 0" in said[0][0]
        deadline = time.time() + 10
        while sup.workers.poll()[0] is None and time.time() < deadline:
            time.sleep(0.05)
        assert sup.workers.poll()[0] is not None and sup.workers.poll()[1] is None
    finally:
        sup.close()


def test_downtime_stamps_are_written_once_per_generation_after_every_first_step(members, supervisor):
    """One etcd write per node and generation, once every local worker completed a step in it
    (never on the way there, never per step); the publishing planner's stamps once; nothing for
    generation 0, a plan without this node, or a generation superseded twice."""
    stamps = DowntimeStamps("n2", session_for(members, Said()), supervisor)
    supervisor.start(Plan(generation=0, nodes=("n1", "n2"), nproc=2), sandbox=True, master=None)
    stamps.plan_seen(Plan(generation=0, nodes=("n1", "n2"), nproc=2, live=True), time.time())
    stamps.plan_seen(Plan(generation=1, nodes=("n1", "n3"), nproc=2, live=True), time.time())
    plan = Plan(generation=2, nodes=("n1", "n2"), nproc=2, live=True)
    seen = time.time()
    stamps.plan_seen(plan, seen)
    supervisor.direct(plan)
    stamps.plan_published(plan, seen - 0.01, View(plan=None, alive={}, report_times={"n3": seen - 0.2, "n1": seen - 0.1}))
    for lr, last in ((0, seen - 1.0), (1, None)):
        supervisor.store.set(
            WorkerKeys(lr).entered(2),
            EnteredRecord(began=seen + 0.1, communicator=0.1 * (lr + 1), state=0.05, last_step_at=last, received=False).to_json(),
        )
    supervisor.store.set(WorkerKeys(0).first_step(2), FirstStepRecord(time=seen + 0.5, step=7).to_json())
    stamps.write()
    assert members.operator_log.all_downtime_stamps() == {
        2: {"plan": {"planner": "n2", "published": seen - 0.01, "detected": seen - 0.2, "detected_by": "n3"}, "nodes": {}}
    }  # worker 1 has yet to complete a step
    supervisor.store.set(WorkerKeys(1).first_step(2), FirstStepRecord(time=seen + 0.6, step=7).to_json())
    stamps.write()
    revision = members.kv.current_revision()
    stamps.write()
    assert members.kv.current_revision() == revision  # written once
    record = members.operator_log.all_downtime_stamps()[2]["nodes"]["n2"]
    assert record["seen"] == seen and seen <= record["directed"] < seen + 5 and record["last_step"] == seen - 1.0
    assert (record["communicator"], record["entered"], record["first_step"]) == pytest.approx((seen + 0.3, seen + 0.35, seen + 0.6))
    for gen in (3, 4, 5):  # superseded before any step: only the newest two are still waited for
        stamps.plan_seen(Plan(generation=gen, nodes=("n1", "n2"), nproc=2, live=True), time.time())
    assert sorted(stamps.seen) == [4, 5]


# ------------------------------------------------------------------------------------------------
# FailureWatch: dead peers are reported at once


def test_a_peer_whose_agent_refuses_connections_is_reported_lost(members, supervisor, refusing_port):
    closed_port = refusing_port
    with socket.create_server(("127.0.0.1", 0)) as listening:
        alive_port = listening.getsockname()[1]
        dead, live = node("n1", closed_port), node("n3", alive_port)
        members.register(dead, ttl=10)
        members.register(live, ttl=10)
        said = Said()
        session = session_for(members, said)
        watch = FailureWatch(supervisor.cfg, session, supervisor, said)
        plan = Plan(generation=0, nodes=("n1", "n2", "n3"), nproc=2)
        assert members.publish(plan, None)
        before = members.snapshot().view
        assert watch.report_dead_peers(plan, before) == {"n3"}  # the peers whose agent answered
        assert watch.report_if_lost(plan, before, "n3")  # a broken link to a live peer: it answers
    assert said.kinds() == ["node_lost"] and session.take_reported()
    view = members.snapshot().view
    assert set(view.reports) == {"n1"} and view.report_kinds == {"n1": "lost"}
    assert "n1" not in view.alive and "n3" in view.alive  # unregistered: never promoted or waited for


def test_a_refusal_at_an_address_the_peer_no_longer_has_is_not_a_loss(members, supervisor, refusing_port):
    """A view's record can be older than the peer's registration (a new agent, a new port): the
    refusal of the old port is checked against the record read now."""
    closed_port = refusing_port
    with socket.create_server(("127.0.0.1", 0)) as listening:
        members.register(node("n1", listening.getsockname()[1]), ttl=10)
        said = Said()
        watch = FailureWatch(supervisor.cfg, session_for(members, said), supervisor, said)
        plan = Plan(generation=0, nodes=("n1", "n2"), nproc=2)
        assert members.publish(plan, None)
        old = View(plan=plan, alive={"n1": node("n1", closed_port)})
        watch.report_dead_peers(plan, old)
    assert said.kinds() == [] and members.snapshot().view.reports == {}


# ------------------------------------------------------------------------------------------------
# observers


def test_drain_wait_is_said_by_group_rank_0_only_while_no_spare_exists():
    said = Said()
    note = DrainWaitNote("n1", said)
    plan = Plan(generation=2, nodes=("n1", "n2"), nproc=1)
    alive = {n: node(n) for n in ("n1", "n2")}
    waiting = View(plan=plan, alive=alive, drains={"n2": "operator"})
    note.note(waiting)
    note.waiting = Every(first=0)  # due at once, instead of after the first 5 s
    note.note(waiting)
    assert said == [(said[0][0], "waiting")] and "drain of n2 waits for a spare" in said[0][0]
    note.note(View(plan=plan, alive={**alive, "n4": node("n4")}, drains={"n2": "operator"}))  # a spare came
    assert note.waiting is None
    DrainWaitNote("n2", said).note(waiting)  # not group rank 0: silent
    assert len(said) == 1


def test_metrics_feed_without_a_port_does_nothing(members):
    feed = MetricsFeed("n1", members)
    feed.serve("127.0.0.1", None, Said())
    plan = Plan(generation=1, nodes=("n1",), nproc=1)
    feed.on_event("plan", {})
    feed.on_statuses({})
    feed.on_state(View(plan=plan, alive={}), plan, 0)
    feed.on_generation(plan)
    feed.on_entered(plan)
    feed.stop()
    assert feed.metrics is None


def _run_to_exit(ws, code: str) -> None:
    """Start ``ws``'s one worker running ``code`` and wait for it to exit."""
    ws.cmd = [sys.executable, "-c", code]
    ws.start({0: dict(os.environ)}, generation=0, kind="fresh")
    deadline = time.time() + 30
    while ws.poll()[0] is None and time.time() < deadline:
        time.sleep(0.02)


def test_root_cause_from_stderr_is_this_workers_own_uncaught_exception(tmp_path):
    """Without an error file the failure line's root cause comes from the worker's stderr.log: only
    from what this worker wrote (a reused attempt directory appends to an earlier worker's log),
    and only for an exit code (a worker killed by a signal printed no traceback of its death)."""
    from tm_launch.launcher.processes import OutputSpec, WorkerSet

    ws = WorkerSet([], OutputSpec(log_dir=str(tmp_path), redirects={0: 2}), "r", str(tmp_path))
    _run_to_exit(ws, "def f():\n    raise KeyError('boom')\nf()")
    assert ws.failure_report([0])[1] == "KeyError: 'boom' (at <string>:2)"
    ws.stop()
    _run_to_exit(ws, "import sys; sys.exit(3)")  # the same attempt (restart count), so the same stderr.log
    block, line = ws.failure_report([0])
    assert "exitcode  : 3" in block and line == "", line
    ws.stop()
    _run_to_exit(
        ws,
        "import os, signal, traceback\ntry:\n    1/0\nexcept ZeroDivisionError:\n    traceback.print_exc()\n"
        "os.kill(os.getpid(), signal.SIGKILL)",
    )
    block, line = ws.failure_report([0])
    assert "SIGKILL" in block and line == "", line
    ws.stop()
    [log] = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files if f == "stderr.log"]
    assert open(log).read().count("Traceback") == 2  # all three wrote to one file


@pytest.mark.parametrize("mode", ["live", "restart"])
def test_a_worker_killed_while_training_is_reported_as_its_exit_begins(members, tmp_path, mode):
    """A worker started through live mode's wrapper is SIGKILLed while it trains. In a live
    loop the failure is reported from its exit notice, before the kernel has freed its memory,
    and the exit status follows in the log once the worker is reaped; a loop of its own that
    reports steps (``mode`` restart) is reported from its exit status, as before."""
    ready = tmp_path / "ready"
    script = tmp_path / "worker.py"
    # 1 GiB written (resident): the kernel takes ~80 ms per GiB to free it, the test's window
    script.write_text(f"import time\nheld = b'x' * 2**30\nopen({str(ready)!r}, 'w').close()\ntime.sleep(120)\n")
    cmd = [sys.executable, "-u", "-m", "tm_launch.worker", str(script)]
    cfg = AgentConfig(node_id="n1", addr="127.0.0.1", nproc=1, limits=Limits(1, 2, 1, 0), cmd=cmd, run_id="r")
    said = Said()
    sup = WorkerSupervisor(cfg, said)
    try:
        members.register(node("n1"), ttl=10)
        plan = Plan(generation=0, nodes=("n1",), nproc=1)
        assert members.publish(plan, None)
        watch = FailureWatch(cfg, session_for(members, said), sup, said)
        sup.start(plan, sandbox=False, master=None)
        deadline = time.time() + 60
        while not ready.exists():
            assert time.time() < deadline
            time.sleep(0.01)
        sup.store.set(WorkerKeys(0).status, WorkerStatus(state=WorkerState.RUNNING, step=5, mode=mode).to_json())
        worker = sup.workers.workers[0]
        os.kill(worker.pid, 9)
        while worker.notice.began_at is None:
            assert time.time() < deadline
            time.sleep(0.001)
        watch.watch_workers(plan, members.snapshot().view)
        while "n1" not in members.snapshot().view.reports:  # restart: once waitid has the status
            assert time.time() < deadline
            time.sleep(0.01)
            watch.watch_workers(plan, members.snapshot().view)
        report = members.snapshot().view.reports["n1"]
        assert said.kinds()[:1] == ["worker_failed"]
        if mode == "live":
            assert report.startswith(f"worker 0 (pid {worker.pid}) killed (its exit began"), report
            assert any("killed by SIGKILL" in message and "after its exit began" in message for message, _ in said), said
        else:
            assert report == f"worker 0 (pid {worker.pid}) killed by SIGKILL", report
    finally:
        sup.close()
