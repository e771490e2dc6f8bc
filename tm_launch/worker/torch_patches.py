"""Every change this process makes to torch's own objects, in one place: what, why, how undone.

tm-launch wraps torch wherever torch lets it (``LiveGroup`` is a ``ProcessGroup`` subclass, the
torchft way); these are the places where it cannot. Each install is idempotent, applied once
per live worker (``LiveJob``; restart mode and plain torchrun install none but the optimizer
step counter), and recorded, so that ``undo_all()`` puts torch back as it was (tests, and a
reader checking that nothing else is touched: nothing outside this module assigns to torch).

=============================  ==================================================================
patch                          why
=============================  ==================================================================
c10d's group registries        ``LiveGroup``s are entered in the maps torch keeps for its own
(``register``, ``unregister``,  groups (``get_rank(group)``, ``get_process_group_ranks``, the
``install_world``)             by-name registry functional collectives, DTensor and FSDP2
                               resolve through) and made the default group: torch has no public
                               way to register a group it did not build.
``new_group`` (c10d, dist,     ``dist.new_group`` builds a C++ group bound to one store prefix
device_mesh)                   for life; nothing in torch 2.13 swaps a backend under a live
                               group (``shrink_group`` is NCCL-only, no grow). In live mode it
                               hands out ``LiveGroup``s, whose communicator can be replaced.
``batch_isend_irecv`` (c10d,   torch >= 2.14 asks any group for its C++ backend before batching
dist)                          point-to-point operations; a LiveGroup has none: its operations
                               run one by one through it, as on 2.13.
``broadcast_object_list``,     a spare or joiner has no peers before ``job.steps()``; an object
``scatter_object_list``        from another rank would be unpickled from uninitialised memory:
                               refused with one line instead.
``DeviceMesh.__new__``         every mesh built is noted (weakly), so a promoted spare keeps
                               DTensor's cached sharding decisions (``spare.sharding_decisions``).
global optimizer step hooks    the commit guard before every optimizer step (live), the step
                               counter after it (restart mode: ``job.optimizer_steps``): torch's
                               public hooks, global by nature.
an object's class              an LR scheduler's ``step``, a GradScaler's ``update`` run only on a
(``guard_method``,             committed step; a framework's DataLoader gains methods. A
``gain_methods``)              subclass swapped in, not an instance attribute: a scheduler's
                               ``state_dict()`` is its ``__dict__``.
a DataLoader's                 its new iterators give the global RNG back as they found it
``_get_iterator``              (``keep_rng_across_iterators``): the seed draw must not move a
                               rank's per-rank state between a commit and the next step.
``step`` of torch's pipeline    every step of a ``torch.distributed.pipelining`` schedule runs
schedules (``around_every_     through tm-launch (``spare.pipeline_stages``): a stage's one-time
pipeline_step``)               set-up with its neighbours is redone after they changed, skipped
                               in the sandbox; a step whose communication failed is dropped.
FSDP2's per-step state          a pipeline step dropped part-way left a stage's FSDP2 modules
(``reset_fsdp_after_dropped_    mid-backward (unsharded, their training state, pending
step``)                        reductions): torch's ``reset_iter_state``, and the unsharded
                               parameters' gradients it keeps (the dropped microbatches' sum).
``DataLoader.__iter__``        a loader the script iterates itself in ``job.steps()`` hands out
(``route_loader_iteration``)   views of its position kept as per-rank state
                               (``state.loop_loaders``): torch's iterator cannot be rewound for
                               a step that runs again nor repositioned for a rank taking over.
=============================  ==================================================================

Outside this module, one place adds torch hooks, on purpose: ``phase_faults`` (the kill points
of ``tm-launch rehearse``) registers global module-forward and optimizer hooks in a rehearsal's
runs only (armed by ``TM_FAILPOINT``), below the communicators that call it; ``disarm`` removes them.
"""

from __future__ import annotations

import functools
import inspect
import types
import weakref

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .comms.groups import LiveGroup, LocalBackend
from .state import data_loaders

# (owner, attribute, original value) for every assignment, in order; undone in reverse. An
# object (not a module or class) is held weakly: a scheduler guarded here must not outlive the
# script that built it (a spare running the script again for other ranks drops it).
_assigned: list = []
_handles: list = []  # hook handles (torch's own removable registrations)
_installed: set = set()
_MISSING = object()


def _plain_new(cls, *args, **kwargs):
    """``object.__new__`` for a class that had no ``__new__`` of its own. Deleting an assigned
    ``__new__`` does not give one back: CPython keeps the class's new slot pointing at a Python
    ``__new__``, and ``object.__new__`` then refuses the constructor's arguments."""
    return object.__new__(cls)


def _assign(owner, attribute: str, value) -> None:
    if attribute == "__class__":
        original = owner.__class__
    else:
        original = vars(owner).get(attribute, _MISSING)
        if attribute == "__new__" and original is _MISSING:
            original = staticmethod(_plain_new)
    held = owner if isinstance(owner, (type, types.ModuleType)) else weakref.ref(owner)
    _assigned.append((held, attribute, original))
    setattr(owner, attribute, value)


def undo_all() -> None:
    """Put every patched function, class and hook back (in reverse order); registered groups stay."""
    while _handles:
        _handles.pop().remove()
    while _assigned:
        held, attribute, original = _assigned.pop()
        owner = held() if isinstance(held, weakref.ref) else held
        if owner is None:
            continue
        if original is _MISSING:
            try:
                delattr(owner, attribute)
            except AttributeError:
                pass
        else:
            setattr(owner, attribute, original)
    _installed.clear()


# -- c10d's registries -----------------------------------------------------------------------------
def register(group: LiveGroup, global_ranks) -> None:
    """Enter ``group`` in c10d's registries (again after its membership was set)."""
    c10d._world.pg_group_ranks[group] = {g: i for i, g in enumerate(global_ranks)}
    c10d._world.pg_map[group] = (group.backend_name, None)
    c10d._world.pg_names[group] = group.group_name
    c10d._world.pg_backend_config[group] = group.backend_config
    try:
        c10d._unregister_process_group(group.group_name)
    except Exception:  # not registered yet
        pass
    c10d._register_process_group(group.group_name, group)


def unregister(group: LiveGroup) -> None:
    for table in (c10d._world.pg_group_ranks, c10d._world.pg_map, c10d._world.pg_names, c10d._world.pg_backend_config):
        table.pop(group, None)
    try:
        c10d._unregister_process_group(group.group_name)
    except Exception:
        pass


def install_world(group: LiveGroup) -> None:
    """Make ``group`` the default group: ``dist.get_rank()``, ``dist.all_reduce(t)`` use it."""
    c10d._update_default_pg(group)
    register(group, range(group.size()))


# -- functions replaced ----------------------------------------------------------------------------
def route_new_group(factory) -> None:
    """``dist.new_group(ranks, backend=...)`` returns ``factory(ranks, backend)`` (a LiveGroup),
    or torch's non-member marker for ranks outside the group, as torch does."""

    def new_group(
        ranks=None,
        timeout=None,
        backend=None,
        pg_options=None,
        use_local_synchronization=False,
        group_desc=None,
        device_id=None,
        sort_ranks=True,
    ):
        if not sort_ranks and ranks is not None and list(ranks) != sorted(ranks):
            # A LiveGroup's ranks are in global order: another order would give ranks silently
            # different positions in the group than torch would.
            raise ValueError("tm-launch: dist.new_group(sort_ranks=False) with unsorted ranks is not supported in live mode")
        group = factory(None if ranks is None else sorted(int(r) for r in ranks), backend)
        return group if group.rank() >= 0 else c10d.GroupMember.NON_GROUP_MEMBER

    import torch.distributed.device_mesh as device_mesh

    for module in (c10d, dist, device_mesh):
        _assign(module, "new_group", new_group)


def batch_p2p_through_live_groups() -> None:
    """``dist.batch_isend_irecv`` over a ``LiveGroup`` runs each operation through the group, as
    torch 2.13 ran it for any ``ProcessGroup`` subclass (its branch for backends that do not
    coalesce). torch 2.14 and later first ask every group for its C++ backend
    (``group._get_backend(device).supports_coalescing``); a LiveGroup has none (its communicator
    changes with the generations), so the question raised "No backend type associated with device
    type cpu" and every pipeline stage's first step failed live (its shape exchange batches its
    point-to-point objects). Every other group goes to torch's own."""
    original = c10d.batch_isend_irecv

    @functools.wraps(original)
    def batch_isend_irecv(p2p_op_list):
        group = p2p_op_list[0].group if p2p_op_list else None
        if not isinstance(group if group is not None else c10d._get_default_group(), LiveGroup):
            return original(p2p_op_list)
        c10d._check_p2p_op_list(p2p_op_list)
        works = []
        for op in p2p_op_list:
            peer = {"group_dst" if op.op is c10d.isend else "group_src": op.group_peer}
            work = op.op(op.tensor, group=op.group, tag=op.tag, **peer)
            if work:
                works.append(work)
        return works

    for module in (c10d, dist):
        _assign(module, "batch_isend_irecv", batch_isend_irecv)


class NoPeersYet(RuntimeError):
    """A rooted object collective ran before ``job.steps()`` on a rank that has no peers yet."""


def refuse_rooted_objects_without_peers() -> None:
    """``broadcast_object_list`` / ``scatter_object_list`` from another rank cannot be served
    locally: a spare's sandbox or a joining rank runs the script's set-up before it has peers
    (the group is a ``LocalBackend``), and the object it should receive exists only on the
    source. torch would unpickle uninitialised memory; say what is wrong instead. Typical cause:
    loading a checkpoint (``torch.distributed.checkpoint.load``) before ``job.steps()`` without
    ``if not job.in_sandbox`` (a joiner receives the live state from a replica instead)."""
    if "rooted" in _installed:
        return
    _installed.add("rooted")

    def guard(fn, name):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def guarded(*args, **kwargs):
            call = signature.bind(*args, **kwargs).arguments
            group = call.get("group") or c10d._get_default_group()
            if isinstance(group, LiveGroup) and isinstance(group.inner, LocalBackend):
                src, group_src = call.get("src"), call.get("group_src")
                root = group_src if group_src is not None else c10d.get_group_rank(group, src if src is not None else 0)
                if root != group.rank():
                    if group.inner.keeps_own_objects and name == "broadcast_object_list":
                        return None  # the objects stay this rank's own
                    raise NoPeersYet(
                        f"tm-launch: {name} from rank {root if src is None else src} ran before job.steps() on a spare "
                        f"or joining rank, which has no peers yet (its state comes from a live replica): guard it "
                        f"with `if not job.in_sandbox:` (e.g. loading a checkpoint)"
                    )
            return fn(*args, **kwargs)

        return guarded

    for name in ("broadcast_object_list", "scatter_object_list"):
        wrapped = guard(getattr(c10d, name), name)
        for module in (c10d, dist):
            _assign(module, name, wrapped)


def note_every_mesh(note) -> None:
    """``note(mesh)`` for every DeviceMesh this process builds from now on (before the script
    builds any): ``init_device_mesh``, a slice, a flattened dimension, an unpickled one."""
    from torch.distributed.device_mesh import DeviceMesh

    if "meshes" in _installed:
        return
    _installed.add("meshes")

    def tracked_new(cls, *args, **kwargs):
        mesh = object.__new__(cls)
        note(mesh)
        return mesh

    _assign(DeviceMesh, "__new__", staticmethod(tracked_new))


# -- hooks -----------------------------------------------------------------------------------------
def before_every_optimizer_step(hook) -> None:
    """torch's global optimizer step pre-hook (``hook(optimizer, args, kwargs)``)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    _handles.append(register_optimizer_step_pre_hook(hook))


def after_every_optimizer_step(hook):
    """torch's global optimizer step post-hook; returns its handle (removable on its own)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    handle = register_optimizer_step_post_hook(hook)
    _handles.append(handle)
    return handle


def around_every_pipeline_step(around) -> None:
    """Every ``step()`` of torch's pipeline schedules (the single-stage and the multi-stage
    base classes define it; GPipe, 1F1B, interleaved and zero-bubble inherit it) calls
    ``around(schedule, original_step, *args, **kwargs)`` instead. torch has no hook around a
    schedule's step, and the set-up to redo is inside it."""
    if "pipeline_step" in _installed:
        return
    _installed.add("pipeline_step")
    from torch.distributed.pipelining import schedules

    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        original = vars(cls)["step"]

        @functools.wraps(original)
        def step(self, *args, _original=original, **kwargs):
            return around(self, _original, *args, **kwargs)

        _assign(cls, "step", step)


def reset_fsdp_after_dropped_step(module) -> None:
    """Every FSDP2 root in ``module`` (a pipeline stage's) back to where a step starts, after a
    step dropped part-way (``spare.pipeline_stages.discard_leftovers``): its backward was cut
    off between microbatches, FSDP still held its parameters unsharded with its training state
    and collectives mid-step, and the step run again failed in its first reshard ("Trying to
    resize storage that is not resizable"). torch's ``FSDPModule.reset_iter_state`` reshards and
    clears the per-iteration state, but it keeps the gradients accumulated on the *unsharded*
    parameters (a stage defers its reduction to its last microbatch), which the step run again
    would add to its own: they are dropped too. A root FSDP never ran (not lazily set up yet)
    holds no step state and is left alone (its reset would raise)."""
    from torch.distributed.fsdp import FSDPModule

    for root in module.modules():
        if not isinstance(root, FSDPModule) or root._get_fsdp_state()._is_root is not True:
            continue
        root.reset_iter_state()
        for state in root._get_fsdp_state()._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                for param in group.fsdp_params:
                    if hasattr(param, "_unsharded_param"):  # set at its first all-gather
                        param._unsharded_param.grad = None
                    if not isinstance(getattr(type(param), "unsharded_accumulated_grad", None), property):
                        param.unsharded_accumulated_grad = None  # its own buffer to torch 2.14 (2.15: the leaf's grad)


# -- objects ---------------------------------------------------------------------------------------
def guard_method(obj, method: str, allowed, on_skip) -> None:
    """``obj.<method>`` runs only when ``allowed()`` (``on_skip(obj)`` runs instead).

    The object's class is swapped for a subclass overriding the method, not the method set on
    the instance: an LR scheduler's ``state_dict()`` is its ``__dict__``, so an instance
    attribute would travel (unpicklable) to a joiner and be loaded over its own."""
    cls = type(obj)
    if getattr(cls, "_tm_guarded", None) == method:
        return
    original = getattr(cls, method)

    def guarded(self, *args, **kwargs):
        if allowed():
            return original(self, *args, **kwargs)
        if on_skip is not None:
            on_skip(self)
        return None

    _assign(obj, "__class__", type(cls.__name__, (cls,), {method: guarded, "_tm_guarded": method, "__module__": cls.__module__}))


def gain_methods(obj, methods: dict) -> None:
    """Give ``obj`` (a DataLoader) ``methods`` by swapping its class for a subclass holding them.
    The methods are copied into the subclass rather than mixed in before it: CPython refuses a
    ``__class__`` change to a class whose bases differ in layout from the object's own."""
    cls = type(obj)
    _assign(obj, "__class__", type(cls.__name__, (cls,), {**methods, "__module__": cls.__module__, "__slots__": ()}))


def keep_rng_across_iterators(loader):
    """``loader`` itself, its new iterators leaving the global CPU RNG as they found it.

    A DataLoader iterator draws its workers' base seed from the global RNG, which is also
    dropout's per-rank stream. A loop that starts an iterator at each epoch would move a rank's
    per-rank state between a step's commit vote and the next step's start, so the vote-time
    mirror of that state could not be trusted any more (``tm_launch.worker.state.per_rank``) and a rank lost
    in that window could not be replaced live. The base seed is still drawn, from the RNG as it
    is, and then given back. (An instance attribute, not a class swap: accelerate's
    DataLoaderShard reports its base class as its ``__class__``, which cannot be assigned; its
    iterators come from the DataLoader it wraps.)"""
    target = getattr(loader, "base_dataloader", loader)
    make_iterator = target._get_iterator

    def keeping_rng():
        state = torch.random.get_rng_state()
        try:
            return make_iterator()
        finally:
            torch.random.set_rng_state(state)

    _assign(target, "_get_iterator", keeping_rng)
    data_loaders.owned.add(target)  # a framework's loop positions it: never routed (route_loader_iteration)
    if target is not loader and isinstance(loader, torch.utils.data.DataLoader):
        data_loaders.owned.add(loader)
    return loader


def route_loader_iteration(iterate) -> None:
    """``iter(loader)`` on a torch ``DataLoader`` (and subclasses that keep its ``__iter__``)
    returns ``iterate(loader, torch's __iter__)``: live mode's ``LoopLoaders.iterate``."""
    if "loader-iter" in _installed:
        return
    _installed.add("loader-iter")
    from torch.utils.data import DataLoader

    make_iterator = DataLoader.__iter__

    def routed(self):
        return iterate(self, make_iterator)

    _assign(DataLoader, "__iter__", routed)
