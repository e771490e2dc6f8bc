"""The culprit rule (health/culprit.py) over recorded telemetry shapes."""

import pytest

from health.culprit import CUT, KILL, NONE, WAIT, GroupRecord, Limits, RankRecord, judge

LIM = Limits(floor=1.0, multiplier=10.0, alive_floor=10.0, alive_multiplier=10.0)
NODE2 = {0: "a", 1: "a", 2: "b", 3: "b"}  # 2 nodes x 2 ranks
NODE3 = {0: "a", 1: "b", 2: "c"}  # 3 nodes x 1 rank


def waiting(seq, waited, typical=0.01, gen=1, members=None):
    """A rank inside collective ``seq`` for ``waited`` seconds."""
    return GroupRecord(gen, seq, seq - 1, waited, typical, members)


def done(seq, typical=0.01, gen=1, members=None):
    """A rank whose last collective ``seq`` completed (it computes now)."""
    return GroupRecord(gen, seq, seq, 0.0, typical, members)


def rank(r, node, groups, frozen=False, idle=0.0, step=0.05, saving=0.0):
    return RankRecord(r, node, frozen, idle, step, groups, saving)


def world(records, node_of, **kw):
    return judge({r.rank: r for r in records}, sorted(node_of), node_of, limits=LIM, **kw)


def test_everybody_computing_is_nothing():
    v = world([rank(r, NODE3[r], {"w": done(10)}, idle=30.0) for r in range(3)], NODE3)
    assert v.action == NONE  # a long compute phase between collectives is never stuck


def test_a_short_wait_is_nothing_yet():
    recs = [rank(0, "a", {"w": waiting(11, 0.5)}), rank(1, "b", {"w": waiting(11, 0.5)}), rank(2, "c", {"w": done(10)}, frozen=True)]
    assert world(recs, NODE3).action == NONE  # under the 1 s floor


def test_the_floor_follows_the_groups_own_rhythm():
    slow = 0.5  # collectives of this group usually take 0.5 s: stuck only after 5 s
    recs = [
        rank(0, "a", {"w": waiting(11, 3.0, slow)}),
        rank(1, "b", {"w": waiting(11, 3.0, slow)}),
        rank(2, "c", {"w": done(10, slow)}, frozen=True),
    ]
    assert world(recs, NODE3).action == NONE
    recs[0] = rank(0, "a", {"w": waiting(11, 6.0, slow)})
    assert world(recs, NODE3).ranks == (2,)


@pytest.mark.parametrize("where", ["forward", "optimizer", "logging"])
def test_a_frozen_rank_that_never_entered_is_blamed(where):
    """SIGSTOP before the collective its peers wait in (the forward, the optimizer step, before
    the logging all-reduce): the peers are in #11, it last entered #10."""
    recs = [rank(0, "a", {"w": waiting(11, 1.5)}), rank(1, "b", {"w": done(10)}, frozen=True), rank(2, "c", {"w": waiting(11, 1.4)})]
    v = world(recs, NODE3)
    assert (v.action, v.ranks, v.nodes, v.group, v.seq) == (KILL, (1,), ("b",), "w", 11)
    assert "has not entered w#11" in v.evidence["culprits"]["1"]


def test_a_frozen_rank_inside_the_collective_is_blamed():
    """SIGSTOP in the middle of the backward's all-reduce: every rank entered #11, one froze."""
    recs = [
        rank(0, "a", {"w": waiting(11, 2.0)}),
        rank(1, "b", {"w": waiting(11, 2.0)}, frozen=True),
        rank(2, "c", {"w": waiting(11, 2.0)}),
    ]
    v = world(recs, NODE3)
    assert (v.action, v.ranks) == (KILL, (1,))
    assert "froze" in v.evidence["culprits"]["1"]


def test_every_rank_entered_and_none_frozen_is_ambiguous():
    recs = [rank(r, NODE3[r], {"w": waiting(11, 5.0)}) for r in range(3)]
    assert world(recs, NODE3).action == WAIT  # the watchdog stays armed


def test_an_alive_rank_that_has_not_entered_is_slow_until_the_alive_limit():
    """A data-loader stall, a slow checkpoint, a busy loop: the same shape; only time tells."""
    base = [rank(0, "a", {"w": waiting(11, 3.0)}), rank(2, "c", {"w": waiting(11, 3.0)})]
    v = world([*base, rank(1, "b", {"w": done(10)}, idle=3.0)], NODE3)
    assert v.action == WAIT and "not known yet" in v.why
    v = world([*base, rank(1, "b", {"w": done(10)}, idle=10.5)], NODE3)
    assert (v.action, v.ranks) == (KILL, (1,))
    v = world([*base, rank(1, "b", {"w": done(10)}, idle=10.5, step=2.0)], NODE3)
    assert v.action == WAIT  # its steps take 2 s: 20 s before it counts as stuck


@pytest.mark.parametrize(
    "idle, saving, frozen, action",
    [
        (10.5, 0.0, False, KILL),  # unmarked: a busy loop and a save look the same after 10 s
        (10.5, 10.5, False, WAIT),  # marked (job.checkpointing()): the checkpoint limit applies
        (899.0, 899.0, False, WAIT),
        (901.0, 901.0, False, KILL),  # a save that never ends is still found
        (3.0, 3.0, True, KILL),  # frozen while saving (SIGSTOP): at once, as ever
    ],
)
def test_a_rank_saving_a_checkpoint_gets_the_checkpoint_limit(idle, saving, frozen, action):
    """Rank 0 saves alone while its peers wait at the next all-reduce: normal for a rank-0 save."""
    lim = Limits(floor=1.0, multiplier=10.0, alive_floor=10.0, alive_multiplier=10.0, checkpoint=900.0)
    records = [rank(0, "a", {"w": done(10)}, idle=idle, saving=saving, frozen=frozen), rank(1, "b", {"w": waiting(11, idle)})]
    v = judge({r.rank: r for r in records}, [0, 1], {0: "a", 1: "b"}, limits=lim)
    assert v.action == action, v
    if action == WAIT:
        assert "saving a checkpoint" in v.why, v
    else:
        assert v.ranks == (0,), v


def test_two_alive_candidates_on_two_nodes_wait():
    recs = [rank(0, "a", {"w": waiting(11, 30.0)}), rank(1, "b", {"w": done(10)}, idle=30.0), rank(2, "c", {"w": done(10)}, idle=30.0)]
    assert world(recs, NODE3).action == WAIT


def test_the_chain_is_followed_to_the_rank_that_blocks_it():
    """DP x TP: rank 1 froze; its TP peer 0 waits in tp01; rank 2 waits in the world group for
    rank 0, which has not entered it but is itself blocked: rank 1 is blamed, never rank 0."""
    tp01, tp23 = (0, 1), (2, 3)
    recs = [
        rank(0, "a", {"tp01": waiting(5, 2.0, members=tp01), "w": done(3)}),
        rank(1, "a", {"tp01": done(4, members=tp01), "w": done(3)}, frozen=True),
        rank(2, "b", {"tp23": done(5, members=tp23), "w": waiting(4, 1.9)}),
        rank(3, "b", {"tp23": done(5, members=tp23), "w": waiting(4, 1.9)}),
    ]
    v = world(recs, NODE2)
    assert (v.action, v.ranks, v.nodes) == (KILL, (1,), ("a",))


def test_a_rank_blocked_elsewhere_is_never_blamed_even_when_nobody_else_is():
    recs = [
        rank(0, "a", {"tp": waiting(5, 20.0, members=(0, 1)), "w": done(3)}, idle=20.0),
        rank(1, "a", {"tp": waiting(5, 20.0, members=(0, 1)), "w": done(3)}, idle=20.0),
        rank(2, "b", {"w": waiting(4, 20.0)}),
        rank(3, "b", {"w": waiting(4, 20.0)}),
    ]
    assert world(recs, NODE2).action == WAIT


def test_the_commit_vote_counts_like_a_collective():
    recs = [
        rank(0, "a", {"tm-commit": waiting(7, 1.2)}),
        rank(1, "b", {"tm-commit": done(6)}, frozen=True),
        rank(2, "c", {"tm-commit": waiting(7, 1.2)}),
    ]
    assert world(recs, NODE3).ranks == (1,)


def test_a_partition_blames_the_unreachable_minority():
    recs = [rank(0, "a", {"w": waiting(11, 2.0)}), rank(2, "c", {"w": waiting(11, 2.0)})]
    v = world(recs, NODE3, unreachable={"b"})
    assert (v.action, v.nodes) == (CUT, ("b",))


def test_a_job_cut_in_halves_blames_the_half_that_stopped_writing_to_etcd():
    recs = [rank(0, "a", {"w": waiting(11, 2.0)}), rank(1, "a", {"w": waiting(11, 2.0)})]
    assert world(recs, NODE2, unreachable={"b"}).action == WAIT  # both halves may still reach etcd
    v = judge({r.rank: r for r in recs}, range(4), NODE2, {"b"}, LIM, silent={"b"})
    assert (v.action, v.nodes) == (CUT, ("b",))


def test_the_cut_side_blames_nobody():
    v = world([rank(1, "b", {"w": waiting(11, 2.0)})], NODE3, unreachable={"a", "c"})
    assert v.action == WAIT


def test_a_rank_of_another_generation_is_ambiguous():
    recs = [
        rank(0, "a", {"w": waiting(11, 2.0, gen=1)}),
        rank(1, "b", {"w": done(2, gen=2)}, idle=50.0),
        rank(2, "c", {"w": waiting(11, 2.0, gen=1)}),
    ]
    assert world(recs, NODE3).action == WAIT


def test_counters_that_disagree_are_ambiguous():
    """Rank 1 completed #11 while its peers wait in it: the sequence numbers do not line up."""
    recs = [rank(0, "a", {"w": waiting(11, 2.0)}), rank(1, "b", {"w": done(11)}, idle=50.0), rank(2, "c", {"w": waiting(11, 2.0)})]
    assert world(recs, NODE3).action == WAIT


def test_a_missing_record_is_ambiguous():
    recs = [rank(0, "a", {"w": waiting(11, 2.0)}), rank(2, "c", {"w": waiting(11, 2.0)})]
    assert world(recs, NODE3).action == WAIT


def test_members_unknown_are_never_judged():
    recs = [rank(0, "a", {"g": waiting(3, 9.0, members=())}), rank(1, "b", {"g": done(2, members=())}, frozen=True)]
    assert world(recs, {0: "a", 1: "b"}).action == NONE


def test_every_rank_frozen_is_no_culprit():
    """A whole machine stalled (every heartbeat late) must not kill the job's every worker."""
    recs = [rank(r, NODE2[r], {"w": waiting(11, 2.0)}, frozen=True) for r in range(4)]
    assert world(recs, NODE2).action == WAIT


def test_a_rank_not_in_the_stuck_group_is_not_blamed():
    """A subgroup (0, 1) is stuck on frozen rank 1; rank 2 and 3 compute, frozen or not."""
    recs = [
        rank(0, "a", {"s": waiting(4, 2.0, members=(0, 1))}),
        rank(1, "a", {"s": done(3, members=(0, 1))}, frozen=True),
        rank(2, "b", {}, idle=50.0),
        rank(3, "b", {}, idle=50.0),
    ]
    v = world(recs, NODE2)
    assert (v.action, v.ranks) == (KILL, (1,))


# -- progress evidence (health.progress): busy is not hung ---------------------------------------
def judged(r, node, groups, progress, still=0.0, idle=0.0, timeout=0.0, saving=0.0, where="evaluate() at train.py:88"):
    return RankRecord(
        r, node, False, idle, 0.05, groups, saving, progress, still, timeout, where, ("cpu 95%",) if progress == "busy" else ()
    )


PEERS_WAIT = [
    RankRecord(1, "b", False, 0.0, 0.05, {"w": waiting(11, 20.0)}),
    RankRecord(2, "c", False, 0.0, 0.05, {"w": waiting(11, 20.0)}),
]


@pytest.mark.parametrize(
    "rank0, action, why",
    [
        # rank 0 evaluates alone for 3 minutes, its peers at the next all-reduce: never before gloo's 30 min
        (judged(0, "a", {"w": done(10)}, "busy", idle=180.0, timeout=1800.0), WAIT, ""),
        (judged(0, "a", {"w": done(10)}, "busy", idle=1795.5, timeout=1800.0), KILL, "busy past the collective timeout"),
        # its collective timeout not known: gloo's default
        (judged(0, "a", {"w": done(10)}, "busy", idle=600.0), WAIT, ""),
        # --collective-timeout 30: blamed 5 s before its peers give up (they still wait in the collective that names it)
        (judged(0, "a", {"w": done(10)}, "busy", idle=24.0, timeout=30.0), WAIT, ""),
        (judged(0, "a", {"w": done(10)}, "busy", idle=25.5, timeout=30.0), KILL, "busy past the collective timeout"),
        # a sleep, a blocked read, a deadlock: nothing moved for the still floor (6 s)
        (judged(0, "a", {"w": done(10)}, "stuck", still=5.0, idle=12.0), WAIT, ""),
        (judged(0, "a", {"w": done(10)}, "stuck", still=6.5, idle=12.0), KILL, "stuck"),
        # ... faster than the alive floor the old rule had (10 s)
        (judged(0, "a", {"w": done(10)}, "stuck", still=6.5, idle=6.5), KILL, "stuck"),
        # marked as a checkpoint save: neither before the checkpoint limit (900 s)
        (judged(0, "a", {"w": done(10)}, "stuck", still=60.0, idle=60.0, saving=60.0), WAIT, ""),
        (judged(0, "a", {"w": done(10)}, "stuck", still=901.0, idle=901.0, saving=901.0), KILL, "stuck"),
    ],
)
def test_a_rank_outside_the_collective_is_judged_by_its_progress(rank0, action, why):
    v = world([rank0, *PEERS_WAIT], NODE3)
    assert v.action == action, v
    if action == KILL:
        assert v.ranks == (0,) and v.why == why
        assert v.evidence["progress"]["0"]["where"] == "evaluate() at train.py:88"
        assert v.evidence["progress"]["0"]["verdict"] == rank0.progress
    else:
        assert any("rank 0" in d for d in v.evidence["doubts"]), v.evidence


def test_a_busy_rank_is_named_where_it_is_in_the_doubts():
    v = world([judged(0, "a", {"w": done(10)}, "busy", idle=190.0, timeout=1800.0), *PEERS_WAIT], NODE3)
    assert "busy outside collectives for 190.0s in evaluate() at train.py:88 (blamed after 1795s)" in v.evidence["doubts"][0]


def test_a_frozen_rank_is_blamed_at_once_whatever_its_progress_said():
    stopped = RankRecord(0, "a", True, 1.5, 0.05, {"w": done(10)}, 0.0, "busy", 0.0, 1800.0)
    v = world([stopped, *PEERS_WAIT], NODE3)
    assert (v.action, v.ranks, v.why) == (KILL, (0,), "frozen")
