"""Per-rank state found without registration (module buffers, the global RNGs) and the audit's rule."""

import random

import pytest
import torch

from tm_launch.worker.generation.audit import digests, disagreements, tensor_digest
from tm_launch.worker.state.per_rank import AUTO_RNG, ModuleBuffers, PerRankState, RNGState
from tm_launch.worker.state.transfer import cpu_copy


def bn_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))


def test_module_buffers_round_trip_in_place_and_skip_non_persistent_ones():
    model = bn_model()
    model.register_buffer("table", torch.arange(3.0), persistent=False)  # built from the config: not state
    model(torch.randn(8, 3))
    buffers = ModuleBuffers(model, "model")
    assert buffers.keys() == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    saved = cpu_copy(buffers.state_dict())  # a state_dict is a view of the packing, copied as per_rank copies it
    held = model[1].running_mean  # DDP and the script hold this tensor object
    model(torch.randn(8, 3))  # the step's forward moved them
    assert not torch.equal(model[1].running_mean, saved["flat"]["cpu|float32"][:4])
    buffers.load_state_dict(saved)
    assert model[1].running_mean is held and int(model[1].num_batches_tracked) == 1
    assert all(torch.equal(buffers.state_dict()["flat"][k], v) for k, v in saved["flat"].items())


def test_a_step_that_runs_again_starts_from_the_buffers_and_rng_it_started_with():
    model = bn_model()
    per_rank = PerRankState(rng=True)
    per_rank.add_buffers_of("model", model)
    per_rank.begin_step(0, None)
    first = model(torch.randn(8, 3) + torch.rand(1))  # forward: buffers move, the RNG draws
    per_rank.restore()
    again = model(torch.randn(8, 3) + torch.rand(1))
    assert torch.equal(first, again)
    assert per_rank.buffer_keys("model") == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}


@pytest.mark.parametrize(
    "registered, rng_default, expected",
    [
        ({}, True, {AUTO_RNG}),
        ({}, False, set()),
        ({"rng": RNGState()}, True, {"rng"}),  # the script's own replaces the automatic one
        ({"data": object()}, True, {AUTO_RNG, "data"}),
    ],
)
def test_the_global_rngs_are_per_rank_unless_the_script_says_otherwise(registered, rng_default, expected):
    per_rank = PerRankState(rng=rng_default)
    per_rank.add(registered)
    assert set(per_rank.objects) == expected
    assert set(per_rank.fresh().objects) == ({AUTO_RNG} if rng_default else set())


def test_a_per_rank_object_whose_load_does_not_take_is_named():
    class Forgetful:
        def state_dict(self):
            return {"position": torch.tensor(0)}

        def load_state_dict(self, state):
            pass  # takes effect "later": a joiner would start elsewhere

    per_rank = PerRankState()
    per_rank.add({"loader": Forgetful(), "rng": RNGState()})
    random.seed(5)
    states = {"loader": {"position": torch.tensor(7)}, "rng": RNGState().state_dict()}
    random.seed(6)
    per_rank.load(states)
    assert per_rank.differs_from(states) == ["loader"]


def test_tensor_digests_are_exact():
    t = torch.zeros(1000)
    d = tensor_digest(t)
    t[999] = 1e-30
    assert tensor_digest(t) != d
    assert tensor_digest(torch.zeros(1000, dtype=torch.float64)) != d  # the dtype counts
    assert digests({"a": {"b": torch.ones(2)}, "n": 3}) == {"a/b": tensor_digest(torch.ones(2))}


R = frozenset


@pytest.mark.parametrize(
    "records, found",
    [
        # two replicas agree
        ([(0, {"m": (R({1}), {"w": "x"})}), (1, {"m": (R({0}), {"w": "x"})})], []),
        # they differ in one tensor: named once
        ([(0, {"m": (R({1}), {"w": "x", "v": "y"})}), (1, {"m": (R({0}), {"w": "x", "v": "z"})})], [("m", "v", 0, 1)]),
        # a tensor only one of them has
        ([(0, {"m": (R({1}), {"w": "x"})}), (1, {"m": (R({0}), {"w": "x", "extra": "e"})})], [("m", "extra", 0, 1)]),
        # ranks that do not both say they replicate it are never compared (TP shards)
        ([(0, {"m": (R({1}), {"w": "x"})}), (1, {"m": (R(), {"w": "y"})})], []),
        ([(0, {"m": (R(), {"w": "x"})}), (1, {})], []),
        # DP x TP: 0~2 and 1~3 replicate; 0 and 1 hold different shards
        (
            [
                (0, {"m": (R({2}), {"w": "a"})}),
                (1, {"m": (R({3}), {"w": "b"})}),
                (2, {"m": (R({0}), {"w": "a"})}),
                (3, {"m": (R({1}), {"w": "B"})}),
            ],
            [("m", "w", 1, 3)],
        ),
    ],
)
def test_disagreements_are_between_ranks_that_both_claim_the_replica(records, found):
    assert disagreements(records) == found


def test_a_buffer_the_script_replaces_is_followed():
    """``self.count = self.count + 1`` replaces the buffer object: the packing notices."""
    model = bn_model()
    buffers = ModuleBuffers(model, "model")
    first = cpu_copy(buffers.state_dict())
    model[1].num_batches_tracked = model[1].num_batches_tracked + 5  # a new tensor object
    assert not all(torch.equal(buffers.state_dict()["flat"][k], v) for k, v in first["flat"].items())
    buffers.load_state_dict(first)
    assert int(model[1].num_batches_tracked) == 0


def test_a_frameworks_checkpoint_carries_the_buffers_left_out_of_what_replicas_compare():
    """A framework registers one object holding the model's state nested (HF's Trainer, Lightning):
    the buffers are found there by the memory they share, or by name in a copy."""
    model = bn_model()
    per_rank = PerRankState()

    class Checkpoint:
        def parts(self):
            return [model]

        def state_dict(self):
            return {"model": model.state_dict(), "copy": {k: v.clone() for k, v in model.state_dict().items()}, "step": 3}

    per_rank.add_buffers_of("trainer", Checkpoint())
    kept = per_rank.without_buffers("trainer", Checkpoint().state_dict())
    assert sorted(kept["model"]) == sorted(kept["copy"]) == ["0.bias", "0.weight", "1.bias", "1.weight", "2.bias", "2.weight"]
    assert kept["step"] == 3


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 4),
        torch.randn(4, 3).t(),  # not contiguous
        torch.arange(6, dtype=torch.int64),
        torch.tensor(7, dtype=torch.int64),  # 0-dim, as num_batches_tracked
        torch.randn(5).to(torch.bfloat16),  # no numpy dtype of its own
        torch.tensor([True, False, True]),
        torch.empty(0, 3),
        torch.get_rng_state(),
    ],
    ids=["float", "transposed", "int64", "0-dim", "bf16", "bool", "empty", "rng"],
)
def test_a_per_rank_record_reads_back_bitwise_with_plain_pickle(tensor):
    import pickle

    from tm_launch.worker.state.per_rank import dumps_record

    record = {"step": 3, "exact": True, "states": {"x": {"flat": {"a": tensor}, "layout": "[]"}, "py": random.getstate()}}
    back = pickle.loads(dumps_record(record))
    got = back["states"]["x"]["flat"]["a"]
    assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor)
    assert back["states"]["py"] == record["states"]["py"] and back["step"] == 3
    got.add_(1) if got.dtype != torch.bool else got.logical_not_()  # owns its memory: writable, not the original's
    assert not torch.equal(got, tensor) or tensor.numel() == 0
