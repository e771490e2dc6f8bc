"""A rank's registered state as host memory: what a snapshot keeps, sends and restores.

``StateImage`` holds every registered object's ``state_dict()`` with each tensor replaced by a
placeholder (``transfer.flatten``'s format: shape, dtype and, for a DTensor, the layout to
rebuild it with) and the tensors themselves as host copies, in placeholder order. It is the
same shape of data the live transfer sends, so a snapshot travels by the same wire format.

Capturing runs in two parts, so that the copy can overlap the next step's compute without ever
copying a tensor mid-change (``Capture``):

* **at the step boundary** (``Capture.begin``): the state dicts are read and every tensor that
  may change during the step's forward and backward is copied at once: a module's buffers
  (BatchNorm's running statistics change in the forward), and everything of objects that are
  neither modules nor optimizers (schedulers, scalers, the script's own stateful objects);
* **in the background** (``Capture.copy``): the parameters and the optimizer state, which
  change only when the optimizer steps. The commit of the step waits for the copy to finish
  (``Snapshots.ready_to_commit``), so the optimizer never changes a tensor the copy still reads.

On CUDA the background copy runs on a side stream into pinned host buffers (no GPU memory is
allocated for it); on the CPU it is a plain copy on the snapshot thread. Either way it is one
call (``torch._foreach_copy_``): the snapshot thread takes the GIL back once per copy, not once
per tensor, so it neither waits for the main thread's GIL switch interval nor makes the main
thread wait for it dozens of times a step.

An image's tensors are views of one host buffer (``host_tensors``), each at a ``transfer.ALIGN``-byte
offset, in placeholder order: an object's tensors are one contiguous range of it, so an image
or the subset of its objects a holder gets travels in a few ``sendall`` calls and arrives in one
``recv_into`` (``wire_chunks``). Buffers are reused from the image two steps older when the
layout is unchanged: a steady state allocates nothing.

Loading (``load_into``) rebuilds each DTensor from its host shard on the receiver's own mesh
and hands every object its state dict through ``load_state_dict``; objects other than modules
get fresh tensors (an optimizer keeps the tensors it is given, and must never keep an image's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..state.replicas import fingerprints
from ..state.transfer import (
    _is_dtensor,
    _local,
    _own_layout,
    _placeholders,
    flatten,
    left_on_the_host,
    load_state,
    loads_in_place,
    padded,
    receive_targets,
    unflatten,
)


def host_tensors(specs, pin: bool = False) -> tuple[torch.Tensor, list, list]:
    """One host buffer for tensors of ``specs`` [(shape, dtype)]: (the buffer, the tensors as
    views of it in order, each one's (offset, padded size) span). Pinned for a CUDA source."""
    flat = torch.zeros(wire_size(specs), dtype=torch.uint8, pin_memory=pin)  # padding sent as zeros
    return (flat, *_views(flat, specs))


def _views(flat: torch.Tensor, specs) -> tuple[list, list]:
    """The tensors of ``specs`` as views of the uint8 buffer ``flat``, each at a ``transfer.ALIGN``
    offset, in order, and each one's (offset, padded size) span."""
    views, spans, offset = [], [], 0
    for shape, dtype in specs:
        n = torch.Size(shape).numel() * dtype.itemsize
        views.append(flat[offset : offset + n].view(dtype).view(shape))
        spans.append((offset, padded(n)))
        offset += padded(n)
    return views, spans


def specs_of(skeleton: dict) -> list:
    """[(shape, dtype)] of an image's tensors in placeholder order, from its skeleton."""
    metas = sorted(_placeholders(skeleton, []), key=lambda m: m[1])
    return [(tuple(m[2]), getattr(torch, m[3])) for m in metas]


def wire_size(specs) -> int:
    """Bytes an image of tensors ``specs`` takes on the wire (each tensor padded to ``transfer.ALIGN``)."""
    return sum(padded(torch.Size(shape).numel() * dtype.itemsize) for shape, dtype in specs)


@dataclass
class StateImage:
    """Registered state at ``step`` (committed steps: the state the step ``step`` starts from)."""

    step: int
    skeleton: dict  # object name -> its state dict with placeholders for tensors
    tensors: list  # host tensors, in placeholder order
    digests: dict = field(default_factory=dict)  # object name -> (structure, values): ``fingerprints()``
    per_rank: dict | None = None  # per-rank objects' states at ``step`` (already host copies), if any
    modules: frozenset = frozenset()  # the objects that are modules (their structure is fingerprinted)
    flat: torch.Tensor | None = None  # the host buffer ``tensors`` are views of (``host_tensors``): every image has one
    spans: list | None = None  # each tensor's (offset, padded size) in ``flat``

    @classmethod
    def from_wire(cls, step: int, skeleton: dict, data: torch.Tensor, per_rank, modules) -> StateImage:
        """The image whose wire bytes (``wire_chunks``) are ``data`` (uint8): its tensors are views of it."""
        specs = specs_of(skeleton)
        if wire_size(specs) != data.numel():
            raise ValueError(f"{data.numel()} bytes for a snapshot whose tensors take {wire_size(specs)}")
        views, spans = _views(data, specs)
        return cls(step, skeleton, views, {}, per_rank, frozenset(modules), data, spans)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def specs(self) -> list:
        """[(shape, dtype)] of the tensors, in order."""
        return [(tuple(t.shape), t.dtype) for t in self.tensors]

    def wire_chunks(self) -> list:
        """The tensors' bytes as the wire carries them (each padded to ``transfer.ALIGN``), as few
        contiguous pieces of the buffer as the layout allows: one per run of adjacent tensors."""
        runs: list = []
        for offset, size in self.spans:
            if runs and runs[-1][1] == offset:
                runs[-1][1] = offset + size
            elif size:
                runs.append([offset, offset + size])
        data = self.flat.numpy()
        return [memoryview(data[a:b]) for a, b in runs]

    def names(self) -> list[str]:
        return sorted(self.skeleton)

    def subset(self, names) -> StateImage:
        """The image of ``names`` only (tensors renumbered), sharing this image's tensors."""
        keep = {n: self.skeleton[n] for n in sorted(names) if n in self.skeleton}
        order = sorted({p[1] for p in _placeholders(keep, [])})
        renumber = {old: new for new, old in enumerate(order)}
        return StateImage(
            self.step,
            _renumber(keep, renumber),
            [self.tensors[i] for i in order],
            {n: self.digests[n] for n in keep if n in self.digests},
            self.per_rank,
            self.modules & set(keep),
            self.flat,
            None if self.spans is None else [self.spans[i] for i in order],
        )

    def fingerprints(self) -> dict:
        """{name: (structure, values)} of the image, computed when first asked: a recovery asks
        for the images it may return to, a step never does (hashing every step cost each rank
        about a millisecond of a core). The host tensors of an image do not change while it is
        kept (a capture only reuses the buffers of an image it took out of the kept ones)."""
        missing = [name for name in sorted(self.skeleton) if name not in self.digests]
        if missing:
            states = self.states()
            with torch.no_grad():
                for name in missing:
                    self.digests[name] = fingerprints({name: states[name]}, self.modules & {name})
        return self.digests

    def states(self) -> dict:
        """Each object's state dict with the host tensors in place (shared, not copied)."""
        return {name: unflatten(s, self.tensors) for name, s in self.skeleton.items()}

    def load_into(self, objects: dict, names=None) -> None:
        """Load ``names`` (default: every object of the image) into the live ``objects``."""
        from torch.distributed.tensor import DTensor

        names = self.names() if names is None else sorted(names)
        own = {name: objects[name].state_dict() for name in names}
        meshes, device = _own_layout(own)
        host = left_on_the_host({name: self.skeleton[name] for name in names}, objects)
        for name in names:
            obj = objects[name]
            fresh = not isinstance(obj, torch.nn.Module)  # an optimizer keeps the tensors it is given
            # A module's values go straight into its own tensors where they fit (its storage, and
            # what refers to it, stay valid; ``transfer.load_state`` may then skip its loader).
            targets = receive_targets({name: self.skeleton[name]}, {name: own[name]}) if not fresh and loads_in_place(obj) else {}
            values = {}
            for meta in _placeholders(self.skeleton[name], []):
                _, index, _, _, layout, _ = meta
                t = self.tensors[index]
                if index in targets:
                    _local(targets[index]).copy_(t)
                    values[index] = targets[index]
                    continue
                if index in host:
                    t = t.clone()  # its load puts it where the optimizer keeps it
                elif device.type != "cpu" or fresh:
                    t = t.to(device, copy=fresh)
                if layout is not None:
                    names_, placements, global_shape, global_stride = layout
                    if names_ not in meshes:
                        raise RuntimeError(
                            f"a snapshot of '{name}' has a DTensor on a mesh with dims {names_}, "
                            "which this rank's registered state does not use"
                        )
                    t = DTensor.from_local(
                        t, meshes[names_], placements, run_check=False, shape=torch.Size(global_shape), stride=global_stride
                    )
                values[index] = t
            load_state(obj, self.skeleton[name], values, own[name], set(targets))


def _renumber(obj, mapping: dict):
    if isinstance(obj, tuple) and len(obj) == 6 and obj[0] == "__tensor__":
        return (obj[0], mapping[obj[1]], *obj[2:])
    if isinstance(obj, dict):
        return {k: _renumber(v, mapping) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_renumber(v, mapping) for v in obj)
    return obj


class Capture:
    """One snapshot being taken: ``__init__`` at the step boundary, ``copy`` on the snapshot thread.

    Both run without autograd: a DTensor's ``to_local()`` is then its local tensor, not an
    autograd function's output (half of the boundary's cost with FSDP2's parameters).

    ``plans`` (kept by the caller from one capture to the next) holds what a module's walk found
    (``ModulePlan``): while the module's state dict holds the same tensor objects with the same
    layouts, its placeholders and which of its tensors change only in the optimizer step are
    taken from there, and only the tensors themselves are read again (a parameter whose data was
    swapped is read where it is now)."""

    @torch.no_grad()
    def __init__(self, step: int, objects: dict, per_rank: dict | None, reuse: StateImage | None, plans: dict | None = None):
        self.step = step
        self._modules = {name for name, obj in objects.items() if isinstance(obj, torch.nn.Module)}
        plans = {} if plans is None else plans
        sources: list = []
        skeleton: dict = {}
        later: list[int] = []
        for name in sorted(objects):
            obj = objects[name]
            base = len(sources)
            if isinstance(obj, torch.nn.Module):
                state = obj.state_dict(keep_vars=True)  # the tensors themselves: their identity says the walk still holds
                plan = plans.get(name)
                tensors = plan.sources(state, base) if plan is not None else None
                if tensors is None:
                    plan, tensors = ModulePlan.walk(obj, state, base)
                    plans[name] = plan
                skeleton[name] = plan.skeleton
                sources.extend(tensors)
                later.extend(base + i for i in plan.later)
                continue
            state = obj.state_dict()
            skeleton[name] = flatten(state, sources)
            if isinstance(obj, torch.optim.Optimizer):  # its state changes only when it steps
                later.extend(range(base, len(sources)))
            else:  # a stand-in for modules or optimizers (its ``parts()``): their tensors, where it holds them
                stepped = _stepped_storages(obj)
                later.extend(i for i in range(base, len(sources)) if sources[i].numel() and _storage(sources[i]) in stepped)
        self._sources = [t.to_local() if _is_dtensor(t) else t for t in sources]
        flat, buffers, spans = _reuse(reuse, self._sources)
        self.allocated = reuse is None or flat is not reuse.flat  # new host memory (the layout changed)
        self.image = StateImage(
            step, skeleton, buffers, per_rank=per_rank or None, modules=frozenset(self._modules), flat=flat, spans=spans
        )
        self._later = later
        later_set = set(later)
        now = [i for i in range(len(buffers)) if i not in later_set]
        if now:
            torch._foreach_copy_([buffers[i] for i in now], [self._sources[i] for i in now])
        self._stream = None
        if any(t.is_cuda for t in self._sources):
            self._stream = torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())  # the step's work so far is what we copy

    @torch.no_grad()
    def copy(self) -> StateImage:
        """Copy what may wait for the optimizer step; returns the finished image."""
        buffers, sources = self.image.tensors, self._sources
        dst, src = [buffers[i] for i in self._later], [sources[i] for i in self._later]
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                if dst:
                    torch._foreach_copy_(dst, src, non_blocking=True)
            self._stream.synchronize()
        elif dst:
            torch._foreach_copy_(dst, src)
        self._sources = []  # no reference to live tensors outlives the copy
        return self.image


class ModulePlan:
    """A module's state dict as a capture walked it: its placeholders (numbered from ``base``),
    which of its tensors are parameters (they change only in the optimizer step: copied off the
    main thread) and the tensor objects it found, held so that their identity stays meaningful."""

    def __init__(self, base: int, skeleton: dict, keys: tuple, values: tuple, layouts: tuple, later: tuple):
        self.base, self.skeleton, self.keys, self.values = base, skeleton, keys, values
        self._layouts = layouts  # per value: (DTensor spec or None, local shape, dtype)
        self.later = later  # positions (from base) of the parameters' tensors

    @classmethod
    def walk(cls, module: torch.nn.Module, state: dict, base: int) -> tuple[ModulePlan, list]:
        """Walk ``state`` (the module's state dict, its tensors themselves): the plan, and the
        tensors to copy now in placeholder order."""
        found: list = [None] * base  # flatten numbers placeholders by list position
        skeleton = flatten(state, found)
        params = {_storage(p) for p in module.parameters() if p.numel()}
        metas = _placeholders(skeleton, [])
        later = tuple(m[1] - base for m, t in zip(metas, _leaf_tensors(state)) if t.numel() and _storage(t) in params)
        values = tuple(state.values())
        cacheable = all(isinstance(v, torch.Tensor) for v in values)  # an extra state may change without a new object
        plan = cls(base, skeleton, tuple(state) if cacheable else (), values if cacheable else (), _layouts(values), later)
        return plan, found[base:]

    def sources(self, state: dict, base: int) -> list | None:
        """The tensors to copy from ``state`` (this module's state dict now), in placeholder
        order; None when this plan no longer describes it (new tensor objects, a changed layout)."""
        if base != self.base or not self.keys or tuple(state) != self.keys:
            return None
        values = tuple(state.values())
        if any(a is not b for a, b in zip(values, self.values)):
            return None
        for (spec, shape, dtype), v in zip(self._layouts, values):
            local = v._local_tensor if spec is not None else v
            if (spec is not None and v._spec is not spec) or local.shape != shape or local.dtype != dtype:
                return None
        return [v.to_local() if _is_dtensor(v) else v for v in values]


def _stepped_storages(obj) -> set:
    """Storages that change only in an optimizer step, of the modules and optimizers an object
    stands in for (``parts()``: torchtitan's ``ModelTensors``, Lightning's whole checkpoint):
    their parameters and their optimizer state. Its tensors held there are copied off the main
    thread (on a GPU: not a synchronous copy of the model at every step's start); a copy it
    makes of them is not found here, and is copied at the boundary."""
    parts = getattr(obj, "parts", None)
    out: set = set()
    for part in parts() if callable(parts) else ():
        if isinstance(part, torch.nn.Module):
            out.update(_storage(p) for p in part.parameters() if p.numel())
        elif isinstance(part, torch.optim.Optimizer):
            out.update(_storage(v) for s in part.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.numel())
    return out


def _layouts(values) -> tuple:
    """Per tensor: (its DTensor spec or None, its local shape, dtype); None for other values."""
    out = []
    for v in values:
        if _is_dtensor(v):
            out.append((v._spec, v._local_tensor.shape, v._local_tensor.dtype))
        elif isinstance(v, torch.Tensor):
            out.append((None, v.shape, v.dtype))
        else:
            out.append(None)
    return tuple(out)


def _reuse(old: StateImage | None, sources: list) -> tuple[torch.Tensor, list, list]:
    """Host buffer, tensors and spans for ``sources``: the old image's when every shape and
    dtype matches (a steady state allocates nothing), else new ones (pinned for CUDA tensors)."""
    if (
        old is not None
        and old.flat is not None
        and len(old.tensors) == len(sources)
        and all(b.shape == s.shape and b.dtype == s.dtype for b, s in zip(old.tensors, sources))
    ):
        return old.flat, old.tensors, old.spans
    return host_tensors([(s.shape, s.dtype) for s in sources], pin=any(s.is_cuda for s in sources))


def _storage(t) -> int:
    local = t.to_local() if _is_dtensor(t) else t
    return local.untyped_storage().data_ptr()


def _leaf_tensors(obj) -> list:
    """Tensors in ``obj`` in the order ``flatten`` visits them."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _leaf_tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _leaf_tensors(v)]
    return []
