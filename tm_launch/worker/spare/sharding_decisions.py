"""DTensor's cached sharding decisions, kept when a process takes other ranks.

DTensor caches a sharding decision per operator and input specs (a Python cache and the C++
dispatch fast path's, both per thread), and a spec's ``DeviceMesh`` compares by its layout only:
not by the rank's coordinate in it, nor by the groups behind it. A spare warms up as some ranks
in its sandbox and fills those caches; promoted to other ranks, it runs the script again, and
its new meshes compare equal to the old ones. A cached decision would then hand the new
tensors an old mesh, with the old ranks' coordinate and groups (on an H100: "Could not resolve
the process group registered under the name ...").

Dropping the caches is correct but leaves the promoted spare's warm-up step to decide every
layout again while the job waits for it: 30-80 ms of an FSDP2, HSDP or FSDP2 x TP recovery, most of
it in the optimizer's step over sharded parameters. The decisions themselves do not depend on
the rank: no propagation rule reads a coordinate (DTensor's SPMD contract: every rank must
decide alike; ``tests/unit/worker/spare/test_sharding_decisions.py`` checks torch's sources for it).
Only the mesh objects they hold are wrong. So the old meshes are kept and corrected instead:

* ``retire_meshes()`` (when the process takes other ranks) makes every mesh it built compare
  equal to nothing, so no lookup by a new mesh finds a decision holding an old one, and drops
  the caches that *do* depend on the coordinate (redistribution plans: uneven shards' logical
  shapes);
* ``adopt_meshes()`` (once the script has run again, before its warm-up step) turns each
  retired mesh into a copy of the new mesh equal to it by layout: its coordinate, its groups,
  its root. The decisions cached with it are then the new ranks' own. A retired mesh without a
  counterpart stays retired; its decisions are never found.
"""

from __future__ import annotations

import weakref

# id -> weak reference, for every DeviceMesh of this process that is alive (meshes hash by value,
# so no WeakSet). A dead one leaves at once: a script may slice a mesh in every step.
_built: dict = {}


class _Retired:
    """A retired mesh's ``_thread_id`` (which ``DeviceMesh.__eq__`` and its hash read): equal to
    nothing but itself. It keeps the value it replaced, to match the mesh's counterpart."""

    __slots__ = ("thread_id",)

    def __init__(self, thread_id):
        self.thread_id = thread_id


def track_meshes() -> None:
    """Note every DeviceMesh this process builds from now on (once per process, before the
    script builds any): ``init_device_mesh``, a slice, a flattened dimension, an unpickled one
    (``torch_patches.note_every_mesh``)."""
    from .. import torch_patches

    torch_patches.note_every_mesh(_note)


def _note(mesh) -> None:
    key = id(mesh)
    _built[key] = weakref.ref(mesh, lambda _, key=key: _built.pop(key, None))


def _meshes() -> list:
    return [m for m in (ref() for ref in list(_built.values())) if m is not None]


def retire_meshes() -> None:
    """This process is about to take other ranks: no decision cached with one of its meshes may
    be found again until ``adopt_meshes`` has corrected that mesh."""
    from torch.distributed.tensor import _redistribute

    for mesh in _meshes():
        if not isinstance(mesh.__dict__.get("_thread_id"), _Retired):
            mesh._thread_id = _Retired(mesh.__dict__.get("_thread_id"))
    # Redistribution plans read the coordinate (uneven shards' logical shapes): never kept.
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute._planner_cache.clear()


def _equality_key(mesh, thread_id) -> tuple | None:
    """What ``DeviceMesh.__eq__`` compares (``thread_id`` given: a retired mesh's is hidden);
    torch 2.15 compares ``_preserve_rank_order`` too, after the thread."""
    try:
        key = (mesh._flatten_rank_map, mesh._layout, mesh._device_type, mesh._mesh_dim_names, thread_id)
    except AttributeError:  # built half-way (its constructor failed)
        return None
    if hasattr(mesh, "_preserve_rank_order"):
        key += (mesh._preserve_rank_order,)
    return key


def adopt_meshes() -> int:
    """Each retired mesh becomes a copy of the first mesh built since that equals it by layout,
    so the decisions cached with it hold the new ranks' coordinate and groups. Returns how many
    were adopted (the others stay retired)."""
    new: dict = {}
    retired = []
    for mesh in _meshes():
        thread_id = mesh.__dict__.get("_thread_id")
        if isinstance(thread_id, _Retired):
            retired.append(mesh)
        elif "_coordinate_on_dim" in mesh.__dict__:  # built to the end
            key = _equality_key(mesh, thread_id)
            if key is not None:
                new.setdefault(key, mesh)
    adopted = 0
    for old in retired:
        twin = new.get(_equality_key(old, old._thread_id.thread_id))
        if twin is not None:
            old.__dict__.update(twin.__dict__)
            adopted += 1
    return adopted
