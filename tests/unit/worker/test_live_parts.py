"""The live runtime's decisions, without agents: which ranks replicate a rank's state, who sends
state to whom, and the job-wide commit vote (on a real TCPStore, ranks as threads).

Layouts are built for real (``init_device_mesh``, ``fully_shard``, ``parallelize_module``) in one
process on torch's ``fake`` backend, which gives any rank of any world size without peers.
"""

import dataclasses
import datetime
import threading
import time
import types

import pytest
import torch
import torch.distributed as dist

from tm_launch.worker.generation.commit import StepCommit, commit_store
from tm_launch.worker.state.replicas import mesh_replicas, pipeline_dims, replica_set

# ------------------------------------------------------------------------------------------------
# replicas: the pure rule


@pytest.mark.parametrize(
    "mesh, sharded, rank, want",
    [
        pytest.param([[0, 1], [2, 3]], {0, 1}, 1, {1}, id="sharded on both dims (FSDP x TP): nobody else"),
        pytest.param([[0, 1], [2, 3]], {1}, 1, {1, 3}, id="sharded on dim 1 only (HSDP shard / TP under DDP): the dim-0 peer"),
        pytest.param([[0, 1], [2, 3]], {0}, 1, {0, 1}, id="sharded on dim 0 only: the dim-1 peer"),
        pytest.param([[0, 1], [2, 3]], set(), 2, {0, 1, 2, 3}, id="replicated everywhere: the whole mesh"),
        pytest.param([[0, 1, 2], [3, 4, 5]], {1}, 4, {1, 4}, id="2 x 3, sharded on dim 1"),
        pytest.param([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], {1, 2}, 5, {1, 5}, id="3-d: HSDP x TP, replicated on dim 0"),
        pytest.param([[0, 1], [2, 3]], {0}, 7, set(), id="a rank outside the mesh holds none of it"),
    ],
)
def test_mesh_replicas(mesh, sharded, rank, want):
    assert mesh_replicas(mesh, sharded, rank) == frozenset(want)


@pytest.mark.parametrize(
    "mesh, rank, groups, want",
    [
        pytest.param([[[0], [1]], [[2], [3]]], 1, [{1, 3}], {0}, id="(pp, dp, shard): the pp line through rank 1"),
        pytest.param([[0, 1], [2, 3]], 2, [{2, 3}], {1}, id="(dp, pp): the pp line is dim 1"),
        pytest.param([[0, 1], [2, 3]], 0, [], set(), id="no pipeline: nothing splits"),
        pytest.param([[0, 1], [2, 3]], 0, [{0, 3}], set(), id="a group that is no line of the mesh"),
        pytest.param([[0, 1], [2, 3]], 0, [{0}], set(), id="a stage group of one rank"),
        pytest.param([[0, 1], [2, 3]], 0, [{1, 3}], set(), id="another rank's pipeline"),
        pytest.param([[0, 1]], 5, [{0, 1}], set(), id="a rank outside the mesh"),
    ],
)
def test_pipeline_dims(mesh, rank, groups, want):
    assert pipeline_dims(mesh, rank, groups) == want


# ------------------------------------------------------------------------------------------------
# replicas: read off real layouts


def _layout(name: str):
    """(model, optimizer, ``replicas=`` declaration) as tests/scripts/hybrid.py builds them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
    declared = None
    if name in ("fsdp-tp", "ddp-tp"):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(net, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
        if name == "fsdp-tp":
            fully_shard(net, mesh=mesh["dp"])
    elif name == "hsdp":
        fully_shard(net, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    elif name == "hsdp-unflattened":  # as torchtitan's ParallelDims builds it
        world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
        fully_shard(net, mesh=world._unflatten(0, (2, 2), ("dp_replicate", "fsdp")))
    elif name == "fsdp":
        fully_shard(net, mesh=init_device_mesh("cpu", (4,), mesh_dim_names=("shard",)))
    elif name == "pp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
        declared = tuple(dist.get_process_group_ranks(mesh["dp"].get_group()))
    elif name == "pp-fsdp-replicas":  # tests/scripts/pipelining.py --fsdp: a stage in FSDP2 over its replicas
        mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "dp", "shard"))
        fully_shard(net, mesh=mesh["dp", "shard"])
    elif name == "pp-fsdp":  # a stage sharded over its dp group
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        fully_shard(net, mesh=mesh["dp"])
    opt = torch.optim.AdamW(net.parameters())
    net(torch.randn(2, 8)).sum().backward()
    opt.step()  # optimizer state exists (and follows the parameters' layout)
    return net, opt, declared


@pytest.mark.parametrize(
    "layout, want",
    [
        pytest.param("ddp-tp", {0: {0, 2}, 1: {1, 3}, 2: {0, 2}, 3: {1, 3}}, id="TP under data parallel: the dp peer, same TP shard"),
        pytest.param("hsdp", {0: {0, 2}, 1: {1, 3}, 2: {0, 2}, 3: {1, 3}}, id="HSDP: the replicate peer"),
        pytest.param("hsdp-unflattened", {0: {0, 2}, 1: {1, 3}, 2: {0, 2}, 3: {1, 3}}, id="HSDP on a mesh unflattened from the world's"),
        pytest.param("pp", {0: {0, 2}, 1: {1, 3}, 2: {0, 2}, 3: {1, 3}}, id="pipeline stages: the declared dp group"),
        pytest.param("fsdp-tp", {r: {r} for r in range(4)}, id="FSDP x TP: no replica"),
        pytest.param("fsdp", {r: {r} for r in range(4)}, id="FSDP: no replica"),
        pytest.param("pp-fsdp-replicas", {0: {0, 1}, 1: {0, 1}, 2: {2, 3}, 3: {2, 3}}, id="pipeline x FSDP2 replicas: the stage's dp peer"),
        pytest.param("pp-fsdp", {r: {r} for r in range(4)}, id="pipeline x FSDP2 sharded: no replica"),
    ],
)
def test_replica_set_of_real_layouts(fake_world, layout, want):
    for rank in range(4):
        fake_world(rank, 4)
        net, opt, declared = _layout(layout)
        states = {"model": net.state_dict(), "optimizer": opt.state_dict()}
        decl = {"model": declared, "optimizer": declared}
        pipelines = [{rank % 2, rank % 2 + 2}] if layout.startswith("pp-") else []  # the stage's pp group ((pp, dp): pp outermost)
        assert replica_set(states, decl, rank, 4, pipelines) == frozenset(want[rank]), (layout, rank)


class _WithExtraState(torch.nn.Linear):
    def get_extra_state(self):
        return {"seen": 1}

    def set_extra_state(self, state):
        pass


def _hooked() -> torch.nn.Module:
    net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    net[0].register_load_state_dict_post_hook(lambda module, keys: None)
    return net


@pytest.mark.parametrize(
    "make, want",
    [
        pytest.param(lambda: torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Tanh()), True, id="plain modules"),
        pytest.param(lambda: torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3)), False, id="a loader of its own"),
        pytest.param(lambda: torch.nn.Sequential(_WithExtraState(2, 2)), False, id="extra state"),
        pytest.param(_hooked, False, id="a load hook of the script's"),
    ],
)
def test_copy_is_the_load(make, want):
    from tm_launch.worker.state.transfer import copy_is_the_load

    assert copy_is_the_load(make()) is want


def test_a_state_dict_of_copies_is_loaded_by_the_modules_own_loader():
    """Values written into a state dict whose tensors are copies (a wrapper's state-dict hook)
    never reached the module: its loader runs."""
    from tm_launch.worker.state.transfer import TENSOR, load_state

    net = torch.nn.Linear(2, 2)
    net._register_state_dict_hook(lambda module, sd, prefix, local: {k: v.clone() for k, v in sd.items()})
    own = net.state_dict()
    skeleton = {k: (TENSOR, i, tuple(v.shape), "float32", None, "cpu") for i, (k, v) in enumerate(own.items())}
    new = [torch.full_like(v, 7.0) for v in own.values()]
    load_state(net, skeleton, new, own, written=set(range(len(new))))
    assert all(bool((p == 7.0).all()) for p in net.parameters())


@pytest.mark.parametrize("layout", ["fsdp", "fsdp-tp", "hsdp", "ddp-tp"])
def test_copy_is_the_load_of_real_layouts(fake_world, layout):
    """fully_shard's own load hooks do nothing a copy into the local shards has not done."""
    from tm_launch.worker.state.transfer import copy_is_the_load

    fake_world(0, 4)
    net, _, _ = _layout(layout)
    assert copy_is_the_load(net)


def _bits(t: torch.Tensor) -> bytes:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def test_an_fsdp_tp_image_loads_back_into_the_shards_without_torchs_loader(fake_world, monkeypatch):
    """A rank restoring its snapshot (or a joiner loading one) writes each value into its own
    local shard; the modules' ``load_state_dict`` (a DTensor ``copy_`` per parameter, whose
    sharding decision is slow the first time in a process) is not called, and the parameters
    and the optimizer's state end bitwise as they were, in the same storage."""
    from tm_launch.worker.snapshots.image import Capture

    fake_world(1, 4)
    net, opt, _ = _layout("fsdp-tp")
    objects = {"model": net, "optimizer": opt}
    image = Capture(1, objects, None, reuse=None).copy()
    want = [p.to_local().clone() for p in net.parameters()] + [v.clone() for s in opt.state.values() for v in s.values()]
    storage = [p.to_local().data_ptr() for p in net.parameters()]
    net(torch.randn(2, 8)).sum().backward()
    opt.step()  # the job moved on
    loads = []
    original = torch.nn.Module.load_state_dict
    monkeypatch.setattr(torch.nn.Module, "load_state_dict", lambda self, *a, **k: loads.append(self) or original(self, *a, **k))
    image.load_into(objects)
    got = [p.to_local() for p in net.parameters()] + [v for s in opt.state.values() for v in s.values()]
    assert not loads
    # Bit patterns, not values: on the fake backend FSDP's all-gather leaves its buffers as
    # allocated, so the steps above may have computed with (and stored) NaNs.
    assert [_bits(a) for a in got] == [_bits(b) for b in want]
    assert [p.to_local().data_ptr() for p in net.parameters()] == storage


# ------------------------------------------------------------------------------------------------
# which communicators a generation changes (rebuilt on entry; NCCL ones aborted when it arrives)


def D(joiners=(), all_fresh=False):
    from tm_launch.protocol import Directive

    return Directive(generation=1, active=True, joiner_ranks=tuple(joiners), all_fresh=all_fresh)


@pytest.mark.parametrize(
    "ranks, d, rank, old_rank, want",
    [
        pytest.param(None, D(), 1, 1, True, id="the world always: somebody failed, left or was replaced"),
        pytest.param((0, 1), D(joiners=[3]), 1, 1, False, id="a subgroup without the replaced rank is kept"),
        pytest.param((2, 3), D(joiners=[3]), 2, 2, True, id="a subgroup with the replaced rank changes"),
        pytest.param((0, 2), D(joiners=[2, 3]), 0, 0, True, id="two joiners, one in the group"),
        pytest.param((0, 1), D(all_fresh=True), 1, 1, True, id="every process is new"),
        pytest.param((0, 1), D(), 1, 3, True, id="this process changed rank (a promoted spare)"),
        pytest.param((0, 1), D(joiners=[3]), -1, 1, True, id="this process is replaced itself"),
        pytest.param((0, 1), D(), 0, 0, False, id="nothing about the group changed"),
    ],
)
def test_membership_changed(ranks, d, rank, old_rank, want):
    from tm_launch.worker.generation.generations import membership_changed

    assert membership_changed(ranks, d, rank, old_rank) is want


# FSDP2 x TP on 4 ranks: dp groups {0, 2} and {1, 3}, tp groups {0, 1} and {2, 3}
MESH_2x2 = [(0, 2), (1, 3), (0, 1), (2, 3)]


@pytest.mark.parametrize(
    "rank, old_rank, d, unusable, want",
    [
        pytest.param(0, 0, D(joiners=[3]), set(), set(), id="groups without the joiner are kept"),
        pytest.param(2, 2, D(joiners=[3]), set(), {3}, id="its group with the joiner"),
        pytest.param(0, 0, D(joiners=[3]), {0}, {0}, id="a group it closed (a failed collective, entering late)"),
        pytest.param(0, 0, D(joiners=[3]), {1, 3}, set(), id="closed groups it is not a member of"),
        pytest.param(3, 3, D(joiners=[3]), {1, 3}, {1, 3}, id="the joiner: every group of its rank"),
        pytest.param(1, 3, D(), set(), {1, 2}, id="a process that changed rank"),
        pytest.param(0, 0, D(all_fresh=True), set(), {0, 2}, id="every process new"),
    ],
)
def test_subgroups_to_rebuild(rank, old_rank, d, unusable, want):
    """What one member cannot keep (the ranks gather it and every member rebuilds the union)."""
    from tm_launch.worker.generation.generations import subgroups_to_rebuild

    assert subgroups_to_rebuild(MESH_2x2, d, rank, old_rank, unusable) == frozenset(want)


@pytest.mark.parametrize(
    "rank, old_rank, d, unusable, want",
    [
        pytest.param(3, 3, D(joiners=[3]), {1, 3, 4}, {1}, id="the joiner builds none of its own"),
        pytest.param(1, 3, D(), set(), {1, 2}, id="a process that changed rank"),
        pytest.param(0, 0, D(all_fresh=True), set(), {0, 2}, id="every process new"),
    ],
)
def test_groups_served_in_process_are_never_rebuilt(rank, old_rank, d, unusable, want):
    """Torch's "fake" groups and groups of one rank have no communicator to build (indices 3
    and 4 here: the tp group {2, 3} made "fake", and rank 3's own group)."""
    from tm_launch.worker.generation.generations import subgroups_to_rebuild

    memberships = [*MESH_2x2, (3,)]
    assert subgroups_to_rebuild(memberships, d, rank, old_rank, unusable, in_process={3, 4}) == frozenset(want)


def _all_reduced(backend, value: float, *op) -> float:
    t = torch.tensor([value])
    backend.allreduce([t], *op).wait()
    return t.item()


def _options(op):
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    return opts


@pytest.mark.parametrize(
    "op, want",
    [
        pytest.param((), 6.0, id="torch's default: a sum"),
        pytest.param((_options(dist.ReduceOp.SUM),), 6.0, id="a sum in options (dist.all_reduce)"),
        pytest.param((_options(dist.ReduceOp.MAX),), 2.0, id="a max in options"),
        pytest.param((_options(dist.ReduceOp.AVG),), 2.0, id="an average in options"),
        pytest.param((dist.ReduceOp.SUM,), 6.0, id="a bare sum"),
        pytest.param((dist.ReduceOp.MIN,), 2.0, id="a bare min"),
    ],
)
def test_a_sandbox_all_reduce_is_that_of_identical_replicas(op, want):
    """The sandbox's stand-in (``LocalBackend``, 3 replicas): what 3 ranks holding 2.0 would get."""
    from tm_launch.worker.comms.groups import LocalBackend

    assert _all_reduced(LocalBackend(1, 3), 2.0, *op) == want


def test_a_group_served_in_process_computes_as_torch_and_is_never_released():
    """``in_process_backend``: torch's own FakeProcessGroup for a "fake" group (nothing changes),
    the exact local computation for a group of one rank, nothing for a real group of two. The
    group keeps it when released (a late entry releases every group) and calls it as torch would."""
    from torch._C._distributed_c10d import FakeProcessGroup

    from tm_launch.worker.comms.groups import LiveGroup, LocalBackend, StepPoison, in_process_backend

    assert in_process_backend(0, 2) is None
    fake, alone = in_process_backend(1, 4, "fake"), in_process_backend(0, 1)
    assert isinstance(fake, FakeProcessGroup) and (fake.rank(), fake.size()) == (1, 4)
    assert isinstance(alone, LocalBackend)
    for inner, ranks, rank in ((fake, (0, 1, 2, 3), 1), (alone, (2,), 0)):
        group = LiveGroup(ranks, rank, len(ranks), StepPoison(), in_process=True)
        group.swap(inner, rank, len(ranks), 0)
        group.release()
        assert group.inner is inner
        assert _all_reduced(group, 3.0, _options(dist.ReduceOp.SUM)) == 3.0


class _Agent:
    """What ``Generations`` asks of its agent while it builds a communicator: the newest generation."""

    @staticmethod
    def latest():
        return 0


def test_subgroups_rebuilt_are_the_agreed_ones_and_a_failed_build_leaves_its_group_closed():
    """``_rebuild_subgroups``: a group outside the agreed set keeps its communicator object; one
    inside it gets a new one; a group of which this rank is not a member is dropped; and a build
    that fails leaves its group without a communicator, so that this rank names it in its next
    ``Holding.rebuild`` (it must not keep the old one while another member built a new one)."""
    from tm_launch.protocol import Directive, StoreAddress, WorkerEnv
    from tm_launch.worker.comms.groups import LiveGroup, LocalBackend, StepPoison
    from tm_launch.worker.generation.generations import Generations

    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    poison = StepPoison()
    kept, rebuilt, other = (LiveGroup((0,), 0, 1, poison, store_key=f"sub-{k}") for k in ("kept", "rebuilt", "other"))
    for g in (kept, rebuilt, other):
        g.swap(LocalBackend(0, 1), 0, 1, 0)
    other.member_ranks = (1,)  # a group of another rank
    state = types.SimpleNamespace(subgroups=[kept, rebuilt, other])
    gens = Generations(state=state, agent=_Agent(), status=None, env=WorkerEnv(setup_timeout=2), devices=("cpu",), snapshots=None)
    d = Directive(generation=1, active=True, ranks=(0,), world_size=1, store=StoreAddress("127.0.0.1", server.port))
    before = kept.inner
    assert gens._rebuild_subgroups(d, 0, frozenset({1})) == 1
    assert kept.inner is before and not isinstance(rebuilt.inner, LocalBackend) and rebuilt.inner is not None
    assert other.inner is None
    unreachable = dataclasses.replace(d, generation=2, store=StoreAddress("127.0.0.1", 1))  # nothing listens there
    with pytest.raises(RuntimeError):
        gens._rebuild_subgroups(unreachable, 0, frozenset({0}))
    assert kept.inner is None  # closed: named in the next generation's rebuild set
    assert gens._subgroups_to_rebuild(dataclasses.replace(d, generation=3), 0, 0) == frozenset({0})
    gens.close()


def test_a_world_built_ahead_is_used_by_its_generation_only():
    """``build_ahead``: a promoted spare starts its world communicator before it runs the script
    again; entering that generation waits for that build instead of starting another, and any
    other generation gives it up."""
    from tm_launch.protocol import Directive, StoreAddress, WorkerEnv
    from tm_launch.worker.generation.directives import Directives
    from tm_launch.worker.generation.world_builds import WorldBuilds

    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    # The unreachable store below fails fast: a 2 s set-up timeout.
    gens = WorldBuilds(None, Directives(_Agent()), WorkerEnv(setup_timeout=2), ("cpu",))
    d = Directive(generation=3, active=True, ranks=(0,), world_size=1, store=StoreAddress("127.0.0.1", server.port))
    gens.build_ahead(d)
    ahead = gens.take_ahead(3)
    pg = gens.build_watching(None, 0, 3, d, pending=ahead)
    assert pg is ahead[1]["pg"] and pg.size() == 1
    assert gens.take_ahead(3) is None  # taken once
    gens.build_ahead(d)
    thread, box = gens._ahead[1]
    assert gens.take_ahead(4) is None  # another generation: given up
    thread.join()
    assert "pg" not in box and "error" not in box  # released, whether it finished before or after
    gens.build_ahead(dataclasses.replace(d, store=StoreAddress("127.0.0.1", 1)))  # nothing listens there
    with pytest.raises(RuntimeError):
        gens.build_watching(None, 0, 3, d, pending=gens.take_ahead(3))
    gens.close()


def test_a_survivor_builds_its_world_ahead_once_per_generation_and_never_while_entering_it():
    """``build_ahead_as_survivor`` (the directive watcher, an unplanned generation): a survivor
    keeping its rank starts the new world's build; not twice for one generation, not for one
    the main thread began to enter (that thread builds its own: each rank builds a world once),
    not for a planned switch, a stop, a rank it leaves or changes, nor in the sandbox (a parked
    spare enters at once)."""
    from tm_launch.protocol import Directive, StoreAddress, WorkerEnv
    from tm_launch.worker.generation.directives import Directives
    from tm_launch.worker.generation.world_builds import WorldBuilds

    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    state = types.SimpleNamespace(in_sandbox=False, rank=0)
    gens = WorldBuilds(state, Directives(_Agent()), WorkerEnv(setup_timeout=2), ("cpu",))
    d = Directive(generation=3, active=True, ranks=(0,), world_size=1, store=StoreAddress("127.0.0.1", server.port))
    for other in (
        dataclasses.replace(d, planned=True),
        dataclasses.replace(d, stop=True),
        dataclasses.replace(d, active=False),
        dataclasses.replace(d, ranks=(1,), world_size=2),
    ):
        assert not gens.build_ahead_as_survivor(other), other
    state.in_sandbox = True
    assert not gens.build_ahead_as_survivor(d)
    state.in_sandbox = False
    assert gens.build_ahead_as_survivor(d)
    assert not gens.build_ahead_as_survivor(d)  # already started
    ahead = gens.take_ahead(3)  # the main thread enters 3 and takes it
    assert gens.build_watching(None, 0, 3, d, pending=ahead) is ahead[1]["pg"]
    assert not gens.build_ahead_as_survivor(d)  # entered: not again
    assert gens.take_ahead(3) is None
    gens.take_ahead(4)  # the main thread began to enter 4 before the watcher saw it
    assert not gens.build_ahead_as_survivor(dataclasses.replace(d, generation=4))
    assert gens.build_ahead_as_survivor(dataclasses.replace(d, generation=5))
    assert gens.take_ahead(6) is None  # a newer generation than the one built: given up
    gens.close()


# ------------------------------------------------------------------------------------------------
# the transfer's wire: which backend carries a tensor, which own tensor receives it in place


@pytest.mark.parametrize(
    "device, nccl, want",
    [
        ("cpu", None, "cpu"),
        ("cpu", "cuda:0", "cpu"),  # CPU state (Adam's step counters) stays on gloo in an NCCL job
        ("cuda:0", "cuda:0", "cuda"),  # GPU to GPU through NCCL, no host staging
        ("cuda:1", "cuda:0", "cpu"),  # not the communicator's device: staged, one tensor at a time
        ("cuda:0", None, "cpu"),  # a gloo-only job with a model on the GPU
    ],
)
def test_wire_for(device, nccl, want):
    from tm_launch.worker.state.transfer import wire_for

    assert wire_for(torch.device(device), None if nccl is None else torch.device(nccl)) == want


def _meta(index, shape, dtype="float32", wire="cpu"):
    from tm_launch.worker.state.transfer import TENSOR

    return (TENSOR, index, shape, dtype, None, wire)


@pytest.mark.parametrize(
    "metas, want",
    [
        # a model's small tensors: one message, each at a 64-byte offset (a 0-dim step counter too)
        ([_meta(0, (3,)), _meta(1, ()), _meta(2, (5,), "bfloat16")], [("pack", [(0, 0), (1, 64), (2, 128)], 138)]),
        # a large tensor travels alone; the small ones around it share one pack, sent when it closes
        (
            [_meta(0, (4,)), _meta(1, (65537,)), _meta(2, (2,), "int64")],
            [("alone", [(1, 0)], 262148), ("pack", [(0, 0), (2, 64)], 80)],
        ),
        ([_meta(0, (65536,))], [("pack", [(0, 0)], 262144)]),  # PACK_TENSOR_MAX itself is packed
        # GPU to GPU through NCCL, and a dtype a pack does not hold: alone
        ([_meta(0, (4,), wire="cuda"), _meta(1, (4,), "float8_e4m3fn")], [("alone", [(0, 0)], 16), ("alone", [(1, 0)], 4)]),
        # a pack is closed at PACK_BYTES: 16 tensors of 256 KiB make 4 MiB
        ([_meta(i, (65536,)) for i in range(17)], [("pack", [(i, i * 262144) for i in range(16)], 4 * 2**20), ("pack", [(16, 0)], 262144)]),
        ([], []),
    ],
)
def test_wire_units(metas, want):
    from tm_launch.worker.state.transfer import wire_units

    assert wire_units(metas) == want


def _ph(index, t, layout=None):
    """The sender's placeholder for ``t``."""
    from tm_launch.worker.state.transfer import TENSOR

    return (TENSOR, index, tuple(t.shape), str(t.dtype).replace("torch.", ""), layout, "cpu")


def test_receive_targets_take_only_tensors_that_fit():
    from tm_launch.worker.state.transfer import receive_targets

    base = torch.zeros(10)
    own = {
        "model": {
            "w": torch.zeros(2, 3),  # fits
            "b": torch.zeros(3),  # the sender's is longer: allocate
            "h": torch.zeros(3, dtype=torch.float64),  # another dtype: allocate
            "t": torch.zeros(3, 2).t(),  # not contiguous: one message cannot fill it
            "x": base[:4],
            "y": base[4:8],  # views of one buffer that do not overlap: both fit
            "z": base[6:10],  # overlaps y: fresh memory
            "n": 7,  # not a tensor
        },
        "opt": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(2, 3)}}, "param_groups": [{"lr": 0.1}]},
    }
    skeleton = {
        "model": {
            "w": _ph(0, torch.zeros(2, 3)),
            "b": _ph(1, torch.zeros(4)),
            "h": _ph(2, torch.zeros(3)),
            "t": _ph(3, torch.zeros(2, 3)),
            "x": _ph(4, torch.zeros(4)),
            "y": _ph(5, torch.zeros(4)),
            "z": _ph(6, torch.zeros(4)),
            "n": _ph(7, torch.zeros(1)),
            "gone": _ph(8, torch.zeros(1)),
        },
        "opt": {"state": {0: {"step": _ph(9, torch.tensor(1.0)), "exp_avg": _ph(10, torch.zeros(2, 3))}}, "param_groups": [{"lr": 0.1}]},
    }
    targets = receive_targets(skeleton, own)
    assert sorted(targets) == [0, 4, 5, 9, 10]
    assert targets[0] is own["model"]["w"] and targets[10] is own["opt"]["state"][0]["exp_avg"]


class _SelectiveModule(torch.nn.Linear):
    def load_state_dict(self, state_dict, strict=True, assign=False):  # may keep some of its own
        return super().load_state_dict({k: v for k, v in state_dict.items() if k != "bias"}, strict=False)


class _OwnLoadAdam(torch.optim.Adam):
    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)


class _Checkpoint:
    """A framework's whole checkpoint as one registered object."""

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


@pytest.mark.parametrize(
    "make, want",
    [
        pytest.param(lambda: torch.nn.Sequential(torch.nn.Linear(2, 2)), True, id="a module: torch's key-by-key load"),
        pytest.param(lambda: torch.optim.Adam(torch.nn.Linear(2, 2).parameters()), True, id="an optimizer: keeps the tensors given"),
        pytest.param(lambda: _SelectiveModule(2, 2), False, id="a module with a load of its own"),
        pytest.param(lambda: _OwnLoadAdam(torch.nn.Linear(2, 2).parameters()), False, id="an optimizer with a load of its own"),
        pytest.param(_Checkpoint, False, id="any other object"),
        pytest.param(
            lambda: torch.optim.lr_scheduler.StepLR(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), 1), False, id="a scheduler"
        ),
    ],
)
def test_only_torchs_own_loads_receive_in_place(make, want):
    from tm_launch.worker.state.transfer import loads_in_place

    assert loads_in_place(make()) is want


def test_tied_tensors_receive_into_fresh_memory_the_second_time():
    from tm_launch.worker.state.transfer import receive_targets

    w = torch.zeros(4, 2)
    own = {"m": {"embed.weight": w, "head.weight": w.detach()}}  # tied: one storage
    skeleton = {"m": {"embed.weight": _ph(0, w), "head.weight": _ph(1, w)}}
    assert sorted(receive_targets(skeleton, own)) == [0]


@pytest.mark.parametrize(
    "sender, receiver, in_place",
    [
        pytest.param("fsdp-tp", "fsdp-tp", "all", id="FSDP x TP shards: the same layout, every tensor in place"),
        pytest.param("hsdp", "hsdp", "all", id="HSDP"),
        pytest.param("fsdp-tp", "ddp-tp", "plain only", id="another mesh or placements: the DTensors are allocated"),
    ],
)
def test_dtensors_receive_in_place_only_with_the_same_layout(fake_world, sender, receiver, in_place):
    from torch.distributed.tensor import DTensor

    from tm_launch.worker.state.transfer import flatten, receive_targets

    fake_world(1, 4)
    tensors: list = []
    net, opt, _ = _layout(sender)
    theirs = {"model": flatten(net.state_dict(), tensors), "optimizer": flatten(opt.state_dict(), tensors)}
    net, opt, _ = _layout(receiver)
    own = {"model": net.state_dict(), "optimizer": opt.state_dict()}
    targets = receive_targets(theirs, own)
    dtensors = [t for t in targets.values() if isinstance(t, DTensor)]
    if in_place == "all":
        assert sorted(targets) == list(range(len(tensors))) and dtensors
        first = next(iter(net.parameters()))
        dtensors[0].to_local().detach().fill_(7.0)  # what a receive does: the parameter itself changes
        assert bool((first.to_local() == 7.0).all())
    else:
        assert not dtensors and targets  # Adam's step counters are plain tensors and still fit


TRANSFER = r"""
import hashlib, json, sys, datetime
import torch, torch.distributed as dist
import torch.distributed.tensor  # as in a live worker
from tm_launch.worker.comms import communicators
from tm_launch.worker.state.transfer import send_state, recv_state

rank, port, device = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
devices = ["cpu"] if device == "cpu" else ["cpu", f"cuda:{rank}"]
dev = torch.device("cpu" if device == "cpu" else f"cuda:{rank}")
pg = communicators.build(dist.PrefixStore("t/", store), rank, 2, devices=devices, timeout_s=60, setup_timeout_s=60)

torch.manual_seed(rank)  # the receiver's own state differs from the sender's everywhere
# 8 x 16 ... 16 x 4: small tensors, which travel in packs; 16 x 4096 (256 KiB): one of its own
model = torch.nn.Sequential(
    torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4096), torch.nn.Tanh(), torch.nn.Linear(4096, 4)
).to(dev)
opt = torch.optim.Adam(model.parameters(), lr=0.01)

class Extra:  # state that is no module or optimizer (fresh memory), of every kind of tensor a pack holds
    def __init__(self, seed):
        g = torch.Generator().manual_seed(seed)
        self.state = {
            "scalar": torch.tensor(seed, dtype=torch.int64), "empty": torch.zeros(0, 3), "mask": torch.rand(7, generator=g) > 0.5,
            "half": torch.randn(3, 5, generator=g).half(), "bf16": torch.randn(9, generator=g).bfloat16(),
            "bytes": torch.randint(0, 255, (13,), dtype=torch.uint8, generator=g), "f64": torch.randn(2, 2, dtype=torch.float64, generator=g),
            "big": torch.randn(70000, generator=g), "n": seed,
        }
    def state_dict(self):
        return self.state
    def load_state_dict(self, sd):
        self.state = sd

def step(seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(5, 8, generator=g).to(dev), torch.randn(5, 4, generator=g).to(dev)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

def digest(t):  # dtype, shape and every byte (a whole state printed would fill the test's pipe)
    t = t.detach().cpu().contiguous()
    return [str(t.dtype), list(t.shape), hashlib.sha256(t.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()]

def state():
    return [digest(p) for p in model.parameters()] + [[digest(v) for _, v in sorted(s.items())] for s in opt.state.values()] + [
        digest(v) if torch.is_tensor(v) else v for _, v in sorted(others.state.items())]

def storage():
    return [p.data_ptr() for p in model.parameters()] + [v.data_ptr() for s in opt.state.values() for _, v in sorted(s.items())]

others = Extra(rank)
objects = {"model": model, "optimizer": opt, "extra": others}
if rank == 0:
    for s in range(3):
        step(100 + s)
    send_state(pg, 1, objects, 3)
else:
    step(7)  # the sandbox's warm-up step: the optimizer state exists
    before = storage()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated(dev)
    got, _ = recv_state(pg, 0, objects)
    extra = torch.cuda.memory_allocated(dev) - allocated if dev.type == "cuda" else 0
    print("RECV", json.dumps({"step": got, "same_storage": storage() == before, "extra_gpu_bytes": extra}))
step(200)  # both ranks, after the transfer: the optimizer still drives the same tensors
print("STATE", json.dumps(state()))
pg.barrier().wait()
"""


def _transfer_between_processes(device: str):
    """A sender at step 3 and a receiver that warmed up on its own: the receiver's model and
    optimizer keep their storage, and one more step on both is bitwise the same."""
    import json
    import os
    import subprocess
    import sys

    from tm_launch.local.localjob import REPO

    server = dist.TCPStore("127.0.0.1", 0, 3, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TRANSFER, str(r), str(server.port), device],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-3000:] for _, err in outs]
    found = [
        {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith(("RECV", "STATE"))}
        for out, _ in outs
    ]
    return found[1]["RECV"], found[0]["STATE"], found[1]["STATE"]


def test_a_joiner_receives_into_its_own_model_and_optimizer():
    recv, sender, receiver = _transfer_between_processes("cpu")
    assert recv["step"] == 3
    assert recv["same_storage"] is True  # parameters and Adam's moments and step counters: in place
    assert receiver == sender  # bitwise, and the next step too


@pytest.mark.skipif(
    not (torch.cuda.is_available() and dist.is_nccl_available() and torch.cuda.device_count() >= 2),
    reason="needs 2 CUDA devices with NCCL (NCCL refuses two ranks on one GPU; this is a CPU build or machine)",
)
def test_a_joiner_receives_cuda_state_in_place_through_nccl():
    recv, sender, receiver = _transfer_between_processes("cuda")
    assert recv["step"] == 3 and recv["same_storage"] is True
    assert recv["extra_gpu_bytes"] <= 0  # no second copy of the state on the GPU
    assert receiver == sender


# ------------------------------------------------------------------------------------------------
# the commit vote: every rank gets the same decision


def _voters(world: int):
    server = dist.TCPStore("127.0.0.1", 0, world, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    commits = []
    for rank in range(world):
        c = StepCommit()
        c.use(dist.PrefixStore("commit/", dist.TCPStore("127.0.0.1", server.port, world, False, wait_for_workers=False)), rank, world, 0)
        commits.append(c)
    return server, commits


def _vote_all(commits, oks, step=3, newer=lambda: False):
    decisions = {}

    def vote(rank):
        commits[rank].begin(step)
        decisions[rank] = commits[rank].decide(oks[rank], newer)

    threads = [threading.Thread(target=vote, args=(r,)) for r in range(len(commits)) if oks[r] is not None]
    for t in threads:
        t.start()
    return threads, decisions


def test_a_vote_walks_away_from_a_store_that_never_answers_once_a_peer_is_gone():
    """The store's node is cut off the network (here: its process stopped): no answer, no
    refusal, and torch's client has no timeout for a count or a compare-and-set. A rank whose
    step failed knows the decision (no commit without its count) and does not wait for the
    store; one whose step worked gives up as uncertain once a peer is known gone."""
    import os
    import signal
    import subprocess
    import sys
    import time

    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time, torch.distributed as d; "
            "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False); "
            "print(s.port, flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(server.stdout.readline())
        commits = []
        for rank in range(2):
            c = StepCommit()
            c.use(dist.PrefixStore("commit/", dist.TCPStore("127.0.0.1", port, 2, False, wait_for_workers=False)), rank, 2, 0)
            c.begin(7)
            commits.append(c)
        os.kill(server.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        assert commits[0].decide(False, lambda: False) is False  # at once: nothing to wait for
        gone = {"yes": False}
        timer = threading.Timer(0.5, lambda: gone.update(yes=True))
        timer.start()
        assert commits[1].decide(True, lambda: gone["yes"], peer_gone=lambda: gone["yes"]) is False
        assert commits[1].uncertain and time.monotonic() - t0 < 30  # not the store client's 300 s
        # The next generation's store answers: its votes do not wait behind the one left on the lost store.
        fresh_server, fresh = _voters(1)
        commits[1].use(fresh[0].store, 0, 1, 1)
        commits[1].begin(8)
        t1 = time.monotonic()
        assert commits[1].decide(True, lambda: False, peer_gone=lambda: time.monotonic() - t1 > 1) is True
    finally:
        server.kill()
        server.wait()


@pytest.mark.parametrize(
    "oks, want",
    [
        pytest.param([True, True, True], True, id="everyone's collectives worked -> commit everywhere"),
        pytest.param([True, False, True], False, id="one rank saw a failure -> abort everywhere"),
        pytest.param([False, False, False], False, id="everyone saw it -> abort"),
    ],
)
def test_vote_is_the_same_on_every_rank(oks, want):
    server, commits = _voters(3)
    threads, decisions = _vote_all(commits, oks)
    for t in threads:
        t.join(30)
    assert decisions == {r: want for r in range(3)}


def test_a_rank_that_never_votes_is_settled_by_the_next_generation():
    """Rank 2 died before voting: the others wait until their agent hands them a newer
    generation (the watcher calls abort()), then all abort; none commits alone."""
    server, commits = _voters(3)
    threads, decisions = _vote_all(commits, [True, True, None])
    for t in threads:
        t.join(0.5)
    assert not decisions, "nobody may decide while a rank's vote is missing"
    commits[0].abort(newer=1)  # the watcher thread of rank 0 sees generation 1
    for t in threads:
        t.join(30)
    assert decisions == {0: False, 1: False}


def test_a_decision_once_written_never_changes():
    """The last voter commits; an abort arriving afterwards (the watcher saw a failure after
    the step committed) changes nothing: the step stays committed on every rank."""
    server, commits = _voters(2)
    threads, decisions = _vote_all(commits, [True, True])
    for t in threads:
        t.join(30)
    commits[1].abort(newer=1)
    assert decisions == {0: True, 1: True}
    assert commits[0].store.get("3/d") == b"commit"


# ------------------------------------------------------------------------------------------------
# a spare promoted to ranks it did not warm up as


RERUN = r"""
import os, sys
import torch, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
os.environ.update(TM_AGENT_STORE=f"127.0.0.1:{store.port}", TM_SANDBOX="1", GROUP_RANK="-1", WORLD_SIZE="4",
                  LOCAL_WORLD_SIZE="1", LOCAL_RANK="0", RANK="0")
sys.path.insert(0, os.path.join(sys.argv[1], "tests", "scripts"))
import hybrid, tm_launch
from tm_launch.worker import torch_patches as c10d_glue
from tm_launch.protocol import Directive
job = tm_launch.init()

def build_and_step():
    model, _, dp_index, _, mesh = hybrid.build("ddp-tp", job.rank, job.world_size)
    x, y = hybrid.batch(0, dp_index)
    torch.nn.functional.mse_loss(model(x), y).backward()
    w = model.blocks[0].w1.weight
    return w.device_mesh._dim_group_names == mesh["tp"]._dim_group_names, mesh["tp"].mesh.tolist()

print("warm", job.rank, *build_and_step())
try:
    job.spare.take_other_ranks(Directive(generation=1, active=True, ranks=(1,), world_size=4))
except tm_launch.worker.spare.sandbox.RankChanged:
    pass
print("again", job.rank, *build_and_step())
"""


def test_a_promoted_spare_builds_its_new_ranks_layout(tmp_path):
    """A spare warms up as rank 3 (TP group {2, 3}) and is promoted to rank 1: running the script
    again for rank 1 gives DTensors on rank 1's mesh (TP group {0, 1}). DTensor caches sharding
    decisions by mesh *value*, which ignores the groups behind it: kept as they were, they gave
    the new parameters the old rank's groups, unregistered by then (a crash in the first step)."""
    import os
    import subprocess
    import sys

    from tm_launch.local.localjob import REPO

    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", RERUN, REPO], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [l.split() for l in out.stdout.splitlines() if l.startswith(("warm", "again"))]
    assert lines == [["warm", "3", "True", "[2,", "3]"], ["again", "1", "True", "[0,", "1]"]], out.stdout


# ------------------------------------------------------------------------------------------------
# per-rank state: snapshot and restore, mirrors for joiners


class Counter:
    """Per-rank state a step advances (a data position)."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def _mirroring_rank():
    """A rank with per-rank state, voting on a real store and mirroring to a real holder."""
    from tm_launch.worker.snapshots.link import SnapshotClient, SnapshotServer
    from tm_launch.worker.state.per_rank import PerRankState

    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    commit = StepCommit()
    commit.use(commit_store(dist.TCPStore("127.0.0.1", server.port, 1, False, wait_for_workers=False), 4), 0, 1, 4)
    state = PerRankState()
    state.objects["data"] = Counter()
    holder = SnapshotServer("127.0.0.1")
    client = SnapshotClient(holder.address, source=0)

    def publish(tag, exact, record):
        client.put_mirror(tag, exact, record)
        return True

    return (server, client), commit, state, holder, publish


def _step(commit, state, publish, step, consume=1, after_commit=0):
    """One committed step: the body consumes ``consume``, then ``after_commit`` after the vote."""
    state.begin_step(step, publish)
    commit.begin(step)
    state.objects["data"].n += consume
    assert commit.decide(True, lambda: False, lambda: publish(*state.vote_mirror(step)))
    state.objects["data"].n += after_commit


def _fetch(joiner, holder, step):
    """What a joiner that replaces rank 0 gets from its holder for ``step`` (None: loaded)."""
    return joiner.load_mirror(holder.mirror(0, step), 0, step)


def test_a_mirror_whose_holder_is_gone_is_reported_at_once(refusing_port):
    """The rank that held a rank's per-rank mirror went with its node: the joiner learns so from
    the refused connection at once."""
    from tm_launch.worker.snapshots.link import LinkError, SnapshotClient

    t0 = time.monotonic()
    with pytest.raises(LinkError, match="does not answer"):
        SnapshotClient(("127.0.0.1", refusing_port), source=1, timeout=5).get_mirror(0, 4)
    assert time.monotonic() - t0 < 3


def test_an_interrupted_step_runs_again_with_the_state_it_started_with():
    keep, commit, state, _, publish = _mirroring_rank()
    _step(commit, state, publish, 0)
    state.begin_step(1, publish)
    state.objects["data"].n += 5  # the step's body ran, then a peer failed
    state.restore()
    assert state.objects["data"].n == 1


def test_a_joiner_gets_the_mirror_of_the_agreed_step():
    keep, commit, state, holder, publish = _mirroring_rank()
    for step in range(3):
        _step(commit, state, publish, step)
    joiner = _mirroring_rank()[2]
    assert _fetch(joiner, holder, 3) is None
    assert joiner.objects["data"].n == 3
    assert "not mirrored" in _fetch(joiner, holder, 7)  # a step nobody mirrored
    assert "not mirrored" in _fetch(joiner, holder, 0)  # a step start never mirrored (its vote-time mirror was exact)


def test_state_changed_after_the_commit_makes_vote_time_mirrors_inexact():
    """A script that draws randomness after the optimizer step: the vote-time mirror is not the
    state the next step starts with. The rank mirrors the exact state at the next step's start,
    and a joiner refuses a vote-time mirror from then on (its rank may have died before
    reaching the next step: that is lost state, never a silently different stream)."""
    keep, commit, state, holder, publish = _mirroring_rank()
    _step(commit, state, publish, 0, after_commit=10)
    state.begin_step(1, publish)  # sees the change, mirrors step 1 exactly
    joiner = _mirroring_rank()[2]
    assert _fetch(joiner, holder, 1) is None and joiner.objects["data"].n == 11
    commit.begin(1)
    state.objects["data"].n += 1
    assert commit.decide(True, lambda: False, lambda: publish(*state.vote_mirror(1)))  # the rank dies after this vote
    assert "only at its vote" in _fetch(joiner, holder, 2)


def test_after_the_state_moved_once_every_step_start_is_mirrored_exactly():
    """The state moved after one vote (an epoch's new loader iterator), then never again: every
    later step still gets an exact start-of-step mirror, so a rank drained or lost at any later
    step can be replaced (a vote-time mirror, marked inexact since the move, is refused)."""
    keep, commit, state, holder, publish = _mirroring_rank()
    _step(commit, state, publish, 0, after_commit=10)  # moved after the vote: vote-time mirrors untrusted
    for step in range(1, 4):
        _step(commit, state, publish, step)  # nothing moves after these votes
    state.begin_step(4, publish)
    joiner = _mirroring_rank()[2]
    assert _fetch(joiner, holder, 4) is None and joiner.objects["data"].n == 14


def test_a_framework_that_settles_after_its_bookkeeping_mirrors_the_next_start_exactly():
    """The HF Trainer adds the step's loss to its per-rank logging sums after the vote: the
    vote-time mirror is untrusted. Mirrored once its bookkeeping is done (``mirror_settled``),
    a rank lost before its next step begins is taken over from an exact mirror, and the next
    start, unchanged since, is not sent again."""
    keep, commit, state, holder, publish = _mirroring_rank()
    sent = []

    def counting(tag, exact, record):
        sent.append(tag)
        return publish(tag, exact, record)

    _step(commit, state, counting, 0, after_commit=10)  # moved after the vote
    _step(commit, state, counting, 1, after_commit=10)
    assert state.mirror_settled(2, counting)
    joiner = _mirroring_rank()[2]
    assert _fetch(joiner, holder, 2) is None and joiner.objects["data"].n == 22  # the rank dies before step 2 begins
    before = len(sent)
    state.begin_step(2, counting)
    assert len(sent) == before  # its start is the settled state: the holder has it


def test_a_settled_mirror_that_a_step_start_contradicts_is_never_trusted_again():
    """Something moved after the framework said its step was done (a callback's random draw):
    that step's start is mirrored at once, and from then on only step starts are."""
    keep, commit, state, holder, publish = _mirroring_rank()
    _step(commit, state, publish, 0, after_commit=10)
    assert state.mirror_settled(1, publish)
    state.objects["data"].n += 100  # after the settled mirror
    state.begin_step(1, publish)
    joiner = _mirroring_rank()[2]
    assert _fetch(joiner, holder, 1) is None and joiner.objects["data"].n == 111  # the start, not the settled state
    commit.begin(1)
    state.objects["data"].n += 1
    assert commit.decide(True, lambda: False, lambda: publish(*state.vote_mirror(1)))
    state.objects["data"].n += 10
    assert state.mirror_settled(2, publish)  # not trusted: nothing sent
    assert "only at its vote" in _fetch(joiner, holder, 2)


def test_a_settled_mirror_that_did_not_reach_the_holder_is_sent_at_the_next_start():
    keep, commit, state, holder, publish = _mirroring_rank()
    _step(commit, state, publish, 0, after_commit=10)
    assert not state.mirror_settled(1, lambda *a: False)
    state.begin_step(1, publish)
    joiner = _mirroring_rank()[2]
    assert _fetch(joiner, holder, 1) is None and joiner.objects["data"].n == 11


def test_a_vote_whose_mirror_cannot_reach_the_holder_aborts_the_step():
    """The holder is gone: the per-rank state after the step would exist nowhere, so the step
    must not commit."""
    keep, commit, state, holder, publish = _mirroring_rank()
    _step(commit, state, publish, 0)
    commit.begin(1)
    assert commit.decide(True, lambda: False, lambda: False) is False


def test_rng_state_round_trips():
    import random

    from tm_launch.worker.state.per_rank import RNGState

    rng = RNGState()
    saved = rng.state_dict()
    first = (torch.rand(3), random.random())
    rng.load_state_dict(saved)
    assert torch.equal(torch.rand(3), first[0]) and random.random() == first[1]


def test_a_python_random_draw_after_the_vote_is_a_change():
    """The per-rank comparison takes Python's RNG state (625 ints) as one sequence: one draw
    between a vote and the next step's start must still count as a change."""
    import random

    from tm_launch.worker.state.per_rank import RNGState, _same
    from tm_launch.worker.state.transfer import cpu_copy

    rng = RNGState()
    voted = cpu_copy(rng.state_dict())
    assert _same(cpu_copy(rng.state_dict()), voted)
    random.random()
    assert not _same(cpu_copy(rng.state_dict()), voted)


@pytest.mark.parametrize(
    "a, b, same",
    [
        ((3, (1, 2, 3), None), (3, (1, 2, 3), None), True),
        ((3, (1, 2, 3), None), (3, (1, 2, 4), None), False),
        ([1, 2.5, "x"], (1, 2.5, "x"), True),  # a list and a tuple of the same values, as before
        ([1, 2], [1, 2, 3], False),
        ([1, torch.tensor([2])], [1, torch.tensor([2])], True),  # a tensor among numbers: by value
        ([1, torch.tensor([2])], [1, torch.tensor([3])], False),
        ([1, 2], [1, torch.tensor(2)], False),  # a number against a tensor is never the same
    ],
)
def test_per_rank_states_compare_by_value(a, b, same):
    from tm_launch.worker.state.per_rank import _same

    assert _same(a, b) is same


def test_cpu_copy_shares_nothing_mutable():
    from tm_launch.worker.state.transfer import cpu_copy

    ints, tensor = [1, 2, 3], torch.zeros(2)
    state = {"ints": ints, "nested": [ints, tensor], "rng": (3, (1, 2), None)}
    copied = cpu_copy(state)
    ints.append(4)
    tensor += 1
    assert copied == {"ints": [1, 2, 3], "nested": [[1, 2, 3], copied["nested"][1]], "rng": (3, (1, 2), None)}
    assert torch.equal(copied["nested"][1], torch.zeros(2))


SANDBOX_DCP = r"""
import os, sys
import torch, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
os.environ.update(TM_AGENT_STORE=f"127.0.0.1:{store.port}", TM_SANDBOX="1", GROUP_RANK="-1", WORLD_SIZE="2",
                  LOCAL_WORLD_SIZE="1", LOCAL_RANK="0", RANK="0")
import tm_launch
from tm_launch.worker.torch_patches import NoPeersYet
job = tm_launch.init()  # a spare: warms up as rank 1, no peers
objects = [None]
try:
    dist.broadcast_object_list(objects, src=0)
except NoPeersYet as e:
    print("refused:", e)
mine = [{"from": "me"}]
dist.broadcast_object_list(mine, 1)  # its own rank is the source: served locally
print("own:", mine[0])
"""


def test_a_rooted_object_collective_from_another_rank_before_steps_says_what_is_wrong():
    """A spare (or joiner) has no peers before job.steps(): an object broadcast from rank 0 there
    (a DCP load, say) has nothing to receive; it is refused with one clear line instead of
    unpickling uninitialised memory. From its own rank it is served locally."""
    import os
    import subprocess
    import sys

    from tm_launch.local.localjob import REPO

    out = subprocess.run(
        [sys.executable, "-c", SANDBOX_DCP],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "refused: tm-launch: broadcast_object_list from rank 0 ran before job.steps()" in out.stdout, out.stdout
    assert "own: {'from': 'me'}" in out.stdout, out.stdout
