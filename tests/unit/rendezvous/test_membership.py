"""The etcd membership layout against a real etcd (v2 and v3 APIs through ``kv_factory``).

Registration, snapshots, compare-and-swap publishing (exactly one plan per generation, also
between competing processes), consistency after a publisher is SIGKILLed mid-publish, garbage
values under the run's keys, and run-id isolation.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import random
import select
import signal
import subprocess
import sys
import threading
import time

import pytest

from rendezvous.membership import Membership
from rendezvous.plan import NodeInfo, Plan
from rendezvous.planner import Limits, next_plan

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))  # the repository root


def info(node: str, joined: float = 0.0) -> NodeInfo:
    return NodeInfo(id=node, host="localhost", addr="127.0.0.1", store_port=29500, nproc=1, pid=os.getpid(), joined=joined or time.time())


def history(kv) -> dict[int, str]:
    """Raw ``log/history/<gen>`` entries: generation -> plan JSON (every one must parse)."""
    out = {}
    for e in kv.get_prefix("log/history/"):
        gen = int(e.key.rsplit("/", 1)[-1])
        assert Plan.from_json(e.value).generation == gen, e
        out[gen] = e.value
    return out


# ------------------------------------------------------------------------------------------------
# registration and snapshots


def test_register_twice_with_the_same_node_id_fails(kv_factory):
    m = Membership(kv_factory("job"))
    other = Membership(kv_factory("job"))  # a second agent, its own connection
    first = m.register(info("n1"), ttl=10)
    with pytest.raises(ValueError, match="node id 'n1' is already registered"):
        other.register(info("n1"), ttl=10)
    # the first registration is untouched, and the name is free again once it leaves
    assert set(other.snapshot().view.alive) == {"n1"}
    assert other.snapshot().view.alive["n1"].pid == os.getpid()
    first.revoke()
    assert other.snapshot().view.alive == {}
    other.register(info("n1"), ttl=10).revoke()


def test_registering_again_replaces_only_this_agents_own_record(kv_factory):
    """A running agent whose lease was lost registers again (``again``): its own record, still
    there (a TTL not quite run out, or an attempt whose answer was lost), is replaced; another
    agent's record under the same id (another process) is not."""
    m = Membership(kv_factory("job"))
    mine = info("n1", joined=5.0)
    old = m.register(mine, ttl=10)
    new = m.register(mine, ttl=10, again=True)
    assert m.snapshot().view.alive["n1"] == mine
    old.revoke()  # the old lease no longer holds the record: the new one does
    assert m.snapshot().view.alive["n1"] == mine
    with pytest.raises(ValueError, match="already registered"):
        m.register(info("n1", joined=6.0), ttl=10, again=True)  # another agent's, not ours
    new.revoke()
    assert m.snapshot().view.alive == {}


def test_snapshot_parses_roles(kv_factory):
    m = Membership(kv_factory("job"))
    t0 = time.time()
    leases = [m.register(info(n, t0 + i), ttl=10) for i, n in enumerate("abcd")]
    p0 = Plan(generation=0, nodes=("a", "b"), nproc=1, store={"node": "a", "addr": "127.0.0.1", "port": 1})
    assert m.publish(p0, None)
    m.cordon("d", "xid 79")
    m.request_drain("b", "straggler")
    m.report_failure(0, "a", "worker 0 exited with code 1")
    m.report_failure(5, "b", "a report for another generation")
    m.mark_done(0, "b")
    m.mark_done(3, "a")
    snap = m.snapshot()
    v = snap.view
    assert v.plan == p0 and Plan.from_json(snap.plan_entry.value) == p0
    assert snap.revision >= snap.plan_entry.revision
    assert set(v.alive) == set("abcd") and v.alive["c"] == info("c", t0 + 2)
    assert v.failed == {"d": "xid 79"}
    assert v.drains == {"b": "straggler"}
    assert v.reports == {"a": "worker 0 exited with code 1"}  # only this generation's
    assert v.done == frozenset({"b"})
    assert v.live is False
    assert snap.spares_alive == 1  # c (d is cordoned)
    m.set_live()
    m.set_live()  # idempotent
    assert m.snapshot().view.live is True
    # the planner on this snapshot: c takes a's group rank, the reporter leaves
    nxt = next_plan(m.snapshot().view, Limits(min_nodes=2, max_nodes=2, nproc=1, max_restarts=3))
    assert nxt.nodes == ("c", "b") and nxt.replaced == {"c": "a"} and nxt.live
    # a warm spare is promoted before one that joined earlier (its marker goes with its lease)
    e = m.register(info("e", t0 + 4), ttl=10)
    m.mark_warm("e", e)
    assert m.snapshot().view.warm == frozenset({"e"})
    assert next_plan(m.snapshot().view, Limits(min_nodes=2, max_nodes=2, nproc=1, max_restarts=3)).replaced == {"e": "a"}
    e.revoke()
    assert m.snapshot().view.warm == frozenset()
    m.mark_warm("c", leases[2])
    m.unmark_warm("c")
    m.unmark_warm("c")  # no marker: nothing to do
    assert m.snapshot().view.warm == frozenset()
    m.uncordon("d")
    m.uncordon("b")  # `ctl uncordon` also takes back a drain request
    m.leave("c")
    snap = m.snapshot()
    assert set(snap.view.alive) == set("abd") and snap.view.failed == {} and snap.view.drains == {}
    for lease in leases:
        lease.revoke()
    assert m.snapshot().view.alive == {}


# ------------------------------------------------------------------------------------------------
# exactly one plan per generation


def test_competing_threads_exactly_one_plan_per_generation(kv_factory):
    writers = 4
    members = [Membership(kv_factory("job")) for _ in range(writers)]
    base = Plan(generation=0, nodes=("a",), nproc=1)
    assert members[0].publish(base, None)
    assert not members[1].publish(Plan(generation=0, nodes=("b",), nproc=1), None)  # create-if-absent
    for _round in range(4):
        barrier = threading.Barrier(writers)
        snaps = [m.snapshot() for m in members]
        gen = snaps[0].view.plan.generation + 1
        results = [None] * writers

        def publish(i):
            plan = snaps[i].view.plan.next(cause=f"writer {i}", nodes=(f"w{i}",))
            barrier.wait()
            results[i] = members[i].publish(plan, snaps[i].plan_entry)

        threads = [threading.Thread(target=publish, args=(i,)) for i in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert results.count(True) == 1, results
        winner = results.index(True)
        # every loser re-reads and sees the winner's plan; its stale CAS can never land later
        for i, m in enumerate(members):
            snap = m.snapshot()
            assert snap.view.plan.generation == gen and snap.view.plan.cause == f"writer {winner}"
            if i != winner:
                assert not m.publish(snaps[i].view.plan.next(cause="stale"), snaps[i].plan_entry)
        assert Plan.from_json(history(members[0].kv)[gen]).cause == f"writer {winner}"
    assert sorted(history(members[0].kv)) == list(range(5))


PUBLISHER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from rendezvous.kv import EtcdOptions, connect
from rendezvous.membership import Membership
from rendezvous.plan import Plan

api, endpoint, prefix, name, attempts, start_at = sys.argv[2:8]
kv = connect(api, EtcdOptions(endpoints=(endpoint,), prefix=prefix))
m = Membership(kv)
while time.time() < float(start_at):
    time.sleep(0.001)
n, attempts = 0, int(attempts)
while attempts <= 0 or n < attempts:  # attempts <= 0: publish forever (until killed)
    n += 1
    e = kv.get("state/plan")
    p = Plan.from_json(e.value) if e else None
    new = p.next(cause=name, nodes=(name,)) if p else Plan(generation=0, nodes=(name,), nproc=1, cause=name)
    if m.publish(new, e):
        print(new.generation, flush=True)
print("end", flush=True)
"""


def start_publisher(kv, endpoint, api, name, attempts, start_at=0.0):
    return subprocess.Popen(
        [sys.executable, "-c", PUBLISHER, ROOT, api, endpoint, kv.options.prefix, name, str(attempts), str(start_at)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_competing_processes_exactly_one_plan_per_generation(kv_factory, etcd_endpoint):
    """Three processes publish as fast as they can for 25 attempts each: every generation has
    exactly one winner, and the history holds exactly that winner's plan."""
    kv = kv_factory("job")
    start_at = time.time() + 1.0  # all three are connected and spinning by then
    procs = {name: start_publisher(kv, etcd_endpoint, kv_factory.api, name, 25, start_at) for name in ("p0", "p1", "p2")}
    wins: dict[int, list[str]] = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        lines = out.split()
        assert lines[-1] == "end"
        for gen in lines[:-1]:
            wins.setdefault(int(gen), []).append(name)
    current = Plan.from_json(kv.get("state/plan").value)
    assert sorted(wins) == list(range(current.generation + 1))
    assert all(len(w) == 1 for w in wins.values()), {g: w for g, w in wins.items() if len(w) > 1}
    hist = history(kv)
    assert sorted(hist) == sorted(wins)
    assert all(Plan.from_json(hist[g]).cause == w[0] for g, w in wins.items())
    assert len({w[0] for w in wins.values()}) > 1, "no contention happened: the test proves nothing"


# ------------------------------------------------------------------------------------------------
# a publisher killed in the middle of publishing


def check_consistent(kv, may_miss: set[int]) -> tuple[Plan, set[int]]:
    """state/plan parses; every history entry parses, none is ahead of state/plan, and the only
    generations missing from the history are the one being written (the current one) or ones in
    ``may_miss``. Returns the plan and the missing generations."""
    entry = kv.get("state/plan")
    assert entry is not None
    plan = Plan.from_json(entry.value)
    hist = history(kv)
    assert max(hist) <= plan.generation, (plan.generation, sorted(hist))
    missing = set(range(plan.generation + 1)) - set(hist)
    assert missing <= may_miss | {plan.generation}, (plan.generation, sorted(missing))
    if plan.generation in hist:
        assert hist[plan.generation] == entry.value
    return plan, missing


def _read_line(proc, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"publisher printed nothing in {timeout}s"
    return proc.stdout.readline()


def test_publisher_killed_mid_publish_leaves_etcd_consistent(kv_factory, etcd_endpoint):
    """A process publishing plan after plan is SIGKILLed at random moments, five times over the
    same job: state/plan always parses, history lags it by at most the generation being
    written, and a fresh publisher always continues from what the victim left."""
    kv = kv_factory("job")
    m = Membership(kv)
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    killed_at, torn = [], set()  # torn: generations whose history entry a kill prevented
    for _ in range(5):
        proc = start_publisher(kv, etcd_endpoint, kv_factory.api, "victim", 0)
        try:
            assert _read_line(proc, 30).strip().isdigit()  # it is publishing
            time.sleep(rng.uniform(0.0, 0.1))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        assert proc.returncode == -signal.SIGKILL
        plan, missing = check_consistent(kv, torn)
        torn |= missing
        killed_at.append(plan.generation)
        # a fresh publisher continues from whatever the victim left
        snap = m.snapshot()
        assert snap.view.plan == plan
        assert m.publish(plan.next(cause="fresh"), snap.plan_entry), f"seed {seed}"
        after, _ = check_consistent(kv, torn)
        assert after.generation == plan.generation + 1 and after.cause == "fresh", f"seed {seed}"
        assert after.generation in history(kv)
    assert killed_at == sorted(killed_at) and killed_at[-1] > killed_at[0]


class _DiesAfterCAS:
    """A KV whose process 'dies' right after the plan's CAS, before the history write."""

    def __init__(self, kv):
        self._kv = kv

    def __getattr__(self, name):
        return getattr(self._kv, name)

    def put(self, key, value, lease=None):
        if key.startswith("log/history/"):
            raise SystemExit("killed between the CAS and the history write")
        return self._kv.put(key, value, lease)


def test_history_hole_is_repaired_by_the_next_publisher(kv_factory):
    kv = kv_factory("job")
    m = Membership(kv)
    assert m.publish(Plan(generation=0, nodes=("a",), nproc=1), None)
    snap = m.snapshot()
    with pytest.raises(SystemExit):
        Membership(_DiesAfterCAS(kv)).publish(snap.view.plan.next(cause="victim"), snap.plan_entry)
    plan, _ = check_consistent(kv, set())  # lag of one: allowed
    assert plan.generation == 1 and sorted(history(kv)) == [0]
    snap = m.snapshot()
    assert m.publish(snap.view.plan.next(cause="fresh"), snap.plan_entry)
    assert sorted(history(kv)) == [0, 1, 2]


# ------------------------------------------------------------------------------------------------
# garbage under the run's keys

GARBAGE = {
    "state/nodes/g1": "not json at all",
    "state/nodes/g2": '{"id": "g2"}',
    "state/nodes/g3": "[1, 2, 3]",
    "state/nodes/g4": "null",
    "state/nodes/g5": json.dumps({**json.loads(info("g5", 1.0).to_json()), "unexpected": 1}),
    "state/nodes/g6": "\u2603 snow \x01\x02 ctrl",
    "state/nodes/big": "x" * (256 * 1024),
    "state/failed/f1": "[]",
    "state/failed/f2": "nope",
    "state/failed/f3": "7",
    "state/drain/d1": "null",
    "state/drain/d2": '"just text"',
    "state/warm/w1": "warm",
    "state/warm/w2": "[1]",
    "state/warm/w3/deeper": "{}",
    "state/reports/0/r1": "{}",
    "state/reports/0/r2": '"a string"',
    "state/reports/0/r3": "[1]",
    "state/reports/zzz/r4": "{",
    "state/reports/0/deeper/r5": "{}",
    "state/unknown/a/b/c": "?",
    "state/big": "{" * (256 * 1024),
    "log/history/00000007": "garbage history",
    "log/events/0001-x": "{not json",
    "log/alarms/x/y": "[",
    "log/progress/x": "]",
    "log/breakdown/00000001/plan": "[1]",
    "log/breakdown/00000001/nodes/b/c": "{}",
    "log/breakdown/junk/plan": "{}",
    "log/breakdown/00000001/other": "{}",
}


def test_garbage_values_are_ignored(kv_factory):
    kv = kv_factory("job")
    m = Membership(kv)
    lease = m.register(info("a", 1.0), ttl=10)
    p0 = Plan(generation=0, nodes=("a",), nproc=1)
    assert m.publish(p0, None)
    m.cordon("c", "xid 48")
    m.report_failure(0, "a", "worker 0 exited")
    for key, value in GARBAGE.items():
        kv.put(key, value)
    snap = m.snapshot()
    v = snap.view
    assert v.plan == p0
    assert set(v.alive) == {"a"}
    assert v.failed == {"c": "xid 48"}
    assert v.drains == {}
    assert v.reports == {"a": "worker 0 exited"}
    assert v.warm == frozenset()
    # the planner runs on it without trouble, and the operator views skip garbage too
    next_plan(v, Limits(min_nodes=1, max_nodes=1, nproc=1, max_restarts=3))
    oplog = m.operator_log
    assert oplog.events() == [] and oplog.alarms() == [] and oplog.all_progress() == {} and oplog.progress_of(["x", "nobody"]) == {}
    oplog.progress("a", {"node": "a", "workers": {"0": {"state": "sandbox"}}, "time": 1.0}, lease)
    assert oplog.progress_of(["a", "x"]) == {"a": {"node": "a", "workers": {"0": {"state": "sandbox"}}, "time": 1.0}}
    assert [p.generation for p in oplog.history()] == [0]
    assert oplog.all_downtime_stamps() == {}
    oplog.downtime_stamps(1, None, {"published": 2.0})
    oplog.downtime_stamps(1, "a", {"seen": 3.0})
    assert oplog.all_downtime_stamps() == {1: {"plan": {"published": 2.0}, "nodes": {"a": {"seen": 3.0}}}}
    lease.revoke()


@pytest.mark.parametrize("value", ["garbage", "{}", '{"generation": "x", "nodes": 5, "nproc": 1}'])
def test_garbage_plan_does_not_crash_snapshot(kv_factory, value):
    from rendezvous.kv import KVError

    kv = kv_factory("job")
    kv.put("state/plan", value)
    try:
        Membership(kv).snapshot()
    except KVError:
        pass  # a clear, catchable error is acceptable too


def test_wrongly_typed_node_record_is_ignored(kv_factory):
    kv = kv_factory("job")
    m = Membership(kv)
    lease = m.register(info("a", 1.0), ttl=10)
    kv.put("state/nodes/bad", json.dumps({**json.loads(info("bad").to_json()), "joined": "yesterday", "store_port": "x"}))
    view = m.snapshot().view
    try:
        assert set(view.alive) == {"a"}
        next_plan(view, Limits(min_nodes=1, max_nodes=1, nproc=1, max_restarts=0))
    finally:
        lease.revoke()


# ------------------------------------------------------------------------------------------------
# followers: a new plan from its delta alone (Membership.refresh), and every way back to a whole read

LIMITS = Limits(min_nodes=4, max_nodes=4, nproc=1, max_restarts=9)


def following_job(kv_factory, spares: int = 2):
    """Live job of a, b, c, d (planners a, b, c: their markers written) plus spares s0, s1...;
    ``d`` is the node that only follows. Returns (membership, leases, d's whole snapshot)."""
    m = Membership(kv_factory("job"))
    t0 = time.time()
    leases = {n: m.register(info(n, t0 + i), ttl=30) for i, n in enumerate([*"abcd", *(f"s{i}" for i in range(spares))])}
    m.set_live()
    first = next_plan(m.snapshot().view, LIMITS)
    assert first.nodes == tuple("abcd") and m.publish(first, None)
    snap = m.snapshot()
    for node in snap.planners:
        m.mark_planner(node, leases[node], snap.planners)
    held = m.refresh(None, "d")
    assert not held.partial and held.view.plan == first and held.planners == tuple("abc")
    return m, leases, held


def lose(m: Membership, node: str, records: bool = True) -> Plan:
    """``node``'s report, and the plan a planner makes of it (published with its delta, which
    carries the records the planner read unless ``records`` is False)."""
    m.report_failure(m.snapshot().view.plan.generation, node, "worker 0 exited", kind="signal")
    snap = m.snapshot()
    plan = next_plan(snap.view, LIMITS)
    assert m.publish(plan, snap.plan_entry, snap.view.alive if records else None)
    return plan


def keys_read(kv) -> list[str]:
    """From now on, the keys ``kv.get`` and ``kv.get_many`` are asked for (a request of
    ``get_many`` as one tuple)."""
    asked, get, get_many = [], kv.get, kv.get_many
    kv.get = lambda key: asked.append(key) or get(key)
    kv.get_many = lambda keys: asked.append(tuple(keys)) or get_many(asked[-1])
    return asked


def test_a_follower_learns_a_new_plan_from_the_delta_alone(kv_factory):
    m, leases, held = following_job(kv_factory)
    assert m.refresh(held, "d").view.plan == held.view.plan  # nothing new: the plan stands
    gen1 = lose(m, "b")
    assert gen1.nodes == ("a", "s0", "c", "d") and gen1.joiners == ("s0",)
    kv = m.kv
    before, asked = getattr(kv, "received", 0), keys_read(kv)
    snap = m.refresh(held, "d")
    assert snap.view.plan == gen1 and snap.view.live
    assert snap.view.alive["s0"] == info("s0", held.view.alive["s0"].joined)  # the joiner's record
    assert snap.view.reports == {}
    if kv.transactions:
        assert snap.partial and snap.plan_entry is None and snap.planners == tuple("abc")
        assert asked == []  # the feed comes from the copy its stream keeps; the record from the delta
        assert "b" not in snap.view.alive  # removed: leaving the job
        assert kv.received - before < 3000  # the whole state is ~3x that already at 6 nodes
        with PlanWatch(m, "d") as watch:
            assert watch.woken(0.3) is False
            m.report_failure(1, "c", "not the followers' business")
            assert watch.woken(0.3) is False  # followers sleep through joins, losses, reports,
            m.unmark_planner("b")
            m.mark_planner("c", leases["c"], ("a", "c", "s1"))
            assert watch.woken(0.3) is False  # a planner's death and its successor's naming,
            m.mark_planner("c", leases["c"], ("a", "c", "d"))
            assert watch.woken(5) is True  # ... but not through being named a planner
            whole(m, m.refresh(snap, "d"), "d is named")
            m.unmark_planner("a")
            m.unmark_planner("c")
            assert watch.woken(5) is True  # ... nor through no planner being left
    else:
        assert not snap.partial  # v2: no delta is ever written, every read is whole
    for lease in leases.values():
        lease.revoke()


def test_a_record_the_delta_lacks_is_read_only_when_the_follower_connects_to_that_node(kv_factory):
    m, leases, held = following_job(kv_factory, spares=3)
    if not m.kv.transactions:
        return  # v2 writes no delta (the test above)
    asked = keys_read(m.kv)
    gen1 = lose(m, "b", records=False)  # a planner that passed no records
    at1 = m.refresh(held, "d")
    assert at1.partial and at1.view.plan == gen1 and asked == [] and "s0" not in at1.view.alive
    assert m.with_records(at1, ["a", "c"]) is at1 and asked == []  # records held: nothing read
    at1 = m.with_records(at1, ["s0", "a"])  # d's agent connects to s0: its record, one key
    assert asked == [("state/nodes/s0",)] and at1.view.alive["s0"] == held.view.alive["s0"]
    del asked[:]
    gen2 = lose(m, "c")
    at2 = m.refresh(at1, "d")
    assert at2.partial and at2.view.plan == gen2 and asked == []
    assert at2.view.alive["s1"] == held.view.alive["s1"] and "c" not in at2.view.alive
    assert m.with_records(held, ["gone"]) is held and asked == []  # a whole view lacks only the dead
    for lease in leases.values():
        lease.revoke()


def test_a_node_that_joins_after_the_planners_takes_generation_0_from_its_delta(kv_factory):
    """While generation 0 forms, a node that joins after a full set of planners reads no node's
    record: not at its first read, not when the first plan lands. It reads the records of the
    peers it connects to, and counts the joined nodes for its waiting line."""
    m = Membership(kv_factory("formation"))
    t0 = time.time()
    leases = {n: m.register(info(n, t0 + i), ttl=30) for i, n in enumerate("ab")}
    early = m.snapshot()
    for node in early.planners:
        m.mark_planner(node, leases[node], early.planners)
    leases["c"] = m.register(info("c", t0 + 2), ttl=30)
    assert not m.refresh(None, "c").partial  # two planners named so far: c may be the third
    planners = m.snapshot().planners
    assert planners == tuple("abc")
    for node in planners:
        m.mark_planner(node, leases[node], planners)
    for i, node in enumerate("defg"):
        leases[node] = m.register(info(node, t0 + 3 + i), ttl=30)
    assert m.joined() == 7
    kv = m.kv
    asked, spent = keys_read(kv), []

    def as_e(read, *args):  # what etcd sends e's own reads (kv.received: v3 counts it)
        before = getattr(kv, "received", 0)
        out = read(*args)
        spent.append(getattr(kv, "received", 0) - before)
        return out

    joined = as_e(m.refresh, None, "e")
    if not kv.transactions:
        assert not joined.partial  # v2: no feed, every read is whole
        return
    assert joined.partial and joined.view.plan is None and joined.view.alive == {} and joined.planners == planners
    assert not m.refresh(None, "a").partial  # a planner reads everything
    assert m.refresh(joined, "e").view.plan is None  # nothing published yet: it waits
    snap = m.snapshot()
    first = next_plan(snap.view, Limits(min_nodes=6, max_nodes=6, nproc=1, max_restarts=0))
    assert first.nodes == tuple("abcdef") and m.publish(first, None, snap.view.alive, spares=1)  # g
    at0 = as_e(m.refresh, joined, "e")
    assert at0.partial and at0.view.plan == first and at0.view.alive == {}
    assert at0.spares_alive == 1  # as the publisher counted them: e reads no record
    assert asked == ["state/live"]  # the job may be live: read until seen
    at0 = as_e(m.with_records, at0, ["f", "a"])  # e's successor f, and a at distance 2
    assert asked == ["state/live", ("state/nodes/f", "state/nodes/a")] and set(at0.view.alive) == {"a", "f"}
    whole_read = as_e(m.refresh, None, "e") and spent.pop()
    assert sum(spent) < whole_read, (spent, whole_read)  # all of e's reads, less than one whole read
    assert not m.refresh(None, "f").partial  # the plan is out: a node joining now reads it whole
    for lease in leases.values():
        lease.revoke()


def whole(m: Membership, snap, why):
    assert not snap.partial, why
    assert snap.view.plan == m.snapshot().view.plan, why
    return snap


class PlanWatch:
    """A follower's plan watch (``Membership.watch_plan``) read in a thread, as the agent's is."""

    def __init__(self, m: Membership, node: str):
        self.news: queue.Queue = queue.Queue()
        self.stream = m.watch_plan(node)
        threading.Thread(target=lambda: [self.news.put(n) for n in self.stream], daemon=True).start()

    def __enter__(self) -> PlanWatch:
        assert self.news.get(timeout=10).kind == "created"
        return self

    def __exit__(self, *exc) -> None:
        pass  # the stream's thread ends with the test's etcd

    def woken(self, timeout: float) -> bool:
        try:
            self.news.get(timeout=timeout)
        except queue.Empty:
            return False
        while not self.news.empty():
            self.news.get()
        return True


def test_a_follower_reads_the_whole_state_whenever_the_delta_cannot_tell(kv_factory, caplog):
    m, leases, held = following_job(kv_factory, spares=3)
    kv = m.kv
    if not kv.transactions:
        assert kv.get("state/plan-feed/delta") is None
        lose(m, "b")
        assert not m.refresh(held, "d").partial
        return

    no_plan = dataclasses.replace(held, view=dataclasses.replace(held.view, plan=None))
    assert m.refresh(no_plan, "d").view.plan == held.view.plan  # generation 0's delta applies to no plan
    whole(m, m.refresh(held, "a"), "a planner reads everything")
    gen1 = lose(m, "b")
    whole(m, m.refresh(no_plan, "d"), "no plan held, and the delta is for 0 -> 1")
    gen2 = lose(m, "c")
    whole(m, m.refresh(held, "d"), "generation 1 was missed: the delta is for 1 -> 2")
    at1 = dataclasses.replace(held, view=dataclasses.replace(held.view, plan=gen1))
    assert m.refresh(at1, "d").view.plan == gen2 and m.refresh(at1, "d").partial
    wrong = dataclasses.replace(held, view=dataclasses.replace(held.view, plan=dataclasses.replace(gen1, nodes=("a", "c", "s0", "d"))))
    whole(m, m.refresh(wrong, "d"), "the held plan is not the published generation 1: the digest differs")
    m.mark_planner("c", leases["c"], ("a", "c", "d"))
    whole(m, m.refresh(at1, "d"), "a marker names d a planner")
    m.unmark_planner("c")
    for node in "ab":
        m.unmark_planner(node)
    whole(m, m.refresh(at1, "d"), "no planner left: someone must take over")
    m.mark_planner("a", leases["a"], tuple("abc"))
    assert m.refresh(at1, "d").partial
    # A plan that makes d group rank 0 (it reports waiting drains): the whole state.
    gen3 = dataclasses.replace(gen2.next(nodes=("d", *[n for n in gen2.nodes if n != "d"])), joiners=())
    assert m.publish(gen3, m.snapshot().plan_entry)
    at2 = dataclasses.replace(held, view=dataclasses.replace(held.view, plan=gen2))
    whole(m, m.refresh(at2, "d"), "d is group rank 0 now")
    # Garbage in the feed: named once, never fatal, the whole state read instead.
    with caplog.at_level(logging.WARNING, logger="rendezvous.json_values"):
        for garbage in ("garbage {", "[" * 100_000 + "]" * 100_000, json.dumps({"previous": 2}), "{}"):
            kv.put("state/plan-feed/delta", garbage)
            whole(m, m.refresh(at2, "d"), garbage[:20])
        kv.put("state/plan-feed/planners/a", "nope")
        kv.put("state/plan-feed/planners/x/y", json.dumps({"planners": ["d"]}))
        kv.put("state/plan-feed/planners/z", json.dumps({"planners": [1]}))
        whole(m, m.refresh(at2, "d"), "only unreadable markers: no planner known")
    named = [r.getMessage() for r in caplog.records]
    for key in ("state/plan-feed/delta", "state/plan-feed/planners/a", "state/plan-feed/planners/x/y", "state/plan-feed/planners/z"):
        assert sum(key in line for line in named) == 1, (key, named)
    for lease in leases.values():
        lease.revoke()


# ------------------------------------------------------------------------------------------------
# run-id isolation


def test_run_id_isolation(kv_factory):
    """Runs 'job', 'job2' and 'jo' share a parent prefix; none sees or wakes up the others."""
    a, b, c = (Membership(kv_factory(run)) for run in ("job", "job2", "jo"))
    la = a.register(info("node-a"), ttl=10)
    lb = b.register(info("node-b"), ttl=10)
    assert a.publish(Plan(generation=0, nodes=("node-a",), nproc=1), None)
    b.cordon("node-a", "b's business")
    b.request_drain("node-a", "b's business")
    b.report_failure(0, "node-a", "b's business")
    b.mark_done(0, "node-a")
    b.set_live()
    va, vb, vc = (m.snapshot().view for m in (a, b, c))
    assert set(va.alive) == {"node-a"} and set(vb.alive) == {"node-b"} and vc.alive == {}
    assert va.plan.nodes == ("node-a",) and vb.plan is None and vc.plan is None
    assert va.failed == va.drains == va.reports == {} and va.done == frozenset() and not va.live
    # the same node id may exist in two runs
    lb2 = b.register(info("node-a"), ttl=10)
    assert set(b.snapshot().view.alive) == {"node-a", "node-b"} and set(a.snapshot().view.alive) == {"node-a"}
    # b publishing its own generation 0 neither fails on a's plan nor touches it
    assert b.publish(Plan(generation=0, nodes=("node-b",), nproc=1), None)
    assert a.snapshot().view.plan.nodes == ("node-a",)
    # a's watch is not woken by b's writes
    rev = a.snapshot().revision
    writer = threading.Thread(target=lambda: [b.mark_done(0, f"x{i}") for i in range(5)])
    writer.start()
    assert a.wait(rev, 0.5) is False
    writer.join()
    a.mark_done(0, "node-a")
    assert a.wait(rev, 5) is True
    for lease in (la, lb, lb2):
        lease.revoke()
