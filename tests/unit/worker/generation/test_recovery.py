"""``recovery.plan_recovery``: which step the job continues from and where each rank's state
comes from (pure, table tests; every rank computes the same plan from the same holdings)."""

import pytest

from tm_launch.worker.generation.recovery import Holding, ObjectState, plan_recovery


def H(rank, step, replicas, structure="s", values="v", per_rank=False, local=None, held=None, name="state"):
    """A rank holding one registered object ``name``."""
    return Holding(
        rank=rank,
        step=step,
        objects={name: ObjectState(frozenset(replicas), structure, values)},
        per_rank=per_rank,
        local=local or {},
        held=held or {},
    )


def sources(plan):
    """receiver -> its one live sender (single-object holdings)."""
    return {dst: next(iter(srcs)) for dst, srcs in plan.live.items()}


# The scenarios live substitution always had (every object replicated somewhere): same answers.
@pytest.mark.parametrize(
    "holdings, want_step, want_sources, want_missing",
    [
        pytest.param(
            [H(0, 5, {0, 2}), H(1, 5, {1, 3}), H(2, -1, {0, 2}), H(3, 5, {1, 3})],
            5,
            {2: 0},
            [],
            id="a joiner receives from the replica of its own shard",
        ),
        pytest.param(
            [H(0, 5, {0, 2}), H(1, 5, {1, 3}), H(2, 5, {0, 2}), H(3, -1, {1, 3})],
            5,
            {3: 1},
            [],
            id="never from the first rank at the newest step when that rank holds another shard",
        ),
        pytest.param(
            [H(0, -1, {0, 2}), H(1, -1, {1, 3}), H(2, 5, {0, 2}), H(3, 5, {1, 3})],
            5,
            {0: 2, 1: 3},
            [],
            id="two joiners, two different sources (in parallel)",
        ),
        pytest.param(
            [H(0, 5, {0, 1, 2, 3}), H(1, 5, {0, 1, 2, 3}), H(2, -1, {0, 1, 2, 3}), H(3, -1, {0, 1, 2, 3})],
            5,
            {2: 0, 3: 1},
            [],
            id="plain DP: joiners spread over the holders",
        ),
        pytest.param(
            [H(0, 5, {0}), H(1, 5, {1}), H(2, -1, {2}), H(3, 5, {3})],
            5,
            {},
            [2],
            id="no replica and no snapshot: the joiner's shard is missing",
        ),
        pytest.param(
            [H(0, 6, {0, 2}), H(1, 6, {1, 3}), H(2, 5, {0, 2}), H(3, 5, {1, 3})],
            6,
            {2: 0, 3: 1},
            [],
            id="ranks behind the newest committed step catch up from their replica",
        ),
        pytest.param(
            [H(0, 5, {0, 2}), H(1, 5, {1, 3}), H(2, -1, {0, 2}, structure="other"), H(3, 5, {1, 3})],
            5,
            {},
            [2],
            id="a source whose module shapes differ is no source",
        ),
    ],
)
def test_live_replicas(holdings, want_step, want_sources, want_missing):
    plan = plan_recovery(holdings)
    assert (plan.step, sources(plan), plan.missing) == (want_step, want_sources, want_missing)
    assert plan.restore == [] and plan.images == {}


def test_nobody_holds_state():
    assert plan_recovery([H(0, -1, {0, 1}), H(1, -1, {0, 1})]).step == -1


def test_replicas_that_disagree_are_reported():
    plan = plan_recovery([H(0, 5, {0, 1}, values="a"), H(1, 5, {0, 1}, values="b")])
    assert plan.conflicts == [(0, 1)]


def images(step_names: dict) -> dict:
    return {"images": {s: tuple(n) for s, n in step_names.items()}, "mirrors": {}}


# FSDP-like: every rank alone holds its shard; rank r's snapshot lives on rank (r + 1) % 3.
def F(rank, step, local=(), held=None, values="v"):
    return H(rank, step, {rank}, values=values, local={s: {"state": ("s", values)} for s in local}, held=held)


@pytest.mark.parametrize(
    "holdings, want",
    [
        pytest.param(
            [
                F(0, 7, local=(6, 7), held={2: images({6: ["state"], 7: ["state"]})}),
                F(1, -1),  # the joiner that replaces rank 1, whose snapshots rank 2 holds
                F(2, 7, local=(6, 7), held={1: images({6: ["state"], 7: ["state"]})}),
            ],
            (7, [], {1: (2, ["state"])}),
            id="the interrupted step's snapshot reached the holder: nothing runs again",
        ),
        pytest.param(
            [
                F(0, 7, local=(6, 7), held={2: images({6: ["state"], 7: ["state"]})}),
                F(1, -1),
                F(2, 7, local=(6, 7), held={1: images({6: ["state"]})}),
            ],
            (6, [0, 2], {1: (2, ["state"])}),
            id="its snapshot was still on its way: every rank returns one step",
        ),
        pytest.param(
            [F(0, 8, local=(7,), held={2: images({7: ["state"]})}), F(1, -1), F(2, 8, local=(7,), held={1: images({7: ["state"]})})],
            (7, [0, 2], {1: (2, ["state"])}),
            id="a failure after the commit, before the next snapshot: back to its start",
        ),
    ],
)
def test_snapshots(holdings, want):
    plan = plan_recovery(holdings)
    assert (plan.step, plan.restore, plan.images) == want and not plan.missing and not plan.live


def test_a_survivor_that_cannot_return_makes_the_step_impossible():
    """Rank 0 is at step 7 with no snapshot of 6; the joiner's snapshot exists only for 6: no
    step serves everyone, and the plan names the rank that cannot be served."""
    plan = plan_recovery([F(0, 7, local=(7,)), F(1, -1), F(2, 7, local=(6, 7), held={1: images({6: ["state"]})})])
    assert plan.missing and plan.step == 7 and plan.missing == [1]


def test_two_neighbours_lost_is_loud():
    """Ranks 1 and 2 are both new: rank 1's snapshot was on rank 2 (lost with it)."""
    plan = plan_recovery([F(0, 7, local=(6, 7), held={2: images({7: ["state"]})}), F(1, -1), F(2, -1)])
    assert plan.missing == [1]


def test_zero_style_each_object_from_its_own_source():
    """DDP + ZeRO: the model is replicated everywhere, each optimizer partition is its rank's
    alone. The joiner gets the model from a live replica and its partition from its snapshot."""

    def Z(rank, step, local=(), held=None):
        return Holding(
            rank=rank,
            step=step,
            objects={"model": ObjectState(frozenset({0, 1, 2}), "m", "w"), "optimizer": ObjectState(frozenset({rank}), "", f"o{rank}")},
            local={s: {"model": ("m", "w"), "optimizer": ("", f"o{rank}")} for s in local},
            held=held or {},
        )

    plan = plan_recovery(
        [Z(0, 4, (4,), held={2: images({4: ["optimizer"]})}), Z(1, -1), Z(2, 4, (4,), held={1: images({4: ["optimizer"]})})]
    )
    assert plan.step == 4 and plan.live == {1: {0: ["model"]}} and plan.images == {1: (2, ["optimizer"])}


def test_per_rank_state_comes_from_the_snapshot_or_an_exact_mirror():
    held_mirror = {"images": {}, "mirrors": {5: True}}
    ok = plan_recovery([H(0, 5, {0, 1}, per_rank=True, held={1: held_mirror}), H(1, -1, {0, 1}, per_rank=True)])
    assert ok.step == 5 and ok.mirrors == {1: 0} and ok.live == {1: {0: ["state"]}}
    inexact = plan_recovery(
        [H(0, 5, {0, 1}, per_rank=True, held={1: {"images": {}, "mirrors": {5: False}}}), H(1, -1, {0, 1}, per_rank=True)]
    )
    assert inexact.missing == [1]
    assert inexact.lacking() == "rank 1: its per-rank state at step 5 (mirrored only at its vote)"


def test_what_nothing_holds_is_named():
    """The plan says what a missing rank lacks: an object no other rank has at all (a joiner that
    found state of its own), a copy that is gone, or its per-rank state."""
    extra = Holding(1, -1, {"state": ObjectState(frozenset({0, 1}), "s", "v"), "Linear#0": ObjectState(frozenset({1}), "l", "w")})
    plan = plan_recovery([H(0, 5, {0, 1}), extra])
    assert plan.missing == [1] and plan.lacking() == "rank 1: Linear#0, which no other rank has"
    assert plan.tried == {5: "nothing holds rank(s) [1] (rank 1: Linear#0, which no other rank has)"}
    gone = plan_recovery([H(0, 5, {0}), H(1, -1, {1})])
    assert gone.lacking() == "rank 1: state (no live replica, no snapshot of step 5)"
    none = plan_recovery([H(0, 5, {0, 1}, per_rank=True), H(1, -1, {0, 1}, per_rank=True)])
    assert none.lacking() == "rank 1: its per-rank state at step 5 (no snapshot, no mirror)"
