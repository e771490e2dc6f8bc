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
allocated for it); on the CPU it is a plain copy on the snapshot thread. Buffers are reused
from the image two steps older when the layout is unchanged: a steady state allocates nothing.

Loading (``load_into``) rebuilds each DTensor from its host shard on the receiver's own mesh
and hands every object its state dict through ``load_state_dict``; objects other than modules
get fresh tensors (an optimizer keeps the tensors it is given, and must never keep an image's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..replicas import fingerprints
from ..transfer import _is_dtensor, _own_layout, _placeholders, flatten, unflatten


@dataclass
class StateImage:
    """Registered state at ``step`` (committed steps: the state the step ``step`` starts from)."""

    step: int
    skeleton: dict  # object name -> its state dict with placeholders for tensors
    tensors: list  # host tensors, in placeholder order
    digests: dict = field(default_factory=dict)  # object name -> (structure, values): ``fingerprints()``
    per_rank: dict | None = None  # per-rank objects' states at ``step`` (already host copies), if any
    modules: frozenset = frozenset()  # the objects that are modules (their structure is fingerprinted)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

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
        for name in names:
            obj = objects[name]
            fresh = not isinstance(obj, torch.nn.Module)  # an optimizer keeps the tensors it is given
            values = {}
            for meta in _placeholders(self.skeleton[name], []):
                _, index, _, _, layout, _ = meta
                t = self.tensors[index]
                t = t.to(device, copy=fresh) if device.type != "cpu" or fresh else t
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
            obj.load_state_dict(unflatten(self.skeleton[name], values))


def _renumber(obj, mapping: dict):
    if isinstance(obj, tuple) and len(obj) == 6 and obj[0] == "__tensor__":
        return (obj[0], mapping[obj[1]], *obj[2:])
    if isinstance(obj, dict):
        return {k: _renumber(v, mapping) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_renumber(v, mapping) for v in obj)
    return obj


class Capture:
    """One snapshot being taken: ``begin`` at the step boundary, ``copy`` on the snapshot thread.

    Both run without autograd: a DTensor's ``to_local()`` is then its local tensor, not an
    autograd function's output (half of the boundary's cost with FSDP2's parameters)."""

    @torch.no_grad()
    def __init__(self, step: int, objects: dict, per_rank: dict | None, reuse: StateImage | None):
        self.step = step
        self._modules = {name for name, obj in objects.items() if isinstance(obj, torch.nn.Module)}
        states = {name: obj.state_dict() for name, obj in objects.items()}
        sources: list = []
        skeleton = {name: flatten(state, sources) for name, state in sorted(states.items())}
        self._sources = [t.to_local() if _is_dtensor(t) else t for t in sources]
        self._sources = [t.detach() for t in self._sources]
        buffers = _reuse(reuse, skeleton, self._sources)
        self.image = StateImage(step, skeleton, buffers, per_rank=per_rank or None, modules=frozenset(self._modules))
        later = _changes_only_in_optimizer_step(objects, states, skeleton)
        self._later = [i for i in range(len(buffers)) if i in later]
        for i in range(len(buffers)):
            if i not in later:
                buffers[i].copy_(self._sources[i])
        self._stream = None
        if any(t.is_cuda for t in self._sources):
            self._stream = torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())  # the step's work so far is what we copy

    @torch.no_grad()
    def copy(self) -> StateImage:
        """Copy what may wait for the optimizer step; returns the finished image."""
        buffers, sources = self.image.tensors, self._sources
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                for i in self._later:
                    buffers[i].copy_(sources[i], non_blocking=True)
            self._stream.synchronize()
        else:
            for i in self._later:
                buffers[i].copy_(sources[i])
        self._sources = []  # no reference to live tensors outlives the copy
        return self.image


def _reuse(old: StateImage | None, skeleton: dict, sources: list) -> list:
    """Host buffers for ``sources``: the old image's when every shape and dtype matches (a steady
    state allocates nothing), else new ones (pinned for CUDA tensors)."""
    if (
        old is not None
        and len(old.tensors) == len(sources)
        and all(b.shape == s.shape and b.dtype == s.dtype for b, s in zip(old.tensors, sources))
    ):
        return old.tensors
    return [torch.empty(s.shape, dtype=s.dtype, device="cpu", pin_memory=s.is_cuda) for s in sources]


def _changes_only_in_optimizer_step(objects: dict, states: dict, skeleton: dict) -> set[int]:
    """Placeholder indices whose tensors change only in the optimizer step: a module's
    parameters and an optimizer's state. Everything else is copied at the boundary."""
    out: set[int] = set()
    for name, obj in objects.items():
        metas = _placeholders(skeleton[name], [])
        if isinstance(obj, torch.optim.Optimizer):
            out.update(m[1] for m in metas)
        elif isinstance(obj, torch.nn.Module):
            params = {_storage(p) for p in obj.parameters() if p.numel()}
            for meta, t in zip(metas, _leaf_tensors(states[name])):
                if t.numel() and _storage(t) in params:
                    out.add(meta[1])
    return out


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
