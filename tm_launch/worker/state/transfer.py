"""State transfer between live ranks: the wire format in one place.

A rank that enters a generation behind its peers (a joiner, or a rank that lost a race) receives
every registered object's ``state_dict()`` point-to-point from a live rank holding the same
state (``recovery.plan_recovery``, a pure function). The format: an int64 header length, a pickled header
(step, the state dicts with every tensor replaced by a placeholder, the tensor count), then each
tensor as its own message in index order. Nothing but the header is ever pickled and tensors
never pass through Python objects.

Each tensor travels on a *wire* the sender picks (``wire_for``): a CUDA tensor on the device the
group's NCCL communicator is bound to goes GPU to GPU through NCCL, anything else through gloo
(a CUDA tensor elsewhere is staged through host memory). The header names each tensor's wire,
so both ends drive the same backend in the same order.

Small tensors travel together: host-wire tensors of at most ``PACK_TENSOR_MAX`` bytes go as one
message (a *pack*, each at a 64-byte offset, up to ``PACK_BYTES``), larger ones as their own
message (``wire_units``, computed from the header on both ends). A message costs the receiver
a wake-up whatever its size, and a transformer's norm weights, biases and Adam step counters are
hundreds of tensors: 4 MiB in 1,200 tensors took 76-131 ms one message each and 29-32 ms in
packs on a 2-core machine (``bench/transfer.py --params 300``).

Messages are pipelined: up to ``IN_FLIGHT`` sends (and receives) are posted before the oldest
is waited for, in the same order on both ends (a pair's messages with one tag arrive in the
order they were posted, in gloo as in NCCL). One wait per tensor made each tensor a round trip
between the two processes: a 54 KiB model with its Adam state took 3 to 37 ms on a loaded
2-core machine, most of it waking the other end ~26 times.

The receiver writes each tensor straight into its own tensor at the same place in its state
dicts when that is sure to be right (``loads_in_place``: a module or optimizer loaded by torch's
own ``load_state_dict``; ``receive_targets``: same shape, dtype and layout, dense, storage
shared with no other target); a joiner warmed up in the sandbox, so its model and
optimizer exist, and receiving in place keeps their storage (the optimizer's references, the
parameters DDP or FSDP registered) and needs no second copy of the state, on the host or on the
GPU. Anything else is received into fresh memory and loaded as before.
"""

from __future__ import annotations

import bisect
import collections
import copy
import functools
import math
import pickle

import torch

from ..comms import communicators
from ..log import log

TENSOR = "__tensor__"
GPU_WIRE, HOST_WIRE = "cuda", "cpu"  # NCCL, straight from GPU memory / gloo, through host memory
IN_FLIGHT = 16  # messages posted and not yet waited for, per transfer (bounds the staging memory too)
PACK_TENSOR_MAX = 256 * 2**10  # a host-wire tensor this small travels in a pack with its neighbours
PACK_BYTES = 4 * 2**20  # a pack is closed once it holds this many bytes
ALIGN = 64  # bytes: where each tensor starts in a buffer of several (a pack, a snapshot image): any dtype's view is aligned
# dtypes whose bytes a pack can hold and give back with ``Tensor.view(dtype)``
_PACKABLE = frozenset(
    {"float64", "float32", "float16", "bfloat16", "complex128", "complex64", "int64", "int32", "int16", "int8", "uint8", "bool"}
)


def human_size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


# Values that hold no reference to anything mutable: a copy may be the value itself.
IMMUTABLE_LEAVES = frozenset({int, float, bool, str, bytes, complex, type(None)})


def only_immutable(values) -> bool:
    """Every item of ``values`` (a list or tuple) is an ``IMMUTABLE_LEAVES`` value."""
    return set(map(type, values)) <= IMMUTABLE_LEAVES


def cpu_copy(obj):
    """A deep copy with every tensor detached and on the CPU (per-rank snapshots and mirrors).

    Runs twice per step on every rank's per-rank state (``per_rank``): a sequence of plain
    numbers (Python's RNG state holds 625 ints) is copied in one call, not item by item."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if type(obj) in IMMUTABLE_LEAVES:
        return obj
    if isinstance(obj, dict):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(obj) if only_immutable(obj) else type(obj)(cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


def _progress(verb: str, peer: str, total: int):
    """A callback that says every few seconds how far a long state transfer is (a big model over
    a slow link must not look like a hang); silent for transfers shorter than that."""
    from ...waits import Every

    ticker = Every()
    done = [0]

    def step(nbytes: int) -> None:
        done[0] += nbytes
        if ticker.due():
            log.info(f"{verb} training state {peer}: {human_size(done[0])} of {human_size(total)} after {ticker.elapsed:.0f} s")

    return step


def wire_for(device: torch.device, nccl_device: torch.device | None) -> str:
    """How a tensor on ``device`` travels: through NCCL when it lives on the device the group's
    NCCL communicator is bound to (``nccl_device``; None: the group has no NCCL), else through
    gloo. All members of a group have NCCL or none has (its set-up needs every member)."""
    return GPU_WIRE if nccl_device is not None and torch.device(device) == torch.device(nccl_device) else HOST_WIRE


def flatten(obj, tensors: list, nccl_device: torch.device | None = None):
    """``obj`` with every tensor replaced by a placeholder ``(TENSOR, index, shape, dtype,
    dtensor, wire)``; the tensors (a DTensor's local shard) are appended to ``tensors``.
    ``dtensor`` is None or the layout the receiver rebuilds the DTensor with on its own mesh:
    (mesh dim names, placements, global shape, global stride); ``wire``: ``wire_for``."""
    if isinstance(obj, torch.Tensor):
        layout = None
        if _is_dtensor(obj):
            layout = (obj.device_mesh.mesh_dim_names, tuple(obj.placements), tuple(obj.shape), tuple(obj.stride()))
            obj = obj.to_local()
        tensors.append(obj.detach().contiguous())
        return (TENSOR, len(tensors) - 1, tuple(obj.shape), str(obj.dtype).replace("torch.", ""), layout, wire_for(obj.device, nccl_device))
    if isinstance(obj, dict):
        return {k: flatten(v, tensors, nccl_device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(flatten(v, tensors, nccl_device) for v in obj)
    return obj


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _is_placeholder(obj) -> bool:
    return isinstance(obj, tuple) and len(obj) == 6 and obj[0] == TENSOR


def unflatten(obj, tensors: list):
    if _is_placeholder(obj):
        return tensors[obj[1]]
    if isinstance(obj, dict):
        return {k: unflatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(unflatten(v, tensors) for v in obj)
    return obj


def _placeholders(obj, out: list) -> list:
    if _is_placeholder(obj):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _placeholders(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _placeholders(v, out)
    return out


@functools.cache
def _dtype(name: str) -> torch.dtype:
    """torch's dtype for a placeholder's dtype name (``float32``)."""
    return getattr(torch, name)


def _nbytes(meta: tuple) -> int:
    """The bytes of the tensor behind placeholder ``meta`` (called per tensor, several times)."""
    return math.prod(meta[2]) * _dtype(meta[3]).itemsize


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to ``ALIGN``: where the next tensor of a buffer of several starts."""
    return -(-nbytes // ALIGN) * ALIGN


def wire_units(ordered: list) -> list[tuple[str, list]]:
    """The messages a transfer's tensors travel in, in order (pure; both ends compute it from
    the header's placeholders, ``ordered`` by index): ``("alone", [(index, 0)], size)`` for a
    large tensor, or one that does not travel through host memory; ``("pack", [(index, offset),
    ...], size)`` for the small ones in index order, sent when the pack is closed (full, or last)."""
    units: list = []
    pack: list = []
    size = 0

    def close() -> None:
        nonlocal pack, size
        if pack:
            units.append(("pack", pack, size))
        pack, size = [], 0

    for meta in ordered:
        nbytes = _nbytes(meta)
        if meta[5] == HOST_WIRE and meta[3] in _PACKABLE and nbytes <= PACK_TENSOR_MAX:
            offset = padded(size)
            pack.append((meta[1], offset))
            size = offset + nbytes
            if size >= PACK_BYTES:
                close()
        else:
            units.append(("alone", [(meta[1], 0)], nbytes))
    close()
    return units


def _packed_view(buf: torch.Tensor, offset: int, meta: tuple) -> torch.Tensor:
    """The tensor behind ``meta`` in pack ``buf`` (uint8) at ``offset``: a view, no copy."""
    return buf[offset : offset + _nbytes(meta)].view(_dtype(meta[3])).view(meta[2])


def _own_layout(states: dict) -> tuple[dict, torch.device]:
    """The receiver's meshes by dim names and the device its registered state lives on."""
    meshes, device = {}, torch.device("cpu")
    stack = list(states.values())
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if _is_dtensor(item):
                meshes.setdefault(item.device_mesh.mesh_dim_names, item.device_mesh)
            if item.device.type != "cpu":
                device = item.device
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return meshes, device


def left_on_the_host(skeleton: dict, objects: dict) -> set:
    """Placeholder indices of plain-tensor optimizer state, for optimizers that load with torch's
    own ``Optimizer.load_state_dict``: handed over where they arrive (fresh memory), since that
    load puts each tensor where the optimizer keeps it (its parameter's device; a ``step`` count
    stays on the CPU unless the optimizer is capturable or fused), as when loading a checkpoint.
    Moved to the rank's GPU by us, a CPU ``step`` became a GPU tensor that every later step
    read back with a synchronisation. DTensors are rebuilt on the rank's own mesh as before."""
    out: set = set()
    for name, sk in skeleton.items():
        obj = objects.get(name)
        if isinstance(obj, torch.optim.Optimizer) and type(obj).load_state_dict is torch.optim.Optimizer.load_state_dict:
            out.update(m[1] for m in _placeholders(sk, []) if m[4] is None)
    return out


def loads_in_place(obj) -> bool:
    """Whether ``obj`` may receive into its own tensors: only objects whose ``load_state_dict``
    is torch's own, which puts every entry back where the same entry of ``state_dict()`` came
    from (a module copies key by key into its parameters and buffers, which its state dict's
    tensors share storage with; an optimizer keeps the tensors it is given). Any other object
    (a framework's checkpoint, a wrapper) may load selectively or move entries: fresh memory."""
    if isinstance(obj, torch.nn.Module):
        return type(obj).load_state_dict is torch.nn.Module.load_state_dict
    if isinstance(obj, torch.optim.Optimizer):
        return type(obj).load_state_dict is torch.optim.Optimizer.load_state_dict
    return False


# The load hooks ``fully_shard`` registers, whose effect a copy into a module's own tensors has
# already: the pre-load hook puts the parameters in their sharded form (``state_dict()``, which the
# receiver reads first, ran the same hook), the post-load hook re-pads a parameter whose local
# tensor was replaced (none is).
FSDP_TO_SHARDED_HOOK = "FSDPParamGroup._register_state_dict_hooks.<locals>.to_sharded_hook"  # fully_shard's pre-save and pre-load hook
_EQUIVALENT_LOAD_HOOKS = frozenset({FSDP_TO_SHARDED_HOOK, "FSDPParam.__init__.<locals>.<lambda>"})


def copy_is_the_load(module: torch.nn.Module) -> bool:
    """Whether writing a state dict's values into ``module``'s own state-dict tensors is all its
    ``load_state_dict`` would do: torch's own loader in every submodule, no extra state, no load
    hooks but ``fully_shard``'s. Then the load is skipped: for a DTensor parameter torch's loader
    is a DTensor ``copy_``, whose sharding decision costs milliseconds per parameter the first time
    in a process (a joiner's state, or a rank taking other ranks, always meets it cold: 20-30 ms
    for a small FSDP2 x TP model here), where the copy into the local shard is a plain one."""
    Module = torch.nn.Module
    if type(module).load_state_dict is not Module.load_state_dict:
        return False
    for m in module.modules():
        cls = type(m)
        if cls._load_from_state_dict is not Module._load_from_state_dict or cls.set_extra_state is not Module.set_extra_state:
            return False
        hooks = [*m._load_state_dict_pre_hooks.values(), *m._load_state_dict_post_hooks.values()]
        if any(getattr(h, "__qualname__", None) not in _EQUIVALENT_LOAD_HOOKS for h in hooks):
            return False
    return True


def load_state(obj, skeleton: dict, tensors: list, own: dict | None, written: set) -> None:
    """Load a received or restored state dict (``skeleton`` with ``tensors``) into ``obj``.
    ``written``: placeholder indices whose values are already in ``obj``'s own tensors (``own``:
    its state dict), each at the same key. A module whose every entry is such and for which
    ``copy_is_the_load`` is loaded already; anything else goes through its ``load_state_dict``."""
    if (
        isinstance(obj, torch.nn.Module)
        and own is not None
        and set(skeleton) == set(own)
        and all(_is_placeholder(v) and v[1] in written for v in skeleton.values())
        and copy_is_the_load(obj)
        and _state_dict_is_the_module(obj, own)
    ):
        return
    obj.load_state_dict(unflatten(skeleton, tensors))


def _state_dict_is_the_module(module: torch.nn.Module, own: dict) -> bool:
    """Every tensor of ``own`` (``module.state_dict()``) is a view of the parameter or buffer of
    the same name, so writing into it wrote into the module (a state-dict hook that hands out
    copies, as some wrappers do, fails this and the module is loaded by its own loader)."""
    for key, t in own.items():
        try:
            mine = module.get_parameter(key)
        except AttributeError:
            try:
                mine = module.get_buffer(key)
            except AttributeError:
                return False
        if not isinstance(t, torch.Tensor) or mine is None:
            return False
        a, b = _local(t), _local(mine)
        if (a.data_ptr(), a.shape, a.stride(), a.device) != (b.data_ptr(), b.shape, b.stride(), b.device):
            return False
    return True


def fits(placeholder: tuple, mine) -> bool:
    """Can the tensor behind ``placeholder`` be received straight into ``mine`` (the receiver's
    own tensor at the same place)? Only when nothing about it can differ from what loading a
    fresh copy would give: a plain dense tensor (or a DTensor with the same mesh dims,
    placements, global shape and stride, whose local shard is one) of the same shape and
    dtype, contiguous (one message fills it), on a device that holds memory."""
    _, _, shape, dtype, layout, _ = placeholder
    if not isinstance(mine, torch.Tensor):
        return False
    if _is_dtensor(mine):
        if layout is None:
            return False
        own_layout = (mine.device_mesh.mesh_dim_names, tuple(mine.placements), tuple(mine.shape), tuple(mine.stride()))
        if own_layout != tuple(layout):
            return False
        mine = mine.to_local()
    elif layout is not None:
        return False
    return (
        type(mine) in (torch.Tensor, torch.nn.Parameter)
        and mine.layout == torch.strided
        and mine.device.type in ("cpu", "cuda")
        and tuple(mine.shape) == tuple(shape)
        and str(mine.dtype).replace("torch.", "") == dtype
        and mine.is_contiguous()
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if _is_dtensor(t) else t).detach()


def _claim(claimed: dict, t: torch.Tensor) -> bool:
    """Reserve ``t``'s bytes for one incoming tensor; False when they overlap bytes already
    reserved (tied weights, views of one buffer): the later one is received into fresh memory,
    so no two incoming tensors ever write the same bytes."""
    if t.numel() == 0:
        return True
    start = t.storage_offset() * t.element_size()
    span = (start, start + t.numel() * t.element_size())
    spans = claimed.setdefault((t.device, t.untyped_storage().data_ptr()), [])  # sorted, disjoint
    i = bisect.bisect_left(spans, span)
    if (i > 0 and spans[i - 1][1] > span[0]) or (i < len(spans) and spans[i][0] < span[1]):
        return False
    spans.insert(i, span)
    return True


def receive_targets(skeleton, own) -> dict:
    """For each placeholder of the sender's ``skeleton``: the receiver's own tensor at the same
    place in ``own`` (its state dicts, same nesting) when the values can be received straight
    into it (``fits``, and no byte of it is already the target of another placeholder). Index
    -> tensor; a placeholder without an entry is received into fresh memory."""
    targets: dict = {}
    claimed: dict = {}

    def walk(theirs, mine):
        if _is_placeholder(theirs):
            if fits(theirs, mine) and _claim(claimed, _local(mine)):
                targets[theirs[1]] = mine
        elif isinstance(theirs, dict) and isinstance(mine, dict):
            for k, v in theirs.items():
                if k in mine:
                    walk(v, mine[k])
        elif isinstance(theirs, (list, tuple)) and isinstance(mine, (list, tuple)) and len(theirs) == len(mine):
            for a, b in zip(theirs, mine):
                walk(a, b)

    walk(skeleton, own)
    return targets


def send_state(pg, dst: int, objects: dict, step: int | None) -> int:
    """Send ``objects``' state dicts to rank ``dst``; returns the bytes sent."""
    tensors: list = []
    nccl = communicators.nccl_device(pg)
    skeleton = {name: flatten(obj.state_dict(), tensors, nccl) for name, obj in sorted(objects.items())}
    header = pickle.dumps({"step": step, "skeleton": skeleton, "count": len(tensors)})
    buf = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    total = buf.numel() + sum(t.numel() * t.element_size() for t in tensors)
    progress = _progress("sending", f"to rank {dst}", total)
    pg.send([torch.tensor([buf.numel()], dtype=torch.int64)], dst, 0).wait()
    pg.send([buf], dst, 0).wait()
    metas = sorted(_placeholders(skeleton, []), key=lambda m: m[1])
    posted: collections.deque = collections.deque()  # (work, the tensor on the wire: alive until sent)
    for kind, members, size in wire_units(metas):
        if kind == "pack":
            on_wire = torch.empty(size, dtype=torch.uint8)
            for index, offset in members:
                _packed_view(on_wire, offset, metas[index]).copy_(tensors[index])
        else:
            t = tensors[members[0][0]]
            on_wire = t if wire_for(t.device, nccl) == GPU_WIRE or t.device.type == "cpu" else t.cpu()
        posted.append((pg.send([on_wire], dst, 0), on_wire))
        if len(posted) >= IN_FLIGHT:
            _sent(posted.popleft(), progress)
    while posted:
        _sent(posted.popleft(), progress)
    return total


def _sent(entry, progress) -> None:
    work, on_wire = entry
    work.wait()
    progress(on_wire.numel() * on_wire.element_size())


def recv_state(pg, src: int, objects: dict) -> tuple[int | None, int]:
    """Receive state dicts from rank ``src`` into ``objects``; returns (step, bytes received).
    Tensors go straight into the receiver's own tensors where ``loads_in_place`` and
    ``receive_targets`` allow;
    others are allocated on the device the receiver's state lives on, and DTensors among them
    rebuilt on the receiver's own mesh with the sender's placements. The registered objects
    then load the result, as from any state dict. A receive that fails half-way leaves the
    objects partly written: the caller must not count them as holding any step until it is done."""
    size = torch.zeros(1, dtype=torch.int64)
    pg.recv([size], src, 0).wait()
    buf = torch.empty(int(size.item()), dtype=torch.uint8)
    pg.recv([buf], src, 0).wait()
    header = pickle.loads(buf.numpy().tobytes())
    own = {name: obj.state_dict() for name, obj in objects.items()}
    meshes, device = _own_layout(own)
    in_place = {name for name, obj in objects.items() if loads_in_place(obj)}
    targets = receive_targets(
        {k: v for k, v in header["skeleton"].items() if k in in_place}, {k: v for k, v in own.items() if k in in_place}
    )
    nccl = communicators.nccl_device(pg)
    tensors = [None] * header["count"]
    ordered = sorted(_placeholders(header["skeleton"], []), key=lambda m: m[1])
    total = buf.numel() + sum(map(_nbytes, ordered))
    progress = _progress("receiving", f"from rank {src}", total)
    host = left_on_the_host(header["skeleton"], objects)
    _receive_tensors(pg, src, ordered, targets, nccl, device, meshes, tensors, progress, host)
    for name, skeleton in header["skeleton"].items():
        if name in objects:
            load_state(objects[name], skeleton, tensors, own.get(name), set(targets))
    return header["step"], total


def _receive_tensors(pg, src, ordered, targets, nccl, device, meshes, tensors, progress, host) -> None:
    """Each tensor of ``ordered`` from ``src``, in the sender's messages (``wire_units``),
    pipelined (``IN_FLIGHT``), into ``tensors``; those of ``host`` (``left_on_the_host``) stay
    where they arrived."""
    from torch.distributed.tensor import DTensor

    posted: collections.deque = collections.deque()  # (work, finish): finish() once received

    def settle_oldest() -> None:
        work, finish = posted.popleft()
        work.wait()
        finish()

    def place(meta: tuple, arrived: torch.Tensor, owned: bool) -> None:
        """The tensor behind ``meta`` has arrived in ``arrived`` (``owned``: memory of its own,
        not a pack's): into the receiver's own tensor, or kept as it is (a DTensor rebuilt)."""
        _, index, _, _, layout, _ = meta
        target = targets.get(index)
        if target is not None:
            local = _local(target)
            if (arrived.device, arrived.data_ptr()) != (local.device, local.data_ptr()):  # not received in place
                local.copy_(arrived)  # in place, through one message's worth of staging
            t = target
        else:
            t = arrived if owned else arrived.clone()
            t = t if index in host else t.to(device)
            if layout is not None:
                names, placements, global_shape, global_stride = layout
                if names not in meshes:
                    raise RuntimeError(
                        f"rank {src} sent a DTensor on a mesh with dims {names}, which this rank's registered state does not use"
                    )
                t = DTensor.from_local(t, meshes[names], placements, run_check=False, shape=torch.Size(global_shape), stride=global_stride)
        progress(_nbytes(meta))
        tensors[index] = t

    try:
        for kind, members, size in wire_units(ordered):
            if kind == "pack":
                buffer = torch.empty(size, dtype=torch.uint8)

                def finish(buffer=buffer, members=members) -> None:
                    for index, offset in members:
                        place(ordered[index], _packed_view(buffer, offset, ordered[index]), owned=False)

            else:
                meta = ordered[members[0][0]]
                _, index, shape, dtype, _, wire = meta
                if wire == GPU_WIRE and nccl is None:
                    raise RuntimeError(f"rank {src} sends CUDA tensors through NCCL, but this rank's group has no NCCL")
                on_wire = nccl if wire == GPU_WIRE else torch.device("cpu")
                target = targets.get(index)
                local = None if target is None else _local(target)
                if local is not None and local.device == on_wire:
                    buffer = local  # in place: no copy anywhere
                else:
                    buffer = torch.empty(shape, dtype=_dtype(dtype), device=on_wire)

                def finish(buffer=buffer, meta=meta) -> None:
                    place(meta, buffer, owned=True)

            posted.append((pg.recv([buffer], src, 0), finish))
            if len(posted) >= IN_FLIGHT:
                settle_oldest()
        while posted:
            settle_oldest()
    except BaseException:
        # No receive may be left posted: one that completed later would write into this rank's
        # own tensors after it moved on (and received them again). A broken pair fails them at
        # once; a live one completes them.
        for work, _ in posted:
            try:
                work.wait()
            except Exception:  # noqa: BLE001 -- the first failure is the one raised
                pass
        raise


GATHER_FIRST = 4 * 2**10  # object bytes each rank sends in an all-gather's first round


def allgather_objects(pg, world: int, obj) -> list:
    """Every rank's ``obj`` (small, picklable) through communicator ``pg``. One all-gather of a
    fixed size (the length, then up to ``GATHER_FIRST`` bytes) when every object fits, as a
    recovery's holdings do; a second one for the rest of longer objects. (A length first and
    then the padded objects was two all-gathers every time: at 16 ranks each is a ring of 15
    hops on the recovery's critical path.)"""
    data = pickle.dumps(obj)
    first = torch.zeros(8 + GATHER_FIRST, dtype=torch.uint8)
    first[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    head = data[:GATHER_FIRST]
    first[8 : 8 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    firsts = [torch.empty_like(first) for _ in range(world)]
    pg.allgather([firsts], [first]).wait()
    lengths = [int(f[:8].view(torch.int64).item()) for f in firsts]
    parts = [bytes(f[8 : 8 + min(n, GATHER_FIRST)].numpy()) for f, n in zip(firsts, lengths)]
    rest = max(lengths) - GATHER_FIRST
    if rest > 0:
        tail = data[GATHER_FIRST:]
        mine = torch.zeros(rest, dtype=torch.uint8)
        if tail:
            mine[: len(tail)] = torch.frombuffer(bytearray(tail), dtype=torch.uint8)
        rests = [torch.empty_like(mine) for _ in range(world)]
        pg.allgather([rests], [mine]).wait()
        parts = [p + bytes(r[: max(0, n - GATHER_FIRST)].numpy()) for p, r, n in zip(parts, rests, lengths)]
    return [pickle.loads(p) for p in parts]
