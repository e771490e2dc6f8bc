"""A spare promoted to other ranks keeps DTensor's cached sharding decisions, and every tensor
of its second run gets its own ranks' meshes (``tm_launch.worker.spare.sharding_decisions``).

The spare's two runs are played in one process on torch's ``fake`` backend: rank 3 of 4 (the
sandbox's warm-up), then rank 0 (the ranks it was promoted to), as ``runtime`` does it:
``retire_meshes`` when it takes the other ranks, ``adopt_meshes`` once the script has built its
model again, before its warm-up step. The layout is FSDP2 x TP with uneven shards, so a tensor
laid out with the old rank's coordinate has the wrong local shape.
"""

import gc
import glob
import os
import re

import pytest
import torch
from torch.distributed import distributed_c10d as c10d

from tm_launch.worker.spare import sharding_decisions

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: a GPU's backward runs on autograd's device thread"),
    ),
]


@pytest.fixture(autouse=True)
def tracked():
    sharding_decisions.track_meshes()
    gc.collect()  # no mesh of an earlier test left to retire or adopt


def _build(device: str):
    """FSDP2 x TP (2 x 2) as a script builds it: (model, optimizer, root mesh)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 5)).to(device)  # 5 rows: uneven over dp
    parallelize_module(net, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    fully_shard(net, mesh=mesh["dp"])
    return net, torch.optim.AdamW(net.parameters()), mesh


def _step(net, opt, device: str) -> list:
    """One training step; every DTensor it left: parameters, gradients, optimizer state."""
    from torch.distributed.tensor import DTensor

    net(torch.randn(2, 8, device=device)).sum().backward()
    grads = [p.grad for p in net.parameters()]
    opt.step()
    return [*net.parameters(), *grads, *(t for s in opt.state.values() for t in s.values() if isinstance(t, DTensor))]


def _misses() -> int:
    """Sharding decisions not found in the cache so far (DTensor's dispatch, this thread)."""
    return torch._C._get_DTensor_sharding_propagator_cache_stats()[1]


def _assert_own_meshes(tensors, mesh) -> None:
    """Every tensor's mesh is one of this run's: its coordinate this rank's, its groups alive."""
    coordinate = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    for t in tensors:
        m = t.device_mesh
        assert m.get_coordinate() == tuple(coordinate[d] for d in m.mesh_dim_names), m
        assert set(m._dim_group_names) <= set(mesh._dim_group_names), m
        for name in m._dim_group_names:
            c10d._resolve_process_group(name)  # raises for a group of the first run (destroyed)


def _sandbox_run_as_rank_3(fake_world, device: str) -> int:
    """The spare's warm-up as rank 3; how many decisions it made."""
    fake_world(3, 4)
    before = _misses()
    _step(*_build(device)[:2], device)
    sharding_decisions.retire_meshes()  # promoted to rank 0
    fake_world(0, 4, forget=False)
    return _misses() - before


@pytest.mark.parametrize("device", DEVICES)
def test_a_promoted_spare_finds_its_sandboxs_decisions_and_its_tensors_get_its_own_meshes(fake_world, device):
    cold = _sandbox_run_as_rank_3(fake_world, device)
    before = _misses()
    net, opt, mesh = _build(device)
    assert sharding_decisions.adopt_meshes() > 0
    tensors = _step(net, opt, device)
    assert _misses() - before <= cold // 4, (cold, _misses() - before)  # the sandbox's decisions were found
    _assert_own_meshes(tensors, mesh)

    fake_world(0, 4)  # rank 0 in a process that never was another rank: the same local shapes
    fresh = _step(*_build(device)[:2], device)
    assert [t.to_local().shape for t in tensors] == [t.to_local().shape for t in fresh]


def test_until_adopted_no_decision_cached_with_a_retired_mesh_is_found(fake_world):
    cold = _sandbox_run_as_rank_3(fake_world, "cpu")
    before = _misses()
    net, opt, mesh = _build("cpu")
    tensors = _step(net, opt, "cpu")  # no adopt_meshes(): every decision is made again
    assert _misses() - before == cold
    _assert_own_meshes(tensors, mesh)


def test_a_retired_mesh_without_a_counterpart_stays_retired(fake_world):
    from torch.distributed.device_mesh import init_device_mesh

    fake_world(3, 4)
    old = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    sharding_decisions.retire_meshes()
    fake_world(0, 4, forget=False)
    init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    assert sharding_decisions.adopt_meshes() == 0
    assert old != init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def test_redistribution_plans_are_made_again_for_the_new_coordinate(fake_world):
    """A plan to gather uneven shards on a 2-D mesh holds the shards' sizes at this rank's
    coordinate (7 rows: rank 3's part of dim 1 has 3, rank 0's 4): kept, it would make the new
    rank cut its rows as the old one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    def plan(adopt: bool) -> list:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        if adopt:
            assert sharding_decisions.adopt_meshes() > 0
        t = distribute_tensor(torch.arange(7.0).reshape(7, 1), mesh, [Shard(0), Shard(0)])
        gathered = t.redistribute(mesh, [Replicate(), Shard(0)])
        return [info.logical_shape for info in _gen_transform_infos(t._spec, gathered._spec)]

    fake_world(3, 4)
    assert plan(adopt=False)[0] == [3, 1]
    sharding_decisions.retire_meshes()
    fake_world(0, 4, forget=False)
    assert plan(adopt=True)[0] == [4, 1]


def test_a_mesh_the_script_drops_is_not_kept(fake_world):
    """A script may slice its mesh in every step (``mesh["tp"]`` builds a new one each time):
    the meshes it no longer holds must not pile up."""
    from torch.distributed.device_mesh import init_device_mesh

    fake_world(0, 4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    before = len(sharding_decisions._built)
    for _ in range(100):
        mesh["tp"]
    gc.collect()
    assert len(sharding_decisions._built) <= before


def test_the_adoption_matches_meshes_as_torch_compares_them(fake_world):
    """``adopt_meshes`` pairs meshes by what ``DeviceMesh.__eq__`` and its hash compare."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    fake_world(0, 4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for m in (mesh, mesh["tp"], mesh["dp"]):
        assert DeviceMesh._hash_key(m) == sharding_decisions._equality_key(m, m._thread_id)


def test_no_sharding_rule_of_this_torch_reads_the_rank():
    """Why a decision may be kept across ranks: nothing that makes one reads the coordinate or
    the rank (redistribution plans do, and are dropped). A torch upgrade that changes this
    fails here, not silently in a promoted spare."""
    root = os.path.dirname(torch.distributed.tensor.__file__)
    sources = [os.path.join(root, f) for f in ("_sharding_prop.py", "_op_schema.py", "_dtensor_spec.py")]
    sources += glob.glob(os.path.join(root, "_ops", "*.py"))
    rank_reads = re.compile(r"get_coordinate|_coordinate_on_dim|get_local_rank|get_rank\(")
    found = [f"{os.path.basename(f)}: {line.strip()}" for f in sources for line in open(f) if rank_reads.search(line)]
    assert not found and len(sources) > 10, found
