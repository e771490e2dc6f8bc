"""Make torch's own group machinery work on live groups.

Why this exists instead of a registered backend: ``dist.new_group`` builds a C++ ProcessGroup
around backends bound to one store prefix for the group's whole life, and nothing in torch 2.13
swaps a backend under a live group (``shrink_group`` is NCCL-only, there is no grow). Live
substitution needs the group *object* that DDP, FSDP2 and DeviceMesh hold to survive while its
communicator is replaced, so in live mode ``dist.new_group`` (and the copy DeviceMesh imported)
hands out ``LiveGroup``s, and each is entered in c10d's registries the way torch enters its own:
the group maps (``get_rank(group)``, ``get_process_group_ranks``), and the by-name registry that
functional collectives, DTensor and FSDP2 resolve groups through.
"""

from __future__ import annotations

import itertools

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .groups import LiveGroup, LocalBackend

_names = itertools.count()


def unique_name(ranks) -> str:
    members = "world" if ranks is None else "-".join(map(str, ranks))
    return f"tm-{next(_names)}-{members}"


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


def route_new_group(factory) -> None:
    """``dist.new_group(ranks, backend=...)`` returns ``factory(ranks, backend)`` (a LiveGroup),
    or torch's non-member marker for ranks outside the group, as torch does."""

    def new_group(
        ranks=None, timeout=None, backend=None, pg_options=None, use_local_synchronization=False, group_desc=None, device_id=None
    ):
        group = factory(None if ranks is None else sorted(int(r) for r in ranks), backend)
        return group if group.rank() >= 0 else c10d.GroupMember.NON_GROUP_MEMBER

    import torch.distributed.device_mesh as device_mesh

    for module in (c10d, dist, device_mesh):
        module.new_group = new_group


class NoPeersYet(RuntimeError):
    """A rooted object collective ran before ``job.steps()`` on a rank that has no peers yet."""


def refuse_rooted_objects_without_peers() -> None:
    """``broadcast_object_list`` / ``scatter_object_list`` from another rank cannot be served
    locally: a spare's sandbox or a joining rank runs the script's set-up before it has peers
    (the group is a ``LocalBackend``), and the object it should receive exists only on the
    source. torch would unpickle uninitialised memory; say what is wrong instead. Typical cause:
    loading a checkpoint (``torch.distributed.checkpoint.load``) before ``job.steps()`` without
    ``if not job.in_sandbox`` (a joiner receives the live state from a replica instead)."""

    import functools
    import inspect

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

    for name in ("broadcast_object_list", "scatter_object_list"):  # once per process (LiveJob)
        wrapped = guard(getattr(c10d, name), name)
        for module in (c10d, dist):
            setattr(module, name, wrapped)
