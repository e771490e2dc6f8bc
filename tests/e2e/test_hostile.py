"""Hostile rendezvous contents: garbage and oversized values under a run's keys.

etcd content is input. Anyone with write access to the run's prefix (a buggy tool, an operator's
typo, a hostile process) can put anything there. For every key kind tm-launch reads, a table of
garbage goes in: not JSON, JSON of the wrong type, huge numbers, NaN, nesting deep enough to
overflow the JSON parser's stack, ~1 MiB values, keys of unexpected shapes. What must hold:

* the decoding (``Membership.snapshot`` and the operator views, over a real etcd) ignores each
  bad value, names the key once, and sees exactly the job it would see without them;
* a running job (real agents, real workers) goes on and finishes every step exactly once,
  in its first generation (no phantom failover, no early "finished"), with no traceback;
* an unreadable ``state/plan`` makes every agent stop changing the job and say one line that
  names the key and how to fix it; restoring the plan lets the job finish;
* ``tm-launch ctl status`` / ``events`` keep working and say what they skipped.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import uuid

import pytest

from rendezvous.kv import EtcdOptions, KVError, connect
from rendezvous.membership import Membership, run_prefix
from rendezvous.plan import NodeInfo, Plan
from rendezvous.planner import Limits, next_plan

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))  # the repository root
MIB = "x" * (1 << 20)
DEEP = "[" * 100_000 + "]" * 100_000  # json.loads -> RecursionError, not ValueError
HUGE_INT = "9" * 5000  # beyond Python's int-from-string limit


def node_json(node: str, **changes) -> str:
    info = json.loads(NodeInfo(id=node, host="h", addr="127.0.0.1", store_port=1234, nproc=1, pid=1, joined=1.0).to_json())
    info.update(changes)
    return json.dumps(info)


# key -> value, every one of which must be ignored (and named) by the decoding.
# "a" and "b" are the real active nodes of the tables below.
HOSTILE_STATE = {
    "state/nodes/g1": "not json {",
    "state/nodes/g2": "[1, 2]",
    "state/nodes/g3": node_json("g3", store_port=10**30),
    "state/nodes/g4": node_json("g4").replace('"joined": 1.0', '"joined": NaN'),
    "state/nodes/g5": node_json("someone-else"),
    "state/nodes/g6": node_json("g6", nproc="1"),
    "state/nodes/g7": DEEP,
    "state/nodes/a/b": node_json("b"),
    "state/nodes/big": MIB,
    "state/failed/a": "[]",
    "state/failed/f2": "nope",
    "state/failed/f3": '{"reason": 5}',
    "state/failed/a/b": "{}",
    "state/drain/b": "null",
    "state/drain/d2": '{"reason": ["x"]}',
    "state/warm/b": "warm",
    "state/warm/c/d": "{}",
    "state/reports/0/a": '{"reason": 7}',
    "state/reports/0/b": DEEP,
    "state/reports/0/c": '{"reason": "x", "kind": "alien"}',
    "state/reports/0/d": '{"reason": "x", "time": "noon"}',
    "state/reports/zz/x": "{}",
    "state/reports/0/a/b": '{"reason": "x"}',
    "state/done/0/a": "garbage",
    "state/done/0/b": "1e999",
    "state/done/0/a/b": "{}",
    "state/stores/0": '{"addr": 5, "port": "x"}',
    "state/stores/1": json.dumps({"addr": "127.0.0.1", "port": 10**30}),
    "state/stores/zz": "{}",
    "state/plan/extra": "{}",
}
HOSTILE_LOG = {
    "log/history/junk": "junk",
    "log/history/00000009": HUGE_INT,
    "log/events/e1": "NaN",
    "log/events/e2": DEEP,
    "log/events/big": MIB,
    "log/alarms/x/y": "[",
    "log/progress/b": '{"generation": 0, "workers": [1]}',
    "log/progress/c": '{"generation": 0, "workers": {"0": 5}}',
    "log/progress/a/b": "{}",
}
# Wrongly typed but well-formed JSON objects: shown as they are, never fatal for the readers.
ODD_BUT_OBJECTS = {
    "log/events/e3": json.dumps({"time": "yesterday", "node": [1, 2], "kind": {"k": 1}, "message": 1e308}),
    "log/events/e4": json.dumps({"time": 1e300}),
    "log/alarms/z/w": json.dumps({"severity": [], "message": {"deep": [1]}, "gpu": None}),
}


@pytest.fixture
def members(etcd_endpoint):
    run = f"hostile-{uuid.uuid4().hex[:8]}"
    kv = connect("v3", EtcdOptions(endpoints=(etcd_endpoint,), prefix=run_prefix(run)))
    yield Membership(kv), run
    kv.close()


def test_every_hostile_value_is_skipped_and_named_once(members, caplog):
    m, run = members
    kv = m.kv
    leases = [
        m.register(NodeInfo(id=n, host="h", addr="127.0.0.1", store_port=1000 + i, nproc=1, pid=1, joined=float(i)), ttl=30)
        for i, n in enumerate(("a", "b", "s"))
    ]
    p0 = Plan(generation=0, nodes=("a", "b"), nproc=1, store={"node": "a", "addr": "127.0.0.1", "port": 1000})
    assert m.publish(p0, None)
    m.set_live()
    m.operator_log.event("a", "plan", message="published generation 0")
    clean = m.snapshot().view
    for key, value in {**HOSTILE_STATE, **HOSTILE_LOG, **ODD_BUT_OBJECTS}.items():
        kv.put(key, value)
    with caplog.at_level(logging.WARNING, logger="rendezvous.json_values"):
        t0 = time.monotonic()
        snap = m.snapshot()
        m.snapshot()  # a second read names nothing again
        oplog = m.operator_log
        events, alarms, progress, history = oplog.events(), oplog.alarms(), oplog.all_progress(), oplog.history()
        elapsed = time.monotonic() - t0
    view = snap.view
    # Exactly the job it was, with the garbage ignored.
    assert view.plan == clean.plan and set(view.alive) == {"a", "b", "s"} and view.alive == clean.alive
    assert view.failed == {} and view.drains == {} and view.reports == {} and view.done == frozenset()
    assert view.live and snap.spares_alive == 1
    assert next_plan(view, Limits(min_nodes=2, max_nodes=2, nproc=1, max_restarts=0)) is None
    assert m.store_for(0) is None and m.store_for(1) is None
    # Every bad key is named once, with the fix; never its (possibly huge) value.
    skipped = set(m.skipped)
    expected = {k for k in {**HOSTILE_STATE, **HOSTILE_LOG} if k != "state/reports/zz/x"} - {"state/reports/zz/x"}
    assert expected - skipped == set(), f"not skipped: {sorted(expected - skipped)}"
    messages = [r.getMessage() for r in caplog.records]
    for key in expected:
        hits = [msg for msg in messages if f"{run_prefix(run)}{key}:" in msg]
        assert len(hits) == 1, (key, hits)
        assert "etcdctl del" in hits[0] and len(hits[0]) < 400
    # Odd-but-object records are passed through for the views to show.
    assert len(events) == 3 and len(alarms) == 1 and progress == {} and [p.generation for p in history] == [0]
    assert elapsed < 10, f"reading ~3 MiB of garbage took {elapsed:.1f}s"
    for lease in leases:
        lease.revoke()


@pytest.mark.parametrize(
    "value",
    [
        "garbage {",
        "[]",
        "null",
        HUGE_INT,
        DEEP,
        MIB,
        '{"generation": NaN, "nodes": ["a"], "nproc": 1}',
        '{"generation": 1e999, "nodes": ["a"], "nproc": 1}',
        '{"generation": 0, "nodes": "ab", "nproc": 1}',
        '{"generation": 0, "nodes": [1], "nproc": 1}',
        '{"generation": 0, "nodes": ["a"], "nproc": -1}',
        '{"generation": -1, "nodes": ["a"], "nproc": 1}',
        '{"generation": 0, "nodes": ["a"], "nproc": 1, "store": "here"}',
        '{"generation": 0, "nodes": ["a"], "nproc": 1, "replaced": {"b": 3}}',
        '{"generation": 0, "nodes": ["a"], "nproc": 1, "state": "exploded"}',
        '{"generation": 0, "nodes": ["a"], "nproc": 1, "live": "yes"}',
        '{"generation": 0, "nodes": ["a"], "nproc": 1, "' + "k" * 5000 + '": 1}',
    ],
    ids=lambda v: v[:40],
)
def test_unreadable_plan_is_one_clear_error(members, value):
    m, run = members
    m.kv.put("state/plan", value)
    with pytest.raises(KVError) as err:
        m.snapshot()
    text = str(err.value)
    assert "\n" not in text and len(text) < 400, text
    assert f"{run_prefix(run)}state/plan" in text and "restore" in text and "--rdzv-id" in text


def test_ctl_status_with_an_unreadable_plan_shows_the_nodes_and_why(members, etcd_endpoint, capsys):
    from tm_launch.ctl import commands as ctl

    m, run = members
    lease = m.register(NodeInfo(id="a", host="h", addr="127.0.0.1", store_port=1000, nproc=1, pid=1, joined=1.0), ttl=30)
    m.kv.put("state/plan", "garbage {")
    assert ctl.main(["--rdzv-endpoint", etcd_endpoint, "--rdzv-id", run, "status", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["state"] == "plan unreadable" and [n["id"] for n in s["nodes"]] == ["a"]
    lease.revoke()


def test_nan_and_huge_numbers_are_not_json(members):
    """Python's json accepts NaN/Infinity and arbitrarily large ints; etcd records must not."""
    m, _ = members
    m.kv.put("log/events/n", '{"time": NaN}')
    m.kv.put("log/events/i", '{"time": Infinity}')
    m.kv.put("log/events/ok", '{"time": 1.5}')
    assert [e["time"] for e in m.operator_log.events()] == [1.5]
    assert not any(isinstance(v, float) and math.isnan(v) for e in m.operator_log.events() for v in e.values())


# ------------------------------------------------------------------------------------------------
# a running job

STEPS, PAUSE = 30, 5


def _agent_logs_clean(job) -> None:
    for name, node in job.nodes.items():
        assert "Traceback" not in node.log(), f"{name}:\n{node.log()[-3000:]}"


def _wait_logs(job, text: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if all(text in n.log() for n in job.nodes.values()):
            return
        time.sleep(0.1)
    raise AssertionError(f"not every agent said {text!r}\n{job.logs_tail()}")


@pytest.mark.slow  # ~25 s alone, a minute on a loaded machine
def test_hostile_contents_in_a_running_job(local_job, etcd_endpoint):
    """One live job (2 nodes x 1 worker, --max-restarts 0 so that any phantom failure fails it),
    held at step 5 while the whole table is written under its keys; then its plan is made
    unreadable and restored; then it must finish every step once, in generation 0."""
    job = local_job(nnodes="2", nproc=1, launcher_args=["--max-restarts", "0"])
    trigger = os.path.join(job.workdir, "trigger")
    job.script_args = [
        "--steps",
        str(STEPS),
        "--step-sleep",
        "0.02",
        "--step-log",
        job.step_log,
        "--pause-step",
        str(PAUSE),
        "--pause-file",
        trigger,
    ]
    kv = connect("v3", EtcdOptions(endpoints=(etcd_endpoint,), prefix=run_prefix(job.run_id)))
    try:
        job.start_all(["a", "b"])
        job.wait_step(PAUSE - 1, timeout=120)
        for key, value in {**HOSTILE_STATE, **HOSTILE_LOG, **ODD_BUT_OBJECTS}.items():
            kv.put(key, value)
        # Agent a (group rank 0) reads every node's progress each second for the straggler
        # statistic, and b rewrites its own record each second: keep a forged one there.
        stop = threading.Event()

        def forge():
            while not stop.is_set():
                for bad in (
                    '{"generation": 0, "workers": {"0": {"rank": "zero", "windows": {"w": "x"}}}}',
                    '{"generation": 0, "workers": {"0": {"rank": 1, "windows": [1]}}}',
                    '{"generation": 0, "workers": [0]}',
                ):
                    kv.put("log/progress/b", bad)
                    time.sleep(0.05)

        forger = threading.Thread(target=forge, daemon=True)
        forger.start()
        time.sleep(3.0)  # a few loop iterations and progress rounds over all of it
        stop.set()
        forger.join()
        assert all(n.proc.poll() is None for n in job.nodes.values()), job.logs_tail()
        _agent_logs_clean(job)
        _wait_logs(job, "ignoring etcd key", 5)

        status = job.ctl("status", "--json")
        assert status.returncode == 0, status.stderr
        s = json.loads(status.stdout)
        assert s["generation"] == 0 and s["state"] == "running"
        assert {n["id"]: n["role"] for n in s["nodes"]} == {"a": "active", "b": "active"}, s["nodes"]
        assert "ignoring etcd key" in status.stderr and "state/done/0/a" in status.stderr
        assert "Traceback" not in status.stderr
        for args in (("status",), ("events",), ("events", "--json")):
            out = job.ctl(*args)
            assert out.returncode == 0 and "Traceback" not in out.stderr, (args, out.stderr[-2000:])
            assert "log/events/e1" in out.stderr or args == ("status",)
        assert "??:??:??" in job.ctl("events").stdout  # the event with time "yesterday", shown anyway

        # An unreadable plan: every agent stops changing the job and says so, once.
        plan = kv.get("state/plan").value
        kv.put("state/plan", "garbage {")
        _wait_logs(job, "state/plan) is unreadable", 10)
        time.sleep(1.5)
        assert kv.get("state/plan").value == "garbage {"  # nobody published over it
        for name, node in job.nodes.items():
            assert node.log().count("state/plan) is unreadable") == 1, node.log()[-2000:]
            assert node.proc.poll() is None
        out = job.ctl("status", "--json")  # the operator still sees the nodes, and why
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
        assert json.loads(out.stdout)["state"] == "plan unreadable"
        assert {n["id"] for n in json.loads(out.stdout)["nodes"]} == {"a", "b"}
        assert "state/plan) is unreadable" in out.stderr

        kv.put("state/plan", plan)
        open(trigger, "w").close()
        codes = job.wait(timeout=180)
        assert codes == {"a": 0, "b": 0}, job.logs_tail()
        _agent_logs_clean(job)
        # Every step ran exactly once per rank, all in generation 0: nothing was disturbed.
        records = job.step_records()
        for rank in (0, 1):
            steps = sorted(step for _, r, step, _, _ in records if r == rank)
            assert steps == list(range(STEPS)), (rank, steps)
        assert {gen for _, _, _, gen, _ in records} == {0}
    finally:
        kv.close()


def test_ctl_views_survive_hostile_contents(members, etcd_endpoint, capsys):
    """``ctl status`` and ``ctl events`` on the whole table, plus terminal escapes in keys and
    values: exit 0, every output line printable, nothing skipped silently."""
    from tm_launch.ctl import commands as ctl

    m, run = members
    lease = m.register(NodeInfo(id="a", host="h", addr="127.0.0.1", store_port=1000, nproc=1, pid=1, joined=1.0), ttl=30)
    assert m.publish(Plan(generation=0, nodes=("a",), nproc=1, cause="initial \x1b[2J rendezvous"), None)
    for key, value in {**HOSTILE_STATE, **HOSTILE_LOG, **ODD_BUT_OBJECTS}.items():
        m.kv.put(key, value)
    m.kv.put("log/progress/ev\x1b[2Jil", json.dumps({"workers": {"0": {"step": "\x1b[31m7\nx"}}}))
    m.kv.put("state/failed/x", json.dumps({"reason": "bad\x1b[31m\nsecond line"}))
    m.kv.put("log/events/e9", json.dumps({"time": 1.0, "node": "n\x07", "kind": "k", "message": "a\rb\x1b[0m"}))
    base = ["--rdzv-endpoint", etcd_endpoint, "--rdzv-id", run]
    for args in (["status"], ["status", "--json"], ["events"], ["events", "--json"]):
        assert ctl.main(base + args) == 0, args
        out = capsys.readouterr().out
        assert out.strip(), args
        if "--json" in args:
            for chunk in [out] if args[0] == "status" else out.splitlines():
                json.loads(chunk)  # still machine-readable
        else:
            assert all(line.isprintable() for line in out.splitlines()), (args, out)
            assert "\x1b" not in out and "\r" not in out and "\x07" not in out
    lease.revoke()


def test_agent_joining_a_run_with_an_unreadable_plan_says_one_line(members, etcd_endpoint):
    from test_bad_input import assert_one_error, finish, launch

    m, run = members
    m.kv.put("state/plan", DEEP)
    proc = launch(
        ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd_endpoint, "--rdzv-id", run, "--nnodes", "1", "tests/scripts/train.py"]
    )
    rc, _, err = finish(proc, timeout=90)
    line = assert_one_error(rc, err, f"{run_prefix(run)}state/plan", "is unreadable", "--rdzv-id")
    assert rc == 1 and "joined run" not in err and len(line) < 400
    assert m.kv.get("state/plan").value == DEEP and m.kv.get_prefix("state/nodes/") == []
