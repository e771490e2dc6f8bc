"""``replicas.FoundReplicas``, ``refine``, ``plain_digest``, ``most_surveyed``: which ranks hold
the same copy of an undeclared object, measured (pure, table tests)."""

import pytest
import torch

from tm_launch.worker.generation.audit import tensor_digest
from tm_launch.worker.state.replicas import SURVEY_ROUNDS, FoundReplicas, most_surveyed, plain_digest, refine


def records(**by_name):
    """name -> list of each rank's digest (index = rank) -> the all-gather's records."""
    world = len(next(iter(by_name.values())))
    return [(r, {name: digests[r] for name, digests in by_name.items() if digests[r] is not None}) for r in range(world)]


@pytest.mark.parametrize(
    "digests, want",
    [
        (["a", "a", "a", "a"], ((0, 1, 2, 3),)),  # plain DDP: the world
        (["a", "b", "a", "b"], ((0, 2), (1, 3))),  # dp x tp positions seeded differently
        (["a", "b", "c", "d"], ((0,), (1,), (2,), (3,))),  # every rank its own
        (["a", "a", None, "a"], ((0, 1, 3), (2,))),  # a rank that did not report it: its own
    ],
)
def test_one_round_groups_ranks_by_digest(digests, want):
    found = refine(FoundReplicas(), records(model=digests))
    assert found.rounds == 1 and found.classes["model"] == want


def test_a_later_round_only_narrows():
    """Equal at the first boundary, different after an update: not replicas. Different first and
    equal later (a coincidence): still not replicas."""
    first = refine(FoundReplicas(), records(model=["a", "a", "a", "a"], opt=["x", "y", "x", "y"]))
    second = refine(first, records(model=["b", "c", "b", "c"], opt=["z", "z", "z", "z"]))
    assert second.classes == {"model": ((0, 2), (1, 3)), "opt": ((0, 2), (1, 3))}
    assert second.rounds == SURVEY_ROUNDS and second.done


def test_an_object_registered_after_a_round_is_every_ranks_own():
    first = refine(FoundReplicas(), records(model=["a", "a"]))
    second = refine(first, records(model=["a", "a"], late=["q", "q"]))
    assert second.classes["late"] == ((0,), (1,))


@pytest.mark.parametrize(
    "found, name, rank, want",
    [
        (FoundReplicas(), "model", 1, {0, 1, 2, 3}),  # before the first round: the world bounds it
        (FoundReplicas(1, {"model": ((0, 2), (1, 3))}), "model", 3, {1, 3}),
        (FoundReplicas(1, {"model": ((0, 2), (1, 3))}), "other", 3, {3}),  # never surveyed: its own
    ],
)
def test_of(found, name, rank, want):
    assert found.of(name, rank, 4) == frozenset(want)


def test_most_surveyed_takes_the_most_rounds_and_a_fresh_process_brings_none():
    one, two = FoundReplicas(1, {"m": ((0, 1),)}), FoundReplicas(2, {"m": ((0,), (1,))})
    assert most_surveyed([None, one, two, one]) is two
    assert most_surveyed([None, None]) is None


def test_plain_digest_is_exact_and_skips_what_is_not_state():
    t = torch.arange(6, dtype=torch.float32)
    u = t.clone()
    u[5] = torch.nextafter(u[5], torch.tensor(100.0))  # one ulp
    assert plain_digest({"w": t}, tensor_digest) == plain_digest({"w": t.clone()}, tensor_digest)
    assert plain_digest({"w": t}, tensor_digest) != plain_digest({"w": u}, tensor_digest)
    assert plain_digest({"lr": 0.1}, tensor_digest) != plain_digest({"lr": 0.2}, tensor_digest)
    # a function in a scheduler's state (its repr names an address) says nothing about training
    assert plain_digest({"f": lambda: 1, "n": 3}, tensor_digest) == plain_digest({"f": lambda: 2, "n": 3}, tensor_digest)
