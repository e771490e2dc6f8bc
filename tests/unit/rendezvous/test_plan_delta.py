"""Table tests for plan deltas: ``apply_delta(previous, plan_delta(previous, new)) == new``.

A node that only follows plans learns each new plan from the delta published with it, so the
round trip must be exact for every plan the planner can make. The cases are the planner's own
tables (test_planner.py beside this file: formation, loss, drain, scale-up, finish) fed through the real
``next_plan``, a long random run of events at 64 nodes, and the size of a delta, which must not
grow with the job. Anything that does not fit the plan at hand is refused, never half-applied.
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
from test_planner import DRAIN, FORMATION, LOSS, SCALE, STEADY, plan  # noqa: E402  (beside this file, on sys.path)

from rendezvous.plan import FAILED, SUCCEEDED, DeltaMismatch, NodeInfo, Plan, PlanDelta, apply_delta, plan_delta
from rendezvous.planner import Limits, View, next_plan, spares


def round_trip(previous: Plan | None, new: Plan) -> Plan:
    """What a follower rebuilds: the delta goes through its JSON form, as it does through etcd."""
    return apply_delta(previous, PlanDelta.from_json(plan_delta(previous, new).to_json()))


# Every case of the planner's tables in which it makes a plan: (the plan before, the plan made).
PLANNED = [
    pytest.param(c.values[0].plan, new, id=c.id)
    for c in FORMATION + STEADY + LOSS + DRAIN + SCALE
    for new in [next_plan(*c.values[:2])]
    if new is not None
]


@pytest.mark.parametrize("previous, new", PLANNED)
def test_round_trip_over_the_planners_tables(previous, new):
    assert round_trip(previous, new) == new


CASES = [
    pytest.param(
        None,
        Plan(generation=0, nodes=tuple("abcd"), nproc=2, joiners=tuple("abcd"), cause="initial rendezvous"),
        dict(previous=None, nodes=((0, 0, tuple("abcd")),), every_node_joins=True),
        id="formation: every node is new",
    ),
    pytest.param(
        plan(3, "abcd", live=True),
        plan(3, "abcd", live=True).next(nodes=tuple("abXd"), joiners=("X",), replaced={"X": "c"}, removed=("c",)),
        dict(previous=3, nodes=((2, 3, ("X",)),), joiners=("X",), every_node_joins=False),
        id="loss: a spare takes group rank 2",
    ),
    pytest.param(
        plan(3, "abcd"),
        plan(3, "abcd").next(nodes=tuple("abd"), joiners=tuple("abd"), removed=("c",)),
        dict(nodes=((2, 3, ()),), joiners=(), every_node_joins=True),
        id="loss without spare: shrink, everyone restarts",
    ),
    pytest.param(
        plan(3, "abcd", live=True),
        plan(3, "abcd", live=True).next(nodes=tuple("Xbcd"), joiners=("X",), planned=True, removed=("a",)),
        dict(nodes=((0, 1, ("X",)),), joiners=("X",)),
        id="drain of group rank 0",
    ),
    pytest.param(
        plan(1, "ab"),
        plan(1, "ab").next(nodes=tuple("abcd"), joiners=tuple("abcd")),
        dict(nodes=((2, 2, ("c", "d")),), every_node_joins=True),
        id="scale-up: appended",
    ),
    pytest.param(
        plan(5, "abcd"),
        plan(5, "abcd").next(joiners=tuple("abcd"), restarts=1, live=False),
        dict(nodes=(), every_node_joins=True),
        id="restart in place: nodes unchanged",
    ),
    pytest.param(
        plan(5, "abcd"),
        plan(5, "abcd").next(state=SUCCEEDED, reason="training finished"),
        dict(nodes=(), joiners=(), every_node_joins=False),
        id="finish",
    ),
    pytest.param(
        plan(5, "abcd"),
        plan(5, "abcd").next(state=FAILED, removed=("a", "b"), reason="no spare left"),
        dict(nodes=(), joiners=()),
        id="failed",
    ),
    pytest.param(
        Plan(generation=5, nodes=(), nproc=2),
        Plan(generation=5, nodes=(), nproc=2).next(),
        dict(nodes=(), every_node_joins=False),
        id="no nodes at all",
    ),
    pytest.param(
        plan(7, "abcdefgh", live=True),
        plan(7, "abcdefgh", live=True).next(nodes=tuple("aXcdefYh"), joiners=("X", "Y")),
        dict(nodes=((1, 2, ("X",)), (6, 7, ("Y",)))),
        id="two losses far apart: two splices, nothing between them",
    ),
]


@pytest.mark.parametrize("previous, new, shape", CASES)
def test_round_trip(previous, new, shape):
    delta = plan_delta(previous, new)
    assert {k: getattr(delta, k) for k in shape} == shape
    assert delta.generation == new.generation
    assert PlanDelta.from_json(delta.to_json()) == delta
    assert round_trip(previous, new) == new


def test_random_run_of_events_at_64_nodes():
    """Losses, drains, restarts in place, successes: every plan the planner makes along the way
    is rebuilt exactly from the previous one and its delta."""
    rng = random.Random(1234)
    lim = Limits(min_nodes=48, max_nodes=60, nproc=1, max_restarts=10_000)
    alive = {
        f"n{i:03d}": NodeInfo(
            id=f"n{i:03d}", host="h", addr=f"10.0.{i // 250}.{i % 250}", store_port=1000 + i, nproc=1, pid=i, joined=float(i)
        )
        for i in range(64)
    }
    joined = 64
    current = None
    rebuilt = 0
    for _ in range(300):
        view = View(plan=current, alive=dict(alive), live=rng.random() < 0.7, last_call_passed=True, now=1.0)
        if current is not None and not current.finished:
            roll = rng.random()
            active = list(current.nodes)
            if roll < 0.4:
                alive.pop(rng.choice(active), None)  # a node lost
            elif roll < 0.6:
                view = dataclasses.replace(view, drains={rng.choice(active): "drain"})
            elif roll < 0.7:
                node = rng.choice(active)
                view = dataclasses.replace(view, reports={node: "worker exited"}, report_kinds={node: "signal"})
            elif roll < 0.72:
                view = dataclasses.replace(view, done=frozenset(active))
            while len(spares(view)) < 3:  # new spares keep arriving
                node = f"n{joined:03d}"
                alive[node] = NodeInfo(
                    id=node, host="h", addr="10.1.0.1", store_port=2000 + joined % 60000, nproc=1, pid=joined, joined=float(joined)
                )
                joined += 1
                view = dataclasses.replace(view, alive=dict(alive))
        new = next_plan(dataclasses.replace(view, alive=dict(alive)), lim)
        if new is None:
            continue
        assert round_trip(current, new) == new
        rebuilt += 1
        current = None if new.finished else new  # a finished job: the next one starts from scratch
    assert rebuilt > 100


def replacement(n: int) -> tuple[Plan, Plan]:
    """A live job of ``n`` nodes (ids of equal length) in which the middle node is replaced by a spare."""
    ids = tuple(f"n{i:04d}" for i in range(n))
    lost = ids[n // 2]
    before = Plan(generation=9, nodes=ids, nproc=8, live=True, store={"node": ids[0], "addr": "10.0.0.1", "port": 29500}, created=1.5)
    return before, before.next(
        nodes=ids[: n // 2] + ("s0001",) + ids[n // 2 + 1 :],
        joiners=("s0001",),
        replaced={"s0001": lost},
        removed=(lost,),
        cause=f"{lost}: node lost (lease expired)",
        restarts=1,
        created=2.5,
    )


@pytest.mark.parametrize("n", [256, 1024])
def test_a_replacement_delta_does_not_grow_with_the_job(n):
    """What a follower reads per event: a loss replaced by a spare costs the same bytes at 16
    and at 1,024 nodes but for the digits of its position, where the plan grows by a node id
    per node."""
    before, after = replacement(n)
    size, at_16 = len(plan_delta(before, after).to_json()), len(plan_delta(*replacement(16)).to_json())
    assert size - at_16 == 2 * (len(str(n // 2)) - len(str(16 // 2))) and size < 700
    assert len(after.to_json()) > 8 * n


def node(n: str) -> NodeInfo:
    return NodeInfo(id=n, host="h", addr="10.0.0.1", store_port=29500, nproc=2, pid=7, joined=1.0)


RECORDS = {n: node(n) for n in "abcdXY"}


@pytest.mark.parametrize(
    "previous, new, sent",
    [
        pytest.param(
            None,
            Plan(generation=0, nodes=tuple("abcd"), nproc=2, joiners=tuple("abcd")),
            "",
            id="formation: every node is new and reads the whole state, so none is sent",
        ),
        pytest.param(
            plan(3, "abcd", live=True),
            plan(3, "abcd", live=True).next(nodes=tuple("abXd"), joiners=("X",), removed=("c",)),
            "X",
            id="loss: the spare that took over",
        ),
        pytest.param(
            plan(3, "abcd"),
            plan(3, "abcd").next(nodes=tuple("abcdXY"), joiners=tuple("abcdXY")),
            "XY",
            id="scale-up, every worker restarts: the appended nodes only",
        ),
        pytest.param(
            plan(3, "abcd"),
            plan(3, "abcd").next(nodes=tuple("abcd"), joiners=("b",)),
            "b",
            id="a joiner already in the plan: its workers start again",
        ),
        pytest.param(plan(3, "abcd"), plan(3, "abcd").next(joiners=tuple("abcd")), "", id="restart in place: records held"),
        pytest.param(
            plan(3, "abcd", live=True),
            plan(3, "abcd", live=True).next(nodes=tuple("abZd"), joiners=("Z",)),
            "",
            id="a record the planner does not hold is left to the follower to read",
        ),
    ],
)
def test_the_delta_carries_the_records_a_follower_lacks(previous, new, sent):
    delta = plan_delta(previous, new, RECORDS)
    assert [r.id for r in delta.records] == list(sent)
    again = PlanDelta.from_json(delta.to_json())
    assert again == delta and all(isinstance(r, NodeInfo) for r in again.records)
    assert plan_delta(previous, new).records == ()  # no records given: none sent
    assert plan_delta(previous, new).spares is None and PlanDelta.from_json(plan_delta(previous, new, spares=2).to_json()).spares == 2


def test_a_plans_json_is_what_it_always_was():
    """``to_json`` no longer goes through ``asdict`` (a deep copy, 1 ms for a 1,024-node plan);
    the text, which the digest hashes and history keeps, is unchanged."""
    p = replacement(64)[1]
    assert p.to_json() == json.dumps(dataclasses.asdict(p), sort_keys=True)
    assert node("a").to_json() == json.dumps(dataclasses.asdict(node("a")), sort_keys=True)


GEN3 = plan(3, "abcd", live=True)
GEN4 = GEN3.next(nodes=tuple("abXd"), joiners=("X",), replaced={"X": "c"}, removed=("c",))


@pytest.mark.parametrize(
    "held, delta, why",
    [
        pytest.param(
            GEN3.next(), plan_delta(GEN3, GEN4), "applies to generation 3, this node holds 4", id="a generation in between was missed"
        ),
        pytest.param(None, plan_delta(GEN3, GEN4), "holds None", id="no plan held"),
        pytest.param(GEN3, plan_delta(None, GEN3), "applies to generation None", id="a formation delta over a held plan"),
        pytest.param(
            dataclasses.replace(GEN3, nodes=tuple("abc")),
            plan_delta(GEN3, GEN4),
            "digest differs",
            id="same generation, other nodes: the rebuilt plan is not the published one",
        ),
        pytest.param(
            dataclasses.replace(GEN3, nodes=tuple("ab")), plan_delta(GEN3, GEN4), "does not fit 2 node(s)", id="splice beyond the node list"
        ),
        pytest.param(GEN3, dataclasses.replace(plan_delta(GEN3, GEN4), nodes=((3, 1, ()),)), "does not fit", id="splice backwards"),
        pytest.param(
            GEN3,
            dataclasses.replace(plan_delta(GEN3, GEN4), fields={**plan_delta(GEN3, GEN4).fields, "nproc": "8"}),
            "unreadable",
            id="a field of the wrong type",
        ),
        pytest.param(
            GEN3,
            dataclasses.replace(plan_delta(GEN3, GEN4), fields={**plan_delta(GEN3, GEN4).fields, "nodes": []}),
            "unreadable",
            id="fields may not carry the node list",
        ),
    ],
)
def test_a_delta_that_does_not_fit_is_refused(held, delta, why):
    with pytest.raises(DeltaMismatch, match=why.replace("(", r"\(").replace(")", r"\)")):
        apply_delta(held, delta)


@pytest.mark.parametrize(
    "text",
    [
        "garbage {",
        "[1]",
        "null",
        "1e999",
        "[" * 100_000 + "]" * 100_000,
        json.dumps({"previous": 1}),
        json.dumps({**json.loads(plan_delta(GEN3, GEN4).to_json()), "extra": 1}),
        json.dumps({**json.loads(plan_delta(GEN3, GEN4).to_json()), "previous": True}),
        json.dumps({**json.loads(plan_delta(GEN3, GEN4).to_json()), "nodes": [[0, 1]]}),
        json.dumps({**json.loads(plan_delta(GEN3, GEN4).to_json()), "nodes": [[0, "1", ["x"]]]}),
        json.dumps({**json.loads(plan_delta(GEN3, GEN4).to_json()), "joiners": [1]}),
        json.dumps({**json.loads(plan_delta(GEN3, GEN4).to_json()), "fields": []}),
        json.dumps({**json.loads(plan_delta(GEN3, GEN4).to_json()), "digest": 5}),
        json.dumps({**json.loads(plan_delta(GEN3, GEN4).to_json()), "spares": -1}),
        json.dumps({**json.loads(plan_delta(GEN3, GEN4).to_json()), "spares": "2"}),
        json.dumps({**json.loads(plan_delta(GEN3, GEN4).to_json()), "spares": True}),
        json.dumps({**json.loads(plan_delta(GEN3, GEN4).to_json()), "records": {}}),
        json.dumps({**json.loads(plan_delta(GEN3, GEN4).to_json()), "records": [1]}),
        json.dumps({**json.loads(plan_delta(GEN3, GEN4).to_json()), "records": [{"id": "X"}]}),
        json.dumps(
            {**json.loads(plan_delta(GEN3, GEN4, RECORDS).to_json()), "records": [{**json.loads(node("X").to_json()), "store_port": 0}]}
        ),
    ],
)
def test_unreadable_delta_is_a_value_error(text):
    """etcd content is input: whatever is under the delta's key fails as ValueError, nothing else."""
    with pytest.raises(ValueError):
        apply_delta(GEN3, PlanDelta.from_json(text))
