"""Whom survivors wait for past their patience: a generation's joiners still warming up, as their
agents' progress records say (``failures.joiners_warming_up``), as a table."""

import pytest

from rendezvous.plan import Plan
from tm_launch.launcher.failures import FRESH_PROGRESS_S, joiners_warming_up

NOW = 1000.0
PLAN = Plan(generation=3, nodes=("a", "s1", "s2"), nproc=2, joiners=("s1", "s2"), replaced={"s1": "b", "s2": "c"}, live=True)


def record(*states, age=0.5):
    return {"time": NOW - age, "workers": {str(i): {"state": s} for i, s in enumerate(states)}}


CASES = [
    ("no records: the joiners' agents are gone", {}, []),
    ("both warming up in the sandbox", {"s1": record("sandbox", "sandbox"), "s2": record("warmup", "warmup")}, ["s1", "s2"]),
    ("one worker still in its warm-up steps", {"s1": record("parked", "warmup")}, ["s1"]),
    ("parked: warm, the wait is for something else", {"s1": record("parked", "parked")}, []),
    ("entering or running: in the generation already", {"s1": record("running", "running"), "s2": record("entering")}, []),
    ("a stale record: an agent that stopped publishing", {"s1": record("sandbox", age=FRESH_PROGRESS_S + 1)}, []),
    ("a record without a time", {"s1": {"workers": {"0": {"state": "sandbox"}}}}, []),
    ("a survivor's record does not count", {"a": record("sandbox")}, []),
]


@pytest.mark.parametrize("name,progress,want", CASES, ids=[c[0] for c in CASES])
def test_joiners_warming_up(name, progress, want):
    assert joiners_warming_up(PLAN, progress, NOW) == want
