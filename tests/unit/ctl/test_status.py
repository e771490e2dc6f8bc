"""``tm-launch ctl status``'s pure parts: the nodes that left the job, from its plan history."""

from rendezvous.plan import Plan
from tm_launch.ctl.commands import departures


def plan(gen, nodes, **fields):
    return Plan(generation=gen, nodes=tuple(nodes), nproc=1, **fields)


def test_replaced_and_removed_nodes_are_known_from_the_history():
    history = [
        plan(2, "ad", replaced={"d": "c"}, removed=("c",)),  # given out of order: sorted by generation
        plan(0, "ab"),
        plan(1, "ac", replaced={"c": "b"}, removed=("b",)),
        plan(3, "ad", removed=("x",)),
    ]
    assert departures(history) == {
        "b": ("replaced", "by c in generation 1"),
        "c": ("replaced", "by d in generation 2"),
        "x": ("removed", "in generation 3"),
    }


def test_a_node_back_in_the_job_has_not_left():
    history = [plan(0, "ab"), plan(1, "ac", replaced={"c": "b"}, removed=("b",)), plan(2, "cb", replaced={"b": "a"}, removed=("a",))]
    assert departures(history) == {"a": ("replaced", "by b in generation 2")}
