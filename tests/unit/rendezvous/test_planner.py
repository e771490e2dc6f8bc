"""Table tests for the pure planner: ``next_plan(View, Limits)`` -> the next generation or None.

Each case builds a View the way the membership adapter would (nodes join in the order they are
listed, so join order is visible in the table), runs the planner, and checks the fields of the
resulting plan that the case is about. No etcd, no processes.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from rendezvous.plan import FAILED, RUNNING, SUCCEEDED, NodeInfo, Plan
from rendezvous.planner import Limits, View, finished_without, next_plan, spares, why_restart

NPROC = 2


def info(node: str, joined: float) -> NodeInfo:
    return NodeInfo(
        id=node,
        host=f"host-{node}",
        addr=f"10.0.0.{int(joined) + 1}",
        store_port=29500 + int(joined),
        nproc=NPROC,
        pid=1000 + int(joined),
        joined=joined,
    )


def plan(gen: int, nodes: str, **fields) -> Plan:
    """``plan(3, "ab")``: generation 3 with active nodes a, b (group ranks in that order)."""
    fields.setdefault("store", {"node": nodes[0], "addr": "x", "port": 1})
    return Plan(generation=gen, nodes=tuple(nodes), nproc=NPROC, **fields)


def view(
    p: Plan | None = None,
    alive: str = "",
    *,
    failed: str = "",
    reports: dict | None = None,
    drains: str = "",
    done: str = "",
    live: bool = False,
    last_call: bool = False,
    kinds: dict | None = None,
    warm: str = "",
) -> View:
    """Single-letter node ids; ``alive`` lists the nodes with a live lease in join order;
    ``warm`` the spares whose workers parked (their markers)."""
    return View(
        plan=p,
        alive={n: info(n, i) for i, n in enumerate(alive)},
        failed={n: "xid 79: GPU fell off the bus" for n in failed},
        reports=dict(reports or {}),
        drains={n: "operator: tm-launch ctl drain" for n in drains},
        done=frozenset(done),
        warm=frozenset(warm),
        report_kinds=dict(kinds or {}),
        live=live,
        last_call_passed=last_call,
    )


def limits(nnodes: str = "2", max_restarts: int = 3) -> Limits:
    lo, _, hi = nnodes.partition(":")
    return Limits(min_nodes=int(lo), max_nodes=int(hi or lo), nproc=NPROC, max_restarts=max_restarts)


def T(nodes: str) -> tuple[str, ...]:
    return tuple(nodes)


def check(got: Plan | None, want: dict | None, v: View) -> None:
    if want is None:
        assert got is None, f"expected no new plan, got {got}"
        return
    assert got is not None, "expected a new plan, got None"
    want = dict(want)
    assert got.generation == (0 if v.plan is None else v.plan.generation + 1)
    for key in ("cause_has", "reason_has"):
        if key in want:
            text = getattr(got, key.split("_")[0])
            assert want.pop(key) in text, f"{key}: {text!r}"
    want.setdefault("state", RUNNING)
    actual = {k: getattr(got, k) for k in want}
    assert actual == want
    if got.state == RUNNING:
        # invariants of every running plan
        assert got.nproc == NPROC
        assert len(set(got.nodes)) == len(got.nodes), "a node holds two group ranks"
        assert set(got.joiners) <= set(got.nodes)
        assert not set(got.removed) & set(got.nodes)
        assert all(n in v.alive for n in got.nodes), "a plan made a dead node active"
        assert not set(got.nodes) & set(v.failed), "a plan made a cordoned node active"
        assert got.store["node"] in got.nodes and got.store["node"] in v.alive
        host = v.alive[got.store["node"]]
        assert (got.store["addr"], got.store["port"]) == (host.addr, host.store_port)


# ------------------------------------------------------------------------------------------------
# generation 0

FORMATION = [
    pytest.param(
        view(None, "cab"),
        limits("2"),
        dict(nodes=T("ca"), joiners=T("ca"), restarts=0, live=False),
        id="gen0: more than MAX joined -> first MAX in join order, the rest are spares",
    ),
    pytest.param(
        view(None, "ba"),
        limits("2"),
        dict(nodes=T("ba"), joiners=T("ba")),
        id="gen0: exactly MAX joined -> formed without waiting for the last call",
    ),
    pytest.param(view(None, "ab"), limits("1:3"), None, id="gen0: MIN..MAX joined, last call still open -> wait"),
    pytest.param(
        view(None, "ab", last_call=True),
        limits("1:3"),
        dict(nodes=T("ab"), joiners=T("ab")),
        id="gen0: MIN..MAX joined, last call passed -> form with all of them",
    ),
    pytest.param(view(None, "ab", last_call=True), limits("3:4"), None, id="gen0: fewer than MIN even after the last call -> wait"),
    pytest.param(
        view(None, "abc", failed="a"), limits("2"), dict(nodes=T("bc")), id="gen0: cordoned node never chosen even if it joined first"
    ),
    pytest.param(view(None, "ab", failed="a", last_call=True), limits("2"), None, id="gen0: cordoned node does not count towards MIN"),
    pytest.param(view(None, "abc", drains="a"), limits("2"), dict(nodes=T("bc")), id="gen0: draining node never chosen"),
    pytest.param(view(None, ""), limits("1"), None, id="gen0: nobody joined -> wait"),
]


@pytest.mark.parametrize("v, lim, want", FORMATION)
def test_formation(v, lim, want):
    got = next_plan(v, lim)
    check(got, want, v)
    if got is not None:
        assert got.cause == "initial rendezvous" and got.replaced == {} and got.removed == ()
        assert got.store["node"] == got.nodes[0]


# ------------------------------------------------------------------------------------------------
# steady state, success, finished plans

STEADY = [
    pytest.param(view(plan(4, "ab"), "abc"), limits("2"), None, id="nothing happened -> the plan stands"),
    pytest.param(
        view(plan(4, "ab", restarts=2), "abc", done="ab"),
        limits("2"),
        dict(state=SUCCEEDED, restarts=2, reason_has="training finished"),
        id="all active nodes done -> SUCCEEDED (spares need not be done)",
    ),
    pytest.param(view(plan(4, "ab"), "abc", done="a"), limits("2"), None, id="only some active nodes done -> keep waiting"),
    pytest.param(
        view(plan(4, "ab"), "b", done="ab"),
        limits("2"),
        dict(state=SUCCEEDED),
        id="all done, then a lease expired -> still SUCCEEDED, no restart",
    ),
    pytest.param(
        view(plan(4, "ab", state=SUCCEEDED), "b", reports={"b": "worker 0 exited"}),
        limits("2"),
        None,
        id="finished plan (succeeded) -> None even with losses",
    ),
    pytest.param(
        view(plan(4, "ab", state=FAILED, reason="x"), "abcd"), limits("1:4"), None, id="finished plan (failed) -> None even with spares"
    ),
]


@pytest.mark.parametrize("v, lim, want", STEADY)
def test_steady_and_finished(v, lim, want):
    check(next_plan(v, lim), want, v)


# ------------------------------------------------------------------------------------------------
# unplanned loss

LOSS = [
    # --- a spare takes the lost node's group rank
    pytest.param(
        view(plan(3, "ab"), "bc"),
        limits("2"),
        dict(
            nodes=T("cb"),
            joiners=T("cb"),
            replaced={"c": "a"},
            removed=T("a"),
            restarts=1,
            live=False,
            planned=False,
            cause_has="a: node lost (lease expired)",
        ),
        id="lease expired + spare -> spare takes group rank 0 (restart mode: all workers fresh)",
    ),
    pytest.param(
        view(plan(3, "ab", live=True), "bc", live=True),
        limits("2"),
        dict(nodes=T("cb"), joiners=T("c"), replaced={"c": "a"}, removed=T("a"), restarts=1, live=True),
        id="lease expired + spare, live job -> only the spare joins, survivors keep running",
    ),
    pytest.param(
        view(plan(3, "ab"), "abc", reports={"b": "worker 1 (pid 7) exited with code 1"}, live=True),
        limits("2"),
        dict(
            nodes=T("ac"),
            joiners=T("c"),
            replaced={"c": "b"},
            removed=T("b"),
            restarts=1,
            live=True,
            cause_has="b: worker 1 (pid 7) exited with code 1",
        ),
        id="reported failure + spare -> spare takes group rank 1, reporter leaves",
    ),
    pytest.param(
        view(plan(3, "ab"), "abc", failed="a", live=True),
        limits("2"),
        dict(nodes=T("cb"), joiners=T("c"), replaced={"c": "a"}, removed=T("a"), restarts=1, cause_has="a: cordoned: xid 79"),
        id="cordoned active node (still alive) + spare -> replaced",
    ),
    pytest.param(
        view(plan(3, "ab"), "abdc", reports={"a": "hang"}, live=True),
        limits("2"),
        dict(nodes=T("db"), replaced={"d": "a"}),
        id="several spares -> the one that joined first is promoted",
    ),
    pytest.param(
        view(plan(3, "ab", live=True), "abdce", reports={"a": "hang"}, live=True, warm="ce"),
        limits("2"),
        dict(nodes=T("cb"), joiners=T("c"), replaced={"c": "a"}),
        id="several spares, some warm -> the warm one that joined first, before a cold one that joined earlier",
    ),
    pytest.param(
        view(plan(3, "ab", live=True), "abdc", reports={"a": "hang", "b": "hang"}, live=True, warm="c"),
        limits("2"),
        dict(nodes=T("cd"), joiners=T("cd"), replaced={"c": "a", "d": "b"}),
        id="two losses, one warm spare -> the warm one takes the first lost rank, the cold one the next",
    ),
    pytest.param(
        view(plan(3, "ab", live=True), "bdc", failed="c", live=True, warm="c"),
        limits("2"),
        dict(nodes=T("db"), replaced={"d": "a"}),
        id="a cordoned spare's warm marker does not make it a candidate",
    ),
    pytest.param(
        view(plan(3, "ab", live=True), "abd", reports={"a": "hang"}, live=True, warm="a"),
        limits("2"),
        dict(nodes=T("db"), replaced={"d": "a"}),
        id="a warm marker left by an active node (promoted, not yet unmarked) changes nothing",
    ),
    pytest.param(
        view(plan(3, "ab"), "bcd", failed="c", live=True),
        limits("2"),
        dict(nodes=T("db"), replaced={"d": "a"}),
        id="cordoned spare is skipped",
    ),
    pytest.param(
        view(plan(3, "ab"), "bcd", drains="c", live=True),
        limits("2"),
        dict(nodes=T("db"), replaced={"d": "a"}),
        id="draining spare is skipped",
    ),
    pytest.param(
        view(plan(3, "ab", removed=T("c")), "bc", live=True),
        limits("1:2"),
        dict(nodes=T("b"), joiners=T("b"), removed=T("a"), live=False),
        id="node removed in the current generation is not a spare yet",
    ),
    # --- restarts are counted job-wide
    pytest.param(
        view(plan(7, "ab", restarts=2), "bc"),
        limits("2", max_restarts=3),
        dict(nodes=T("cb"), restarts=3),
        id="third restart of 3 allowed -> replaced",
    ),
    pytest.param(
        view(plan(7, "ab", restarts=3), "bc"),
        limits("2", max_restarts=3),
        dict(state=FAILED, restarts=4, removed=T("a"), reason_has="max restarts (3) exhausted; last failure: a: node lost (lease expired)"),
        id="max_restarts exhausted -> FAILED with the reason, even with a spare",
    ),
    pytest.param(
        view(plan(0, "ab"), "abc", reports={"a": "worker 0 exited with code 1"}),
        limits("2", max_restarts=0),
        dict(state=FAILED, restarts=1, reason_has="max restarts (0) exhausted; last failure: a: worker 0 exited"),
        id="--max-restarts 0 -> the first failure fails the job",
    ),
    # --- no spare
    pytest.param(
        view(plan(3, "ab"), "ab", reports={"a": "worker 0 exited with code 1"}),
        limits("2"),
        dict(nodes=T("ab"), joiners=T("ab"), replaced={}, removed=(), restarts=1, live=False),
        id="no spare + node alive -> restart in place (restart mode: everyone restarts)",
    ),
    pytest.param(
        view(plan(3, "ab"), "ab", reports={"a": "worker 0 exited with code 1"}, live=True),
        limits("2"),
        dict(nodes=T("ab"), joiners=T("a"), replaced={}, removed=(), restarts=1, live=True),
        id="no spare + node alive, live job -> only that node's workers restart",
    ),
    pytest.param(
        view(plan(3, "abc"), "bc", live=True),
        limits("2:3"),
        dict(nodes=T("bc"), joiners=T("bc"), removed=T("a"), replaced={}, restarts=1, live=False),
        id="no spare + dead node, >= MIN left -> shrink, new world size restarts every worker",
    ),
    pytest.param(
        view(plan(3, "ab"), "b"),
        limits("2"),
        dict(state=FAILED, restarts=1, removed=T("a"), reason_has="no spare left: 1 node(s) remain, --nnodes needs at least 2"),
        id="no spare + dead node, below MIN -> FAILED 'no spare left'",
    ),
    pytest.param(
        view(plan(3, "ab"), "ab", failed="a"),
        limits("2"),
        dict(state=FAILED, reason_has="no spare left"),
        id="no spare + cordoned node -> never restarted in place; below MIN -> FAILED",
    ),
    pytest.param(
        view(plan(3, "ab"), "ab", failed="a"),
        limits("1:2"),
        dict(nodes=T("b"), joiners=T("b"), removed=T("a"), restarts=1),
        id="no spare + cordoned node, MIN allows -> shrink",
    ),
    pytest.param(
        view(plan(3, "ab"), "ab", reports={"a": "agent unreachable (connection refused): node lost"}, kinds={"a": "lost"}, live=True),
        limits("2"),
        dict(state=FAILED, restarts=1, reason_has="no spare left: 1 node(s) remain"),
        id="no spare + agent found dead, lease not yet expired -> not restarted in place; below MIN -> FAILED",
    ),
    pytest.param(
        view(plan(3, "ab"), "ab", reports={"a": "agent unreachable (connection refused): node lost"}, kinds={"a": "lost"}, live=True),
        limits("1:2"),
        dict(nodes=T("b"), joiners=T("b"), removed=T("a"), restarts=1, live=False),
        id="no spare + agent found dead, MIN allows -> shrink",
    ),
    # --- two losses in one generation, one spare
    pytest.param(
        view(plan(3, "abc"), "cd"),
        limits("2:3"),
        dict(nodes=T("dc"), joiners=T("dc"), replaced={"d": "a"}, removed=T("ab"), restarts=1, live=False),
        id="two dead, one spare, MIN allows -> spare takes the first, second dropped, one restart",
    ),
    pytest.param(
        view(plan(3, "abc"), "cd", live=True),
        limits("3"),
        dict(state=FAILED, restarts=1, reason_has="no spare left: 2 node(s) remain"),
        id="two dead, one spare, MIN = 3 -> FAILED",
    ),
    pytest.param(
        view(plan(3, "abc"), "bcd", reports={"b": "worker 0 exited with code 1"}, live=True),
        limits("3"),
        dict(nodes=T("dbc"), joiners=T("db"), replaced={"d": "a"}, removed=T("a"), restarts=1, live=True),
        id="one dead + one reported, one spare -> spare replaces the dead, reporter restarts in place (live)",
    ),
    pytest.param(
        view(plan(3, "abc"), "bcd", reports={"b": "worker 0 exited with code 1"}),
        limits("3"),
        dict(nodes=T("dbc"), joiners=T("dbc"), restarts=1, live=False),
        id="one dead + one reported, one spare, restart mode -> everyone restarts",
    ),
    # --- the live state of some rank exists nowhere any more (no replica survived)
    pytest.param(
        view(
            plan(3, "ab", live=True, joiners=T("b")),
            "ab",
            reports={
                "a": "no live rank holds the state of rank(s) [3] at step 12",
                "b": "no live rank holds the state of rank(s) [3] at step 12",
            },
            kinds={"a": "state", "b": "state"},
            live=True,
        ),
        limits("2"),
        dict(
            nodes=T("ab"),
            joiners=T("ab"),
            replaced={},
            removed=(),
            restarts=1,
            live=False,
            cause_has="no live rank holds the state of rank(s) [3] at step 12",
        ),
        id="state lost, reported by every node -> nobody replaced, every worker restarts (checkpoint)",
    ),
    pytest.param(
        view(
            plan(3, "ab", live=True),
            "ab",
            reports={"b": "no live rank holds the state of rank(s) [2] at step 7"},
            kinds={"b": "state"},
            live=True,
        ),
        limits("2"),
        dict(nodes=T("ab"), joiners=T("ab"), restarts=1, live=False),
        id="state lost, one report seen so far -> the same restart",
    ),
    pytest.param(
        view(
            plan(3, "abc", live=True),
            "bcd",
            reports={"b": "no live rank holds the state of rank(s) [0] at step 7"},
            kinds={"b": "state"},
            live=True,
        ),
        limits("3"),
        dict(
            nodes=T("dbc"),
            joiners=T("dbc"),
            replaced={"d": "a"},
            restarts=1,
            live=False,
            cause_has="a: node lost (lease expired); no live rank holds",
        ),
        id="state lost and a node lost -> the spare replaces it, every worker restarts",
    ),
    # --- loss beats drain
    pytest.param(
        view(plan(3, "ab"), "bc", drains="b", live=True),
        limits("2"),
        dict(nodes=T("cb"), replaced={"c": "a"}, planned=False, restarts=1),
        id="loss and drain at once -> the spare replaces the lost node, the drain waits",
    ),
]


@pytest.mark.parametrize("v, lim, want", LOSS)
def test_unplanned_loss(v, lim, want):
    check(next_plan(v, lim), want, v)


def test_store_moves_to_a_survivor_when_its_host_dies():
    """Group rank 0 hosted the bootstrap store and died: the next store is on a survivor, not
    on the newcomer (whose agent nobody has talked to yet) and never on the dead node."""
    p = plan(5, "abc", store={"node": "a", "addr": "10.0.0.1", "port": 29500}, live=True)
    v = view(p, "bcd", live=True)
    got = next_plan(v, limits("3"))
    assert got.nodes == T("dbc") and got.joiners == T("d")
    record = {"node": "b", "addr": v.alive["b"].addr, "port": v.alive["b"].store_port}
    assert got.store == {**record, "standby": {"node": "d", "addr": v.alive["d"].addr, "port": v.alive["d"].store_port}}


def _stored(v: View | None, node: str, standby: str | None = None) -> dict:
    """A plan's store entry on ``node`` (and its standby), addresses from ``v``'s records."""
    entry = {"node": node, "addr": v.alive[node].addr if v else "x", "port": v.alive[node].store_port if v else 1}
    if standby:
        entry["standby"] = _stored(v, standby)
    return entry


STORE_MOVES = [
    # (nodes, store host, its standby, nodes alive, drains) -> (host, standby) of the next plan
    pytest.param("abc", "c", "a", "bcd", "", ("c", "d"), id="a non-host node lost: the store stays on c"),
    pytest.param("abc", "a", "c", "bcd", "", ("c", "d"), id="the host lost: the store moves to the standby it named"),
    pytest.param("abc", "a", "b", "bcd", "", ("b", "d"), id="the host lost, standby b: b; the standby is then the newcomer"),
    pytest.param("abc", "a", "b", "cde", "", ("c", "d"), id="host and standby lost: the first survivor"),
    pytest.param("abc", "a", None, "bcd", "", ("b", "d"), id="an older plan without a standby: the first survivor"),
    pytest.param("abc", "b", "a", "abcd", "b", ("a", "d"), id="the host drained: the standby"),
    pytest.param("ab", "a", "b", "abd", "a", ("b", "d"), id="two nodes, the host drained: the other, standby the spare"),
]


@pytest.mark.parametrize("nodes, host, standby, alive, drains, want", STORE_MOVES)
def test_store_stays_or_moves_to_its_standby(nodes, host, standby, alive, drains, want):
    """Workers keep connections ready to the store and its standby (tm_launch.worker.comms.store_clients): the
    store moves only when its node goes, and then to the standby the last plan named."""
    p = plan(5, nodes, store=_stored(None, host, standby), live=True)
    lost = {n: "dead" for n in nodes if n not in alive}
    v = view(p, alive, reports=None if drains else {n: "worker failed" for n in lost if n in alive}, drains=drains, live=True)
    got = next_plan(v, limits(str(len(nodes))))
    assert (got.store["node"], got.store["standby"]["node"]) == want
    assert got.store == _stored(v, *want)


def test_a_single_node_store_has_no_standby():
    v = view(None, "a")
    got = next_plan(v, limits("1"))
    assert got.store == _stored(v, "a")


def test_store_in_restart_mode_is_on_a_live_node():
    v = view(plan(5, "abc", store={"node": "a", "addr": "10.0.0.1", "port": 29500}), "bcd")
    got = next_plan(v, limits("3"))
    assert got.store["node"] in v.alive and got.store["node"] != "a"


# ------------------------------------------------------------------------------------------------
# planned migration (drain)

DRAIN = [
    pytest.param(
        view(plan(2, "ab", restarts=1, live=True), "abc", drains="a", live=True),
        limits("2", max_restarts=1),
        dict(
            nodes=T("cb"),
            joiners=T("c"),
            replaced={"c": "a"},
            removed=T("a"),
            restarts=1,
            live=True,
            planned=True,
            cause_has="a: drain (operator: tm-launch ctl drain)",
        ),
        id="drain + spare, live -> two-phase migration, no restart consumed (even at the limit)",
    ),
    pytest.param(
        view(plan(2, "ab", live=True), "abcd", drains="a", live=True, warm="d"),
        limits("2"),
        dict(nodes=T("db"), joiners=T("d"), replaced={"d": "a"}, planned=True),
        id="drain, a cold spare and a warm one -> the warm one takes the ranks",
    ),
    pytest.param(
        view(plan(2, "ab"), "abc", drains="b"),
        limits("2"),
        dict(nodes=T("ac"), joiners=T("ac"), replaced={"c": "b"}, removed=T("b"), restarts=0, live=False, planned=True),
        id="drain + spare, restart mode -> all workers restart, still no restart consumed",
    ),
    pytest.param(
        view(plan(2, "ab"), "abcd", drains="ab", live=True),
        limits("2"),
        dict(nodes=T("cd"), joiners=T("cd"), replaced={"c": "a", "d": "b"}, removed=T("ab"), planned=True, live=False),
        id="two drains + two spares -> both move, group ranks kept; nobody stays to hand over state: restart",
    ),
    pytest.param(
        view(plan(2, "ab"), "abc", drains="ab", live=True),
        limits("2"),
        dict(nodes=T("cb"), joiners=T("c"), replaced={"c": "a"}, removed=T("a")),
        id="two drains + one spare -> one moves now, the other waits",
    ),
    pytest.param(
        view(plan(2, "ab"), "ab", drains="a", live=True), limits("1:2"), None, id="drain without spare -> None (never shrinks the job)"
    ),
    pytest.param(view(plan(2, "ab"), "abc", drains="c", live=True), limits("2"), None, id="drain of a spare -> nothing to migrate"),
    pytest.param(
        view(plan(2, "ab"), "abcd", drains="ac", live=True),
        limits("2"),
        dict(nodes=T("db"), replaced={"d": "a"}),
        id="a draining spare is never a migration target",
    ),
    pytest.param(
        view(plan(2, "ab"), "abc", drains="a", failed="c", live=True), limits("2"), None, id="only spare is cordoned -> drain waits"
    ),
]


@pytest.mark.parametrize("v, lim, want", DRAIN)
def test_drain(v, lim, want):
    check(next_plan(v, lim), want, v)


# ------------------------------------------------------------------------------------------------
# restart-mode scale-up (torchrun's behaviour)

SCALE = [
    pytest.param(
        view(plan(1, "a", restarts=1), "abc"),
        limits("1:3"),
        dict(nodes=T("abc"), joiners=T("abc"), restarts=1, live=False, replaced={}, removed=(), cause_has="scale up: b, c joined"),
        id="restart mode below MAX + spares -> grow, every worker restarts, no restart consumed",
    ),
    pytest.param(
        view(plan(1, "a"), "acb"),
        limits("1:2"),
        dict(nodes=T("ac"), cause_has="scale up: c joined"),
        id="grow only up to MAX, in join order",
    ),
    pytest.param(
        view(plan(1, "a"), "abc", live=True),
        limits("1:3"),
        None,
        id="live mode never grows (changing the world size would restart everyone)",
    ),
    pytest.param(view(plan(1, "ab"), "abc"), limits("1:2"), None, id="already at MAX -> spares stay spares"),
    pytest.param(view(plan(1, "a"), "ab", failed="b"), limits("1:2"), None, id="cordoned node never grows the job"),
]


@pytest.mark.parametrize("v, lim, want", SCALE)
def test_scale_up(v, lim, want):
    check(next_plan(v, lim), want, v)


# ------------------------------------------------------------------------------------------------
# properties


@pytest.mark.parametrize("v, lim", [pytest.param(*c.values[:2], id=c.id) for c in FORMATION + LOSS + DRAIN + SCALE])
def test_every_agent_computes_the_same_plan(v, lim):
    """Agents read the same state in whatever order etcd lists it: the decision must not depend on it."""
    want = next_plan(v, lim)
    items = list(v.alive.items())
    random.Random(7).shuffle(items)
    shuffled = View(**{**v.__dict__, "alive": dict(items)})
    got = next_plan(shuffled, lim)
    if want is None:
        assert got is None
    else:
        assert dataclasses.replace(got, created=0.0) == dataclasses.replace(want, created=0.0)


def test_spares_in_join_order():
    v = view(plan(0, "b"), "dbac", failed="c")
    assert spares(v) == ["d", "a"]


def test_warm_spares_first_then_join_order():
    v = view(plan(0, "b"), "dbacef", failed="c", warm="ecb", drains="f")
    assert spares(v) == ["e", "d", "a"]


# ------------------------------------------------------------------------------------------------
# JSON


def test_plan_json_round_trip():
    p = Plan(
        generation=12,
        nodes=("n2", "n0", "n1"),
        nproc=4,
        store={"node": "n0", "addr": "10.1.2.3", "port": 29511},
        restarts=2,
        cause="n9: node lost (lease expired)",
        joiners=("n2",),
        replaced={"n2": "n9"},
        removed=("n9",),
        live=True,
        planned=False,
        state=RUNNING,
        reason="",
        created=1712345678.25,
    )
    back = Plan.from_json(p.to_json())
    assert back == p
    assert isinstance(back.nodes, tuple) and isinstance(back.joiners, tuple) and isinstance(back.removed, tuple)
    assert back.world_size == 12 and back.ranks("n0") == [4, 5, 6, 7] and back.group_rank("n9") is None
    assert Plan.from_json(back.to_json()).to_json() == p.to_json()


def test_finished_plan_json_round_trip():
    p = plan(3, "ab").next(state=FAILED, reason="max restarts (0) exhausted", removed=("a",))
    back = Plan.from_json(p.to_json())
    assert back == p and back.finished and back.generation == 4


def test_plan_next_starts_per_event_fields_empty():
    p = plan(3, "ab", joiners=T("a"), replaced={"a": "z"}, removed=T("z"), planned=True, cause="x", restarts=2, live=True)
    n = p.next()
    assert (n.generation, n.nodes, n.restarts, n.live) == (4, T("ab"), 2, True)
    assert (n.joiners, n.replaced, n.removed, n.planned, n.cause, n.state) == ((), {}, (), False, "", RUNNING)


def test_node_info_json_round_trip():
    n = NodeInfo(id="gpu-node-07", host="gpu-node-07.cluster", addr="10.0.0.7", store_port=41234, nproc=8, pid=4242, joined=1712345678.125)
    assert NodeInfo.from_json(n.to_json()) == n


# ------------------------------------------------------------------------------------------------
# blame: a worker that exits non-zero because its peer died is collateral, not the culprit


def blame_view(reports: dict, kinds: dict, times: dict | None = None, now: float = 10.0, alive: str = "abc", live: bool = False) -> View:
    v = view(plan(0, "ab"), alive=alive, reports=reports, live=live)
    return dataclasses.replace(v, report_kinds=kinds, report_times=times or {n: 9.0 for n in reports}, now=now)


@pytest.mark.parametrize(
    "v, want",
    [
        pytest.param(
            blame_view({"a": "worker exited 1", "b": "worker killed by SIGKILL"}, {"a": "exit", "b": "signal"}),
            {"nodes": T("ac"), "replaced": {"c": "b"}, "joiners": T("ac")},
            id="signal-culprit-replaced-exit-collateral-restarts",
        ),
        pytest.param(
            blame_view({"a": "worker exited 1"}, {"a": "exit"}, alive="ac"),
            {"nodes": T("ac"), "replaced": {"c": "b"}},
            id="lease-lost-culprit-exit-collateral",
        ),
        pytest.param(
            blame_view({"a": "worker exited 1"}, {"a": "exit"}, times={"a": 9.9}, now=10.0), None, id="lone-exit-waits-grace-for-its-cause"
        ),
        pytest.param(
            blame_view({"a": "worker exited 1"}, {"a": "exit"}, times={"a": 9.0}, now=10.0),
            {"nodes": T("cb"), "replaced": {"c": "a"}},
            id="lone-exit-after-grace-is-the-culprit",
        ),
        pytest.param(
            blame_view({"a": "worker exited 1", "b": "xid 79"}, {"a": "exit", "b": "alarm"}, live=True),
            {"nodes": T("ac"), "replaced": {"c": "b"}, "joiners": T("ac"), "live": False},
            id="live-but-no-survivor-holds-state-restarts-all",
        ),
    ],
)
def test_blame(v, want):
    check(next_plan(v, limits("2")), want, v)


def test_live_needs_a_surviving_holder_of_the_state():
    # both active nodes lost their workers (one replaced by the spare, one restarting in place):
    # nobody holds the training state, so every worker restarts instead of "agreeing" on nothing
    v = blame_view({"a": "worker killed by SIGKILL", "b": "xid 79"}, {"a": "signal", "b": "alarm"}, alive="abc", live=True)
    got = next_plan(v, limits("2"))
    assert got is not None and not got.live and set(got.joiners) == set(got.nodes), got


@pytest.mark.parametrize(
    "v, node, want",
    [
        pytest.param(
            view(plan(4, "abc", live=True, planned=True, joiners=T("c")), "abc", done="ab", live=True),
            "c",
            True,
            id="drain at the end: keepers done, the joiner never got in -> nothing left for it",
        ),
        pytest.param(
            view(plan(4, "abc", live=True, planned=True, joiners=T("c")), "abc", done="a", live=True),
            "c",
            False,
            id="a keeper still training -> the joiner is needed",
        ),
        pytest.param(
            view(plan(4, "abc", live=True, joiners=T("c")), "abc", done="ab", live=True),
            "a",
            False,
            id="a keeper is never finished without itself",
        ),
        pytest.param(
            view(plan(4, "abc", joiners=T("abc")), "abc", done="ab"), "c", False, id="restart mode: every node is new and must finish"
        ),
        pytest.param(view(plan(4, "c", live=True, joiners=T("c")), "c", done="", live=True), "c", False, id="no keepers at all -> never"),
    ],
)
def test_finished_without(v, node, want):
    assert finished_without(v, node) is want


def test_a_worker_that_refuses_to_run_fails_the_job_at_once():
    """A worker refused to run as configured (snapshots over their memory limit): no restart
    would help, so the job fails with the worker's own line, spares or not."""
    v = view(plan(3, "ab", live=True), "abc", reports={"a": "snapshots need 2.0 GiB ... over --snapshot-memory-limit 1.0 GiB"},
             kinds={"a": "refused"}, live=True)  # fmt: skip
    got = next_plan(v, limits("2"))
    check(got, dict(state=FAILED, reason_has="over --snapshot-memory-limit", cause_has="a: snapshots need"), v)


@pytest.mark.parametrize(
    "live_seen, state_lost, before, after, survivor, says",
    [
        pytest.param(True, "", 2, 2, True, "", id="live: a spare keeps the world size and a node keeps its workers"),
        pytest.param(False, "", 2, 2, True, "no worker has entered tm_launch's live loop", id="the script never entered job.steps()"),
        pytest.param(True, "rank 1: no replica", 2, 2, True, "training state of some rank is lost (rank 1: no replica)", id="state lost"),
        pytest.param(True, "", 3, 2, True, "no spare left: the job goes from 3 to 2 node(s)", id="the job shrinks"),
        pytest.param(True, "", 2, 2, False, "no node keeps its workers", id="every node is new"),
    ],
)
def test_why_a_generation_restarts_every_worker(live_seen, state_lost, before, after, survivor, says):
    why = why_restart(live_seen, state_lost, before, after, survivor)
    assert (says in why) if says else why == ""


def test_a_plan_says_why_it_is_not_live():
    lost = {"b": "worker exited with code 1"}
    not_live = next_plan(view(plan(1, "ab"), "abc", reports=lost), limits("2"))
    assert not not_live.live and "live loop" in not_live.restart_why
    live = next_plan(view(plan(1, "ab", live=True), "abc", reports=lost, live=True), limits("2"))
    assert live.live and live.restart_why == ""
    shrinks = next_plan(view(plan(1, "abc", live=True), "ab", failed="c", live=True), limits("2:3"))
    assert not shrinks.live and "from 3 to 2 node(s)" in shrinks.restart_why
    assert Plan.from_json(shrinks.to_json()) == shrinks
