"""Which live ranks hold exactly the state this rank holds: the source a joiner may receive from.

A rank's registered state is made of tensors that are either replicated or sharded across ranks.
For each tensor the set of ranks holding an identical copy is:

* a DTensor: the ranks with this rank's coordinates on every mesh dimension it is sharded
  (``Shard``, ``_StridedShard``) or partial on; replicated dimensions and dimensions outside its
  mesh do not split it (FSDP2 on ``dp`` x TP on ``tp``: nobody; HSDP ``(Replicate, Shard)``: the
  ``replicate`` peers; TP under DDP on ``dp``: the ranks with the same ``tp`` coordinate), except
  a dimension along which this rank's line of ranks is one of its pipeline stages' groups
  (``pipeline_groups``): its other members hold other stages (FSDP2 of a stage on a sub-mesh of
  ``(pp, dp)``: the same ``pp`` coordinate too);
* a local parameter DDP x TP's wrapper made of a DTensor (``state.ddp_tp``): as that DTensor;
* a plain tensor: the members of the group the script declared with
  ``job.register(..., replicas=group)`` (a pipeline stage's data-parallel peers); with nothing
  declared, the ranks whose copy was found bitwise equal to this rank's at the first step
  boundaries after a fresh start (``FoundReplicas``, surveyed by ``generation.replica_survey``):
  plain DDP finds the world, a tensor-parallel-style script whose positions hold different plain
  tensors finds each position's data-parallel peers. Nothing is assumed from a missing declaration.

The rank's replica set is the intersection over all its tensors. A DTensor on a mesh whose
dimensions the root mesh does not name (flattened or unflattened ones) counts the ranks of its own
mesh only: possibly fewer than hold a copy, never a wrong source.
The ``mesh_replicas`` rule is pure and table-tested; ``replica_set`` reads it off live objects.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch


def _coordinates(mesh_ranks: list) -> dict[int, tuple[int, ...]]:
    """global rank -> its coordinates in an n-d mesh given as nested lists of global ranks."""
    coords: dict[int, tuple[int, ...]] = {}

    def walk(node, prefix):
        if isinstance(node, list):
            for i, child in enumerate(node):
                walk(child, (*prefix, i))
        else:
            coords[int(node)] = prefix

    walk(mesh_ranks, ())
    return coords


def mesh_replicas(mesh_ranks: list, sharded_dims: set[int], rank: int) -> frozenset[int]:
    """Ranks of an n-d mesh (nested lists of global ranks) whose coordinates equal ``rank``'s on
    every dimension in ``sharded_dims``; empty when ``rank`` is not in the mesh."""
    coords = _coordinates(mesh_ranks)
    if rank not in coords:
        return frozenset()
    mine = coords[rank]
    return frozenset(r for r, c in coords.items() if all(c[d] == mine[d] for d in sharded_dims))


def pipeline_dims(mesh_ranks: list, rank: int, pipeline_groups) -> set[int]:
    """The dimensions of an n-d mesh along which ``rank``'s line of ranks (its coordinates on
    every other dimension) is one of ``pipeline_groups`` (sets of global ranks): a pipeline
    stage's group, whose other members hold other stages."""
    coords = _coordinates(mesh_ranks)
    if rank not in coords:
        return set()
    mine, groups = coords[rank], {frozenset(g) for g in pipeline_groups}
    dims = set()
    for d in range(len(mine)):
        line = frozenset(r for r, c in coords.items() if all(c[i] == mine[i] for i in range(len(mine)) if i != d))
        if len(line) > 1 and line in groups:
            dims.add(d)
    return dims


def _layout(t):
    """(mesh, placements) of a DTensor, or of a local parameter that stands for one (DDP x TP's
    wrapper keeps the layout in ``_st_info``: ``state.ddp_tp``); None for a plain tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.device_mesh, t.placements
    spec = getattr(t, "_st_info", None)
    return (spec.mesh, spec.placements) if spec is not None else None


def _dtensor_replicas(layout, rank: int, pipeline_groups=()) -> frozenset[int]:
    from torch.distributed.tensor import Replicate

    mesh, placements = layout
    sharded = [i for i, p in enumerate(placements) if not isinstance(p, Replicate)]
    root = mesh._get_root_mesh()
    stages = pipeline_dims(root.mesh.tolist(), rank, pipeline_groups)
    if not sharded:
        return mesh_replicas(root.mesh.tolist(), stages, rank) | {rank}
    names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
    if mesh is root:
        dims = set(sharded)
    elif names and root_names and all(names[i] in root_names for i in sharded):
        dims = {root_names.index(names[i]) for i in sharded}
    else:
        # A mesh of flattened or unflattened dimensions (torchtitan's ("dp_replicate", "fsdp")):
        # the ranks of this mesh itself with this rank's coordinates on its sharded dimensions.
        # Possibly fewer than hold a copy (data-parallel peers outside the mesh), never a rank
        # that does not.
        return mesh_replicas(mesh.mesh.tolist(), set(sharded), rank) | {rank}
    return mesh_replicas(root.mesh.tolist(), dims | stages, rank)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def replica_set(states: dict, declared: dict, rank: int, world: int, pipeline_groups=()) -> frozenset[int]:
    """``states``: name -> state dict; ``declared``: name -> ranks replicating that object (or
    None: the world); ``pipeline_groups``: the global ranks of each of this rank's pipeline
    stages' groups. The ranks holding everything this rank holds, itself included."""
    out = frozenset(range(world))
    for name, state in states.items():
        plain = frozenset(declared.get(name) or range(world))
        for t in _tensors(state):
            layout = _layout(t)
            out &= _dtensor_replicas(layout, rank, pipeline_groups) if layout is not None else plain
    return out | {rank}


def fingerprints(states: dict, modules: set) -> tuple[str, str]:
    """(structure, values) digests of a rank's registered state. Ranks that should be replicas
    must agree on both at the same step; a joiner must agree with its source on the structure of
    its ``modules`` (optimizer state only appears after the first step, so it is left out there)."""
    from torch.distributed.tensor import DTensor

    structure, values = hashlib.sha1(), hashlib.sha1()

    def visit(path, obj):
        if isinstance(obj, torch.Tensor):
            local = obj.to_local() if isinstance(obj, DTensor) else obj
            if path.split("/", 1)[0] in modules:
                structure.update(f"{path}:{tuple(local.shape)}:{local.dtype};".encode())
            flat = local.detach().reshape(-1)
            if flat.numel():
                sample = flat[:: max(1, flat.numel() // 64)][:64].to("cpu", torch.float64)
                values.update(f"{path}:{sample.sum().item()!r}:{sample.abs().sum().item()!r};".encode())
        elif isinstance(obj, dict):
            for k in sorted(obj, key=str):
                visit(f"{path}/{k}", obj[k])
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                visit(f"{path}/{i}", v)

    for name in sorted(states):
        visit(name, states[name])
    return structure.hexdigest()[:16], values.hexdigest()[:16]


# -- replicas found: which ranks hold the same plain tensors, measured -----------------------------
SURVEY_ROUNDS = 2  # step boundaries compared after a fresh start (the first, and one after an update)


@dataclass(frozen=True)
class FoundReplicas:
    """What the replica survey measured, the same on every rank (it is computed from one
    all-gather, and a generation change hands the most complete one to every rank): for each
    registered object, the classes of ranks whose plain tensors were bitwise equal at every
    surveyed boundary. A class bounds the object's replica set from above, as a declaration
    does; DTensor placements and ``replicas=`` stay authoritative (their objects are not surveyed)."""

    rounds: int = 0  # boundaries surveyed so far
    classes: dict = field(default_factory=dict)  # name -> tuple of sorted rank tuples (a partition of the world)

    def of(self, name: str, rank: int, world: int) -> frozenset[int]:
        """The ranks found to hold ``name`` as ``rank`` does (the world before the first round;
        this rank alone for an object the survey never saw, registered after it)."""
        if self.rounds == 0:
            return frozenset(range(world))
        for members in self.classes.get(name, ()):
            if rank in members:
                return frozenset(members)
        return frozenset({rank})

    @property
    def done(self) -> bool:
        return self.rounds >= SURVEY_ROUNDS


def plain_digest(state, digest_of) -> str:
    """One digest of every plain tensor (not a DTensor, nor a local parameter standing for one)
    and every number, string, boolean and None in a nested state, in path order;
    ``digest_of(tensor) -> str`` (an exact digest of its bytes). Other values (a scheduler's
    function, an object whose repr names its address) are left out: they say nothing about
    training state and would differ on every rank."""
    parts = []

    def visit(path, obj):
        if isinstance(obj, torch.Tensor):
            if _layout(obj) is None:
                parts.append(f"{path}={digest_of(obj)}")
        elif obj is None or isinstance(obj, (bool, int, float, str)):
            parts.append(f"{path}:{type(obj).__name__}={obj!r}")
        elif isinstance(obj, dict):
            for k in sorted(obj, key=str):
                visit(f"{path}/{k}", obj[k])
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                visit(f"{path}/{i}", v)

    visit("", state)
    return hashlib.blake2b(";".join(parts).encode(), digest_size=16).hexdigest()


def refine(found: FoundReplicas, records: list) -> FoundReplicas:
    """Pure: ``found`` narrowed by one more survey round. ``records``: every rank's ``(rank,
    {name: digest})``; two ranks stay in one class only if they were in one before and their
    digests of the object are equal now (an object a rank did not report is its own)."""
    ranks = sorted(rank for rank, _ in records)
    by_rank = dict(records)
    names = sorted({name for _, digests in records for name in digests})
    classes = {}
    for name in names:
        before = found.classes.get(name) if found.rounds else (tuple(ranks),)
        if before is None:  # registered after an earlier round: nothing proves a replica
            before = tuple((r,) for r in ranks)
        out = []
        for members in before:
            groups: dict = {}
            for r in members:
                key = by_rank.get(r, {}).get(name)
                groups.setdefault(key if key is not None else ("own", r), []).append(r)
            out.extend(tuple(sorted(g)) for g in groups.values())
        classes[name] = tuple(sorted(out))
    return FoundReplicas(found.rounds + 1, classes)


def most_surveyed(candidates) -> FoundReplicas | None:
    """Pure: of the surveys ranks bring into a generation (None: a fresh process), the one with
    the most rounds: every rank that completed a round computed it from the same all-gather."""
    known = [f for f in candidates if f is not None]
    return max(known, key=lambda f: f.rounds) if known else None
