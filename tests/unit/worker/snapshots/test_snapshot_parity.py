"""``--snapshot-parity``: the groups and stripe holders (table), the XOR codec, a holder's
parity over a real socket, a lost rank's snapshot rebuilt by real ``Snapshots`` bitwise, and
the recovery planner's parity cases."""

import contextlib
import random

import pytest
import torch

from tm_launch.worker.generation.recovery import Holding, ObjectState, plan_recovery
from tm_launch.worker.snapshots.link import SnapshotClient, SnapshotServer
from tm_launch.worker.snapshots.parity import stripe, unstripe, xor_into
from tm_launch.worker.snapshots.placement import parity_group, parity_holders, stripes_held


def stripe_size(total: int, j: int, h: int, unit: int) -> int:
    """Bytes of stripe ``j`` of ``h`` of a share of ``total`` bytes (what ``stripe`` must give)."""
    full, rest = divmod(total, unit)
    return (full // h + (1 if full % h > j else 0)) * unit + (rest if full % h == j else 0)


def as_bytes(pieces) -> torch.Tensor:
    """One uint8 tensor of ``pieces`` (memoryviews) in order."""
    return torch.cat([torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in pieces]) if pieces else torch.empty(0, dtype=torch.uint8)


@pytest.mark.parametrize(
    "world, local_world, k, groups, holders",
    [
        pytest.param(4, 1, 2, [[0, 1], [0, 1], [2, 3], [2, 3]], [[2, 3], [2, 3], [0, 1], [0, 1]], id="4 nodes, K=2"),
        pytest.param(
            8, 2, 2, [[0, 2], [1, 3], [0, 2], [1, 3], [4, 6], [5, 7], [4, 6], [5, 7]],
            [[4, 6], [5, 7], [4, 6], [5, 7], [0, 2], [1, 3], [0, 2], [1, 3]], id="2 per node: same local rank",
        ),
        pytest.param(5, 1, 2, [[0, 1], [0, 1], [2, 3], [2, 3], [4]], [[2, 3], [2, 3], [4, 0], [4, 0], [0, 1]], id="a smaller last group"),
        pytest.param(3, 1, 2, [[0, 1], [0, 1], [2]], [[2], [2], [0, 1]], id="K+1 nodes: one stripe holder"),
        pytest.param(2, 1, 4, [[0], [1]], [[1], [0]], id="2 nodes: K shrinks to 1 (a copy)"),
        pytest.param(6, 1, 3, [[0, 1, 2]] * 3 + [[3, 4, 5]] * 3, [[3, 4, 5]] * 3 + [[0, 1, 2]] * 3, id="K=3"),
        pytest.param(1, 1, 2, [[0]], [[]], id="one rank: nobody"),
    ],
)  # fmt: skip
def test_parity_groups_and_their_stripe_holders(world, local_world, k, groups, holders):
    assert [parity_group(r, world, local_world, k) for r in range(world)] == groups
    assert [parity_holders(r, world, local_world, k) for r in range(world)] == holders
    per_node = local_world if local_world < world else 1
    node = lambda r: r // per_node  # noqa: E731
    for r in range(world):
        # One node's loss never takes a member of a group and a stripe of the same group's parity.
        assert not {node(m) for m in groups[r]} & {node(h) for h in holders[r]}
        assert len({node(m) for m in groups[r]}) == len(groups[r])  # one member per node
        for j, h in enumerate(holders[r]):
            assert (groups[r][0], j, len(holders[r])) in stripes_held(h, world, local_world, k)
    held = [s for r in range(world) for s in stripes_held(r, world, local_world, k)]
    assert len(held) == len({s for s in held})  # no stripe kept twice


@pytest.mark.parametrize("unit", [64, 128])
@pytest.mark.parametrize("h", [1, 2, 3])
def test_stripes_put_back_together_and_a_lost_member_is_the_xor_of_the_rest(unit, h):
    """Three members of different sizes (multiples of 64 bytes), given as several pieces: each
    stripe's size is what ``stripe_size`` says; the parity stripes (XOR of every member's) with
    two members XORed out again give the third exactly."""
    rng = random.Random(h * unit)
    members = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (64 * 7, 64 * 3, 64 * 11)]
    parity = [torch.zeros(max(stripe_size(m.numel(), j, h, unit) for m in members), dtype=torch.uint8) for j in range(h)]
    for m in members:
        cut = sorted(rng.sample(range(1, m.numel()), 3))
        pieces = [memoryview(m[a:b].numpy()) for a, b in zip([0, *cut], [*cut, m.numel()])]
        assert torch.equal(unstripe([as_bytes(stripe(pieces, j, h, unit)) for j in range(h)], m.numel(), unit), m)
        for j in range(h):
            got = as_bytes(stripe(pieces, j, h, unit))
            assert got.numel() == stripe_size(m.numel(), j, h, unit)
            xor_into(parity[j], got)
    lost = 2
    rebuilt = unstripe(parity, members[lost].numel(), unit)
    for i, m in enumerate(members):
        if i != lost:
            xor_into(rebuilt, m[: min(m.numel(), rebuilt.numel())])
    assert torch.equal(rebuilt, members[lost])


def test_a_holder_keeps_the_xor_once_per_member_and_step_and_says_who_went_in():
    """Two members put their stripe 0 of 1 for step 3 into a real holder; member 0 puts it again
    (a step sent again after a recovery): not XORed twice. The holder answers with the parity
    and who went into it; a stripe of a group it does not keep is refused, not stored."""
    holder = SnapshotServer("127.0.0.1")
    holder.keep_only([], [(0, 0, 1)])
    a, b = (torch.randint(0, 256, (256,), dtype=torch.uint8) for _ in range(2))
    try:
        for source, data in [(0, a), (1, b), (0, a)]:
            client = SnapshotClient(holder.address, source=source)
            meta = {"names": ("model",), "nbytes": data.numel()}
            assert client.put_stripe(0, 0, 1, 3, meta, [memoryview(data.numpy())], keep_from=3)
            client.close()
        assert holder.stripes_held() == {(0, 0, 1): {3: {0: ("model",), 1: ("model",)}}}
        client = SnapshotClient(holder.address, source=2)
        reply, parity = client.get_stripe(0, 1, 3)
        assert torch.equal(parity, a ^ b) and reply["members"] == {0: ("model",), 1: ("model",)}
        assert client.get_stripe(0, 5, 3) is None  # rank 5 never went in
        assert not client.put_stripe(4, 0, 1, 3, {"names": ()}, [memoryview(a.numpy())], keep_from=3)
        assert holder.nbytes == 256
        client.close()
    finally:
        holder.close()


def _model(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16 + 8 * seed), torch.nn.ReLU(), torch.nn.Linear(16 + 8 * seed, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt}


def _flat(objects):
    return [t.clone() for t in objects["model"].state_dict().values()] + [
        v.clone() for s in objects["optimizer"].state.values() for v in s.values()
    ]


@contextlib.contextmanager
def _four_ranks_at_step_5(objects, per_rank=lambda r: None):
    """Four ranks' real ``Snapshots`` (one per node, ``--snapshot-parity 2``) that took and
    sent their snapshot of step 5 (rank r's objects: ``objects[r]``), and a fresh one (a
    joiner). Every holder is ready before any stripe is sent, as in a generation."""
    from tm_launch.worker.snapshots.service import Snapshots

    snaps = [Snapshots("127.0.0.1", every=1, memory_limit=0, local_world=1, parity=2) for _ in range(5)]
    endpoint = lambda r: snaps[r].server.address  # noqa: E731
    try:
        for r, s in enumerate(snaps[:4]):
            s.enter(r, 4, endpoint)
            s.set_remote(["model", "optimizer"], generation=0)
        for r, s in enumerate(snaps[:4]):
            s.boundary(5, objects[r], per_rank(r))
        assert all(s.ready_to_commit(5, give_up=lambda: False) for s in snaps[:4])
        yield snaps, endpoint
    finally:
        for s in snaps:
            s.close()


def test_a_lost_ranks_snapshot_is_rebuilt_bitwise_from_the_parity_and_its_group():
    """Four ranks, one per node, groups of 2: ranks 0 and 1 (models of different sizes) send
    their snapshots of step 5 into the parity kept in stripes by ranks 2 and 3. A new process
    for rank 0 rebuilds rank 0's snapshot from both stripes and rank 1's own snapshot: bitwise
    the state rank 0 had, its per-rank state with it."""
    objects = [_model(r) for r in range(4)]
    with _four_ranks_at_step_5(objects, per_rank=lambda r: {"rng": {"rank": r}}) as (snaps, endpoint):
        assert snaps[2].server.stripes_held() == {(0, 0, 2): {5: {0: ("model", "optimizer"), 1: ("model", "optimizer")}}}
        assert "into the parity of ranks [0, 1], in 2 stripe(s) kept by rank(s) [2, 3]" == snaps[0].describe_placement()
        joiner = snaps[4]
        joiner.enter(0, 4, endpoint)
        image, moved = joiner.rebuild([2, 3], 0, 0, 5, {1: ("model", "optimizer")})
        assert moved >= 2 * image.nbytes  # the parity's stripes and rank 1's share (bigger than rank 0's)
        fresh = _model(0)  # rank 0's shapes, other values
        for p in fresh["model"].parameters():
            p.data.add_(1.0)
        image.load_into(fresh)
        assert all(torch.equal(a, b) for a, b in zip(_flat(fresh), _flat(objects[0])))
        assert image.per_rank == {"rng": {"rank": 0}}


def test_a_step_the_job_returned_to_keeps_the_image_that_went_into_the_parity():
    """After a recovery to step 5 the step's boundary comes again: with parity the member keeps
    the image whose bytes it XORed in (a rebuild reads it), and sends nothing new."""
    objects = [_model(0) for _ in range(4)]
    with _four_ranks_at_step_5(objects) as (snaps, _):
        kept, sent = snaps[1]._own_image(5), snaps[1].bytes_sent
        snaps[1].settle(5)
        snaps[1].boundary(5, objects[1], None)
        assert snaps[1].ready_to_commit(5, give_up=lambda: False)
        assert snaps[1]._own_image(5) is kept and snaps[1].bytes_sent == sent


def test_a_rebuilt_snapshot_that_does_not_match_its_fingerprints_is_an_error():
    """Rank 1's own snapshot changed after it went into the parity (it never does: a stand-in
    for any wrong byte): the rebuild is refused, not loaded."""
    from tm_launch.worker.snapshots.link import LinkError

    with _four_ranks_at_step_5([_model(0) for _ in range(4)]) as (snaps, _):
        snaps[1]._own_image(5).flat.add_(1)
        with pytest.raises(LinkError, match="does not match its fingerprints"):
            snaps[3].rebuild([2, 3], 0, 0, 5, {1: ("model", "optimizer")})


def P(rank, step, local=(), stripes=None):
    """FSDP-like: every rank alone holds its shard."""
    return Holding(
        rank=rank,
        step=step,
        objects={"state": ObjectState(frozenset({rank}), "s", "v")},
        local={s: {"state": ("s", "v")} for s in local},
        stripes=stripes or {},
    )


def parity_of(step_members: dict, group=0, j=0, h=2) -> dict:
    return {(group, j, h): {s: {m: ("state",) for m in ms} for s, ms in step_members.items()}}


@pytest.mark.parametrize(
    "holdings, want_step, want_parity, want_missing",
    [
        pytest.param(
            [P(0, 7, (6, 7)), P(1, -1), P(2, 7, (6, 7), parity_of({6: [0, 1], 7: [0, 1]})), P(3, 7, (6, 7), parity_of({7: [0, 1]}, j=1))],
            7, {1: (0, [2, 3], {0: ("state",)}, ["state"])}, [],
            id="both stripes of the interrupted step: rebuilt there",
        ),
        pytest.param(
            [P(0, 7, (6, 7)), P(1, -1), P(2, 7, (6, 7), parity_of({6: [0, 1], 7: [0]})), P(3, 7, (6, 7), parity_of({6: [0, 1], 7: [0]}, j=1))],
            6, {1: (0, [2, 3], {0: ("state",)}, ["state"])}, [],
            id="its stripe of the interrupted step was on its way: one step back",
        ),
        pytest.param(
            [P(0, 7, (6, 7)), P(1, -1), P(2, 7, (6, 7), parity_of({7: [0, 1]})), P(3, -1)],
            7, {}, [1, 3],
            id="a stripe holder's node lost with it: loud (rank 3's own parity is not kept here either)",
        ),
        pytest.param(
            [P(0, -1), P(1, -1), P(2, 7, (7,), parity_of({7: [0, 1]})), P(3, 7, (7,), parity_of({7: [0, 1]}, j=1))],
            7, {}, [0, 1],
            id="two members of one group lost: loud",
        ),
        pytest.param(
            [P(0, 7, (7,)), P(1, -1), P(2, 7, (7,), parity_of({7: [0, 1]})), P(3, 7, (7,), parity_of({7: [1]}, j=1))],
            7, {}, [1],
            id="the stripes disagree on who went in: never a source",
        ),
    ],
)  # fmt: skip
def test_the_planner_rebuilds_from_parity_only_when_every_piece_is_alive(holdings, want_step, want_parity, want_missing):
    plan = plan_recovery(holdings)
    assert (plan.step, plan.parity, plan.missing) == (want_step, want_parity, want_missing)
