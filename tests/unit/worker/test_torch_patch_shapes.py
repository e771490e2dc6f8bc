"""Does this torch still have the shape tm-launch's changes to it expect?

One test per place where tm-launch reaches into torch: every patch of
``tm_launch/worker/torch_patches.py`` and each private attribute or function read elsewhere
(``tm_launch/worker/comms``, ``spare``, ``state``, ``job``). Each checks what that code relies on
(the attribute exists, a signature still takes what the code passes, the behaviour the code is
built on), so a torch release that moves one of them fails the named test here rather than a
live job. ``make test-torch TORCH=X`` runs them on another release; the releases they passed
on are listed in docs/development.md, and ``pyproject.toml``'s torch range is that list.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from tm_launch.worker import torch_patches, torch_support
from tm_launch.worker.comms.groups import COLLECTIVES, LiveGroup, LocalBackend, StepPoison, in_process_backend, keep_out_of_graphs


def live_group(name: str = "tm-shape-test", size: int = 2, rank: int = 0) -> LiveGroup:
    group = LiveGroup(None, rank, size, StepPoison(), name=name)
    group.swap(LocalBackend(rank, size), rank, size, generation=0)
    return group


def parameters(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


# -- torch_patches: c10d's group registries ---------------------------------------------------------
def test_c10d_world_keeps_the_four_maps_register_fills():
    world = c10d._world
    for table in ("pg_group_ranks", "pg_map", "pg_names", "pg_backend_config"):
        assert isinstance(getattr(world, table), dict), table


def test_a_registered_live_group_is_what_torch_resolves_by_rank_and_by_name():
    """``torch_patches.register``: ``get_process_group_ranks``, ``get_group_rank`` and the by-name
    registry (functional collectives, DTensor, FSDP2) answer from what it writes."""
    group = live_group("tm-shape-registry")
    torch_patches.register(group, [3, 5])
    try:
        assert dist.get_process_group_ranks(group) == [3, 5]
        assert c10d.get_group_rank(group, 5) == 1
        assert c10d._resolve_process_group(group.group_name) is group
    finally:
        torch_patches.unregister(group)
    assert group not in c10d._world.pg_group_ranks


def test_install_world_makes_a_live_group_torchs_default_group():
    group = live_group("tm-shape-world")
    previous = c10d._world.default_pg
    try:
        torch_patches.install_world(group)
        assert c10d._get_default_group() is group
        assert dist.get_world_size() == 2 and dist.get_rank() == 0
    finally:
        torch_patches.unregister(group)
        c10d._update_default_pg(previous)


# -- torch_patches: new_group ----------------------------------------------------------------------
def _replacement_new_group():
    torch_patches.route_new_group(lambda ranks, backend: live_group(f"tm-shape-new-{ranks}"))
    try:
        return c10d.new_group
    finally:
        torch_patches.undo_all()


def test_the_new_group_replacement_takes_every_argument_torchs_takes():
    """A script may pass any of torch's ``new_group`` arguments: the replacement must accept them."""
    original = c10d.new_group
    assert parameters(original) <= parameters(_replacement_new_group()), parameters(original) - parameters(_replacement_new_group())
    assert c10d.new_group is original  # undone


def test_new_group_with_ranks_in_another_order_is_refused_not_reordered():
    new_group = _replacement_new_group()
    assert new_group([1, 0], sort_ranks=True).rank() == 0
    with pytest.raises(ValueError, match="sort_ranks=False"):
        new_group([1, 0], sort_ranks=False)


def test_device_mesh_calls_new_group_through_its_module():
    """``route_new_group`` replaces ``torch.distributed.device_mesh.new_group``: DeviceMesh must
    look it up there (a module global), not hold its own reference."""
    import torch.distributed.device_mesh as device_mesh

    assert device_mesh.new_group is c10d.new_group
    assert "new_group" in device_mesh.DeviceMesh.__init__.__globals__ or "new_group" in vars(device_mesh)
    assert c10d.GroupMember.NON_GROUP_MEMBER is not None


# -- torch_patches: the rooted object collectives ---------------------------------------------------
@pytest.mark.parametrize("name", ["broadcast_object_list", "scatter_object_list"])
def test_rooted_object_collectives_take_src_group_src_and_group(name):
    """``refuse_rooted_objects_without_peers`` binds the call to torch's signature and reads
    ``group``, ``src`` and ``group_src``."""
    assert {"src", "group", "group_src"} <= parameters(getattr(c10d, name))
    assert getattr(dist, name) is getattr(c10d, name)


def test_a_rooted_object_collective_on_a_spare_is_refused_by_the_guard():
    group = live_group("tm-shape-rooted", size=2, rank=1)
    torch_patches.register(group, [0, 1])
    torch_patches.refuse_rooted_objects_without_peers()
    try:
        with pytest.raises(torch_patches.NoPeersYet, match="broadcast_object_list from rank 0"):
            dist.broadcast_object_list([None], src=0, group=group)
    finally:
        torch_patches.undo_all()
        torch_patches.unregister(group)


# -- torch_patches: DeviceMesh.__new__ and the mesh attributes read ---------------------------------
def test_device_mesh_has_no_new_of_its_own_and_builds_in_init(fake_world):
    """``note_every_mesh`` replaces ``DeviceMesh.__new__`` with ``object.__new__`` plus a note:
    only right while torch builds a mesh in ``__init__`` (a slice and a flattened dimension too)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    own = [c for c in DeviceMesh.__mro__[:-1] if "__new__" in vars(c)]
    assert not own or vars(DeviceMesh)["__new__"].__func__ is torch_patches._plain_new, own  # torch's defines none
    fake_world(0, 4)
    seen = []
    torch_patches.note_every_mesh(seen.append)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        sub = mesh["tp"]
        flat = mesh._flatten("dp_tp")
    finally:
        torch_patches.undo_all()
    assert mesh in seen and any(m is sub for m in seen) and any(m is flat for m in seen)
    fresh = init_device_mesh("cpu", (4,))
    assert all(m is not fresh for m in seen)  # undone: meshes build as before, unnoted


def test_the_mesh_attributes_sharding_decisions_and_replicas_read(fake_world):
    """``spare.sharding_decisions`` compares meshes by the fields torch's own ``__eq__`` and the
    compile registration read; ``state.replicas`` walks to the root mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import _redistribute

    fake_world(0, 4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for name in ("_flatten_rank_map", "_layout", "_device_type", "_mesh_dim_names", "_thread_id"):
        assert name in vars(mesh), name
    assert mesh["tp"]._get_root_mesh() is mesh
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute._planner_cache.clear()


def test_dtensor_keeps_its_local_tensor_and_spec(fake_world):
    """``snapshots.image`` and ``state.ddp_tp`` read a DTensor's ``_local_tensor`` and ``_spec``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    fake_world(0, 2)
    d = distribute_tensor(torch.arange(4.0), init_device_mesh("cpu", (2,)), [Shard(0)])
    assert torch.equal(d._local_tensor, d.to_local()) and d._spec.placements == (Shard(0),)


# -- torch_patches: global optimizer hooks ---------------------------------------------------------
def test_global_optimizer_step_hooks_fire_around_every_step_and_come_off():
    calls = []
    torch_patches.before_every_optimizer_step(lambda opt, args, kwargs: calls.append("pre"))
    handle = torch_patches.after_every_optimizer_step(lambda opt, args, kwargs: calls.append("post"))
    try:
        p = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([p], lr=0.1)
        p.grad = torch.ones(2)
        opt.step()
        assert calls == ["pre", "post"]
        handle.remove()
        opt.step()
        assert calls == ["pre", "post", "pre"]
    finally:
        torch_patches.undo_all()
    opt.step()
    assert calls == ["pre", "post", "pre"]


# -- torch_patches: an object's class (guard_method, gain_methods) ---------------------------------
def test_a_schedulers_state_dict_is_its_dict_so_its_guard_is_a_class_swap():
    """``guard_method`` swaps the class because an LR scheduler's ``state_dict()`` is its
    ``__dict__``: an instance attribute would travel with it."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    sched.tm_probe = 1
    assert sched.state_dict()["tm_probe"] == 1
    del sched.tm_probe
    skipped = []
    torch_patches.guard_method(sched, "step", lambda: False, skipped.append)
    try:
        sched.step()
        assert skipped == [sched] and sched.last_epoch == 0
        assert "step" not in sched.state_dict() and isinstance(sched, torch.optim.lr_scheduler.StepLR)
    finally:
        torch_patches.undo_all()
    assert type(sched) is torch.optim.lr_scheduler.StepLR


def test_a_grad_scaler_keeps_its_per_optimizer_records_in_one_attribute():
    """``job.step_guard._reset_scaler`` replaces ``_per_optimizer_states`` with torch's own factory."""
    from torch.amp.grad_scaler import _refresh_per_optimizer_state

    scaler = torch.amp.GradScaler("cpu")
    assert "_per_optimizer_states" in vars(scaler)
    assert isinstance(_refresh_per_optimizer_state(), dict)


# -- torch_patches: a DataLoader's iterator factory and the attributes state.data_loaders reads ----
def test_a_dataloader_makes_each_iterator_through_get_iterator():
    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2)
    assert parameters(type(loader)._get_iterator) == {"self"}
    made = []
    original = loader._get_iterator
    loader._get_iterator = lambda: made.append(1) or original()
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]] and made == [1]
    assert loader._auto_collation is True and hasattr(loader, "_iterator")


def test_keep_rng_across_iterators_gives_the_global_rng_back():
    loader = torch_patches.keep_rng_across_iterators(torch.utils.data.DataLoader(list(range(4)), shuffle=True))
    try:
        before = torch.random.get_rng_state()
        iter(loader)
        assert torch.equal(torch.random.get_rng_state(), before)
    finally:
        torch_patches.undo_all()


# -- comms: the ProcessGroup extension point and the communicator's assembly ------------------------
def test_a_python_process_group_subclass_and_works_from_futures():
    """``LiveGroup`` subclasses ``ProcessGroup(rank, size)``; ``completed_work`` wraps a future."""
    from torch._C._distributed_c10d import FakeProcessGroup, _create_work_from_future

    group = live_group("tm-shape-subclass")
    t = torch.ones(2)
    group.allreduce([t]).wait()
    assert torch.equal(t, torch.full((2,), 2.0))
    fut = torch.futures.Future()
    fut.set_result(3)
    assert _create_work_from_future(fut).get_future().value() == 3
    assert isinstance(FakeProcessGroup._create_internal(1, 2), FakeProcessGroup)
    assert in_process_backend(0, 2, "fake").size() == 2


def test_every_collective_a_live_group_forwards_is_a_process_group_method():
    """The names ``LiveGroup`` overrides (``groups.COLLECTIVES``) must be the ones torch calls on
    a ProcessGroup; a renamed one would bypass the guard."""
    missing = [name for name in COLLECTIVES if not hasattr(dist.ProcessGroup, name)]
    assert not missing, missing


def test_the_pieces_communicators_assembles_a_group_from():
    """``comms.communicators``: gloo's options, a ProcessGroup with backends registered per device."""
    from torch._C._distributed_c10d import ProcessGroupGloo

    opts = ProcessGroupGloo._Options()
    assert hasattr(opts, "_timeout") and hasattr(opts, "_devices")
    assert callable(ProcessGroupGloo.create_device)
    for name in ("_register_backend", "_set_default_backend", "_set_group_name", "_get_backend"):
        assert hasattr(dist.ProcessGroup, name), name
    assert dist.ProcessGroup.BackendType.GLOO is not None and dist.ProcessGroup.BackendType.NCCL is not None


def test_torch_compile_meets_a_live_group_at_a_graph_break():
    """``groups.outside_graphs``: torch registers ProcessGroup as an opaque type for Dynamo, and a
    collective of a LiveGroup issued from compiled code runs eagerly (a LiveGroup's own frames
    are never traced: tracing them ended every compiled step)."""
    from torch._library.opaque_object import is_opaque_type

    keep_out_of_graphs()
    group = live_group("tm-shape-compile")
    torch_patches.register(group, [0, 1])
    try:
        assert is_opaque_type(dist.ProcessGroup)

        def step(x):
            y = x * 2
            dist.all_reduce(y, group=group)
            return y + 1

        compiled = torch.compile(step, backend="eager")
        assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 5.0))
    finally:
        torch_patches.unregister(group)


# -- DDP, modules: what the spare's rebuild, the live loop and the state transfer call -------------
def test_the_ddp_internals_spares_and_the_live_loop_call():
    from torch._C._distributed_c10d import Reducer
    from torch.nn.parallel import DistributedDataParallel as DDP

    assert callable(Reducer._rebuild_buckets) and callable(Reducer._reset_state)
    assert callable(DDP._remove_autograd_hooks)


def test_the_module_internals_state_transfer_reads():
    m = torch.nn.BatchNorm1d(2)
    m.register_buffer("scratch", torch.zeros(1), persistent=False)
    assert "running_mean" in m._buffers and m._non_persistent_buffers_set == {"scratch"}
    assert isinstance(m._load_state_dict_pre_hooks, dict) and isinstance(m._load_state_dict_post_hooks, dict)
    assert callable(m._load_from_state_dict)
    a, b = [torch.zeros(2)], [torch.ones(2)]
    torch._foreach_copy_(a, b)
    assert torch.equal(a[0], b[0])


# -- the supported releases ------------------------------------------------------------------------
def test_the_torch_in_use_is_one_the_range_admits_or_is_named():
    """The tests pass on the releases of ``torch_support.TESTED``, which ``pyproject.toml``'s
    range spans; a worker on another says so at start (``torch_support.warning``)."""
    version = torch_support.release(torch.__version__)
    assert (version in torch_support.TESTED) == (torch_support.warning(torch.__version__) is None)


# -- torch_patches: pipeline schedules' step (spare.pipeline_stages) ---------------------------------
def test_pipeline_schedules_step_is_defined_by_the_two_base_classes_only():
    """``around_every_pipeline_step`` wraps ``step`` where torch defines it: every schedule
    inherits it from the single-stage or the multi-stage base class."""
    from torch.distributed.pipelining import schedules

    assert "step" in vars(schedules.PipelineScheduleSingle) and "step" in vars(schedules.PipelineScheduleMulti)
    for cls in (
        schedules.ScheduleGPipe,
        schedules.Schedule1F1B,
        schedules.ScheduleInterleaved1F1B,
        schedules.ScheduleLoopedBFS,
        schedules.ScheduleInterleavedZeroBubble,
        schedules.ScheduleZBVZeroBubble,
        schedules.ScheduleDualPipeV,
    ):
        owner = next(k for k in cls.__mro__ if "step" in vars(k))
        assert owner in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti), cls


def test_the_pipeline_set_up_flags_and_stage_attributes_pipeline_stages_reads():
    """``pipeline_stages`` forgets a schedule's set-up through its ``*_initialized`` flags and
    reads each stage's ``group`` and ``stage_index``; torch's set-up runs inside ``step``."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.stage import _PipelineStageBase

    from tm_launch.worker.spare.pipeline_stages import SET_UP_FLAGS

    single = inspect.getsource(schedules.PipelineScheduleSingle.__init__)
    multi = inspect.getsource(schedules.PipelineScheduleMulti.__init__)
    assert all(f"self.{f} = False" in single + multi for f in SET_UP_FLAGS)
    init = inspect.getsource(_PipelineStageBase.__init__)
    assert "self.group = group" in init and "self.stage_index = stage_index" in init
    # discard_leftovers: what a step that failed part-way leaves, per microbatch
    for cache in ("bwd_cache", "backward_state", "dw_runner"):
        assert f"self.{cache}:" in init, cache
    # the forward cache (``fwd_cache`` to torch 2.14, ``_forward_chunk_states`` in 2.15) is
    # cleared by torch's own ``clear_runtime_states``
    clear = inspect.getsource(_PipelineStageBase.clear_runtime_states)
    assert "self.fwd_cache.clear()" in clear or "self._forward_chunk_states.clear()" in clear
    base = inspect.getsource(schedules._PipelineSchedule.__init__)
    assert "self._internal_losses" in base and "self._n_microbatches = n_microbatches" in base
    assert "self._internal_losses.clear()" in inspect.getsource(schedules._PipelineSchedule._update_losses)
    assert "_initialize_pp_stages" in inspect.getsource(schedules._PipelineSchedule)
    runtime = inspect.getsource(schedules._PipelineScheduleRuntime.__init__)
    assert "self.bwd_recv_ops:" in runtime and "self.fwd_recv_ops:" in runtime  # discard_leftovers clears them
    assert "self.unshard_ops:" in runtime and "self.unsharded_stages = set()" in runtime  # and the FSDP unshards it tracks


def test_the_fsdp2_state_reset_fsdp_after_dropped_step_puts_back(fake_world):
    """``reset_fsdp_after_dropped_step``: an FSDP2 module's state (``_get_fsdp_state``: its
    ``_is_root`` once set up, its ``_state_ctx.all_states``, their ``_fsdp_param_groups`` and
    ``fsdp_params``), torch's ``reset_iter_state`` (it reshards a module left unsharded
    mid-backward), and the gradient it keeps on the unsharded parameter (``_unsharded_param``,
    ``unsharded_accumulated_grad``), which the reset drops (torch 2.15's reset drops it itself)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    fake_world(0, 1)
    model = fully_shard(torch.nn.Linear(4, 2), mesh=init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "shard")))
    assert isinstance(model, FSDPModule) and model._get_fsdp_state()._is_root is None  # not set up: left alone
    torch_patches.reset_fsdp_after_dropped_step(model)
    model.set_reshard_after_backward(False)
    model.set_requires_gradient_sync(False)  # as a pipeline stage's backward before its last microbatch
    model(torch.randn(3, 4)).sum().backward()
    state = model._get_fsdp_state()
    assert state._is_root is True
    params = [p for s in state._state_ctx.all_states for g in s._fsdp_param_groups for p in g.fsdp_params]
    assert len(params) == 2 and all(p.sharded_state == ShardedState.UNSHARDED for p in params)
    # held for the last microbatch's reduction: on the unsharded parameter (2.13, 2.14) or as its accumulated grad (2.15)
    assert all(p._unsharded_param.grad is not None or p.unsharded_accumulated_grad is not None for p in params)
    torch_patches.reset_fsdp_after_dropped_step(model)
    assert all(p.sharded_state == ShardedState.SHARDED for p in params)
    assert all(p._unsharded_param.grad is None and p.unsharded_accumulated_grad is None for p in params)
    assert all(g._training_state == TrainingState.IDLE for s in state._state_ctx.all_states for g in s._fsdp_param_groups)


def test_around_every_pipeline_step_wraps_and_undoes():
    from torch.distributed.pipelining import schedules

    before = {cls: vars(cls)["step"] for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti)}
    torch_patches.around_every_pipeline_step(lambda schedule, step, *a, **k: ("around", step))
    try:
        assert schedules.ScheduleGPipe.step(object()) == ("around", before[schedules.PipelineScheduleSingle])
        assert schedules.ScheduleInterleaved1F1B.step(object()) == ("around", before[schedules.PipelineScheduleMulti])
    finally:
        torch_patches.undo_all()
    assert all(vars(cls)["step"] is step for cls, step in before.items())


# -- torch_patches: batch_isend_irecv --------------------------------------------------------------
def test_the_batch_p2p_replacement_meets_torchs_names_and_is_undone():
    """``batch_p2p_through_live_groups`` runs torch's non-coalescing branch itself: it reads a
    ``P2POp``'s fields, calls ``isend``/``irecv`` with ``group_dst``/``group_src`` and checks the
    list with torch's ``_check_p2p_op_list``. Any other group still reaches torch's own."""
    op = dist.P2POp.__init__
    assert {"op", "tensor", "group", "tag", "group_peer"} <= parameters(op)
    assert "group_dst" in parameters(c10d.isend) and "group_src" in parameters(c10d.irecv)
    assert callable(c10d._check_p2p_op_list)
    original = c10d.batch_isend_irecv
    torch_patches.batch_p2p_through_live_groups()
    try:
        assert dist.batch_isend_irecv is c10d.batch_isend_irecv is not original
        assert c10d.batch_isend_irecv.__wrapped__ is original
    finally:
        torch_patches.undo_all()
    assert c10d.batch_isend_irecv is original and dist.batch_isend_irecv is original
