"""``replica_survey.describe``: the survey's log line says what was measured (pure, table test)."""

import pytest

from tm_launch.worker.generation.replica_survey import NOTHING_PLAIN, describe
from tm_launch.worker.state.replicas import FoundReplicas


@pytest.mark.parametrize(
    "classes, unmeasured, line",
    [
        ({"model": ((0, 1),), "optimizer": ((0, 1),)}, set(), "model+optimizer: the world"),
        ({"model": ((0, 2), (1, 3)), "sched": ((0, 1, 2, 3),)}, set(), "model: [0, 2] [1, 3]; sched: the world"),
        # torchtitan's pipeline stages: DTensors only, different on every rank; the schedulers agree
        (
            {"model_0": ((0, 1),), "model_1": ((0, 1),), "lr_scheduler_0": ((0, 1),)},
            {"model_0", "model_1"},
            "lr_scheduler_0: the world; model_0+model_1: nothing plain to compare (their DTensor placements decide)",
        ),
        # found split: the partition is said, whatever this rank holds
        ({"model": ((0,), (1,))}, {"model"}, "model: [0] [1]"),
        ({}, set(), "nothing surveyed"),
    ],
)
def test_describe(classes, unmeasured, line):
    assert describe(FoundReplicas(2, classes), unmeasured) == line


def test_nothing_plain_is_the_digest_of_an_object_of_dtensors_only(fake_world):
    """What the survey digests of a torchtitan stage (``ModelTensors``: FSDP2's DTensors)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tm_launch.worker.generation.audit import tensor_digest
    from tm_launch.worker.state.replicas import plain_digest

    fake_world(0, 2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    stage = {"layers.0.weight": distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])}
    assert plain_digest([stage], tensor_digest) == NOTHING_PLAIN
    assert plain_digest([{**stage, "norm.weight": torch.ones(2)}], tensor_digest) != NOTHING_PLAIN
    assert plain_digest({"step": 3}, tensor_digest) != NOTHING_PLAIN
