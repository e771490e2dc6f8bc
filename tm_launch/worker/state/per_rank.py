"""State that each rank advances by itself in every step and that only it holds: random number
generators (``RNGState``) and data position (a sampler or loader with ``state_dict()``).

Registered with ``job.register(per_rank=True, rng=tm_launch.RNGState(), data=sampler)``. Two
things make it safe across failures:

* **A step that runs again runs with the same per-rank state**: it is snapshotted at the start
  of every step and restored when the step is interrupted, so a re-run draws the same dropout
  masks and the same batch as the first attempt (and as the fault-free run).
* **A joiner gets the lost rank's own state**: it exists on no other rank, so every rank
  mirrors it to the rank that holds its snapshots, on another node (``snapshots.placement``),
  together with its commit vote (a few KB per step; the vote waits for the holder's
  acknowledgement). The mirror is tagged with the step it belongs to and whether it is exact:
  it is taken at the vote, and if the script changes per-rank state after the optimizer step
  (a random draw while logging), the rank sends the start-of-step state again and later
  vote-time mirrors count as inexact. Snapshots of the registered objects carry the
  start-of-step per-rank state as well. A joiner that finds neither an exact mirror nor a
  snapshot of its rank at the agreed step (its holder died too, or the rank died between its
  commit and the end of the step in such a script) has lost state: the job restarts from the
  checkpoint, as for a shard without replica. A framework's loop that knows when its own
  bookkeeping after a step is done (the HF ``Trainer``) mirrors the next step's start right
  then (``mirror_settled``), which closes that gap for it.
"""

from __future__ import annotations

import io
import json
import operator
import pickle
import random

import torch

from ..log import log
from .transfer import cpu_copy, only_immutable


class RNGState:
    """The process's random number generators as one registrable object: torch (CPU, and every
    CUDA device once CUDA is initialised), numpy's global generator and Python's ``random``."""

    def state_dict(self) -> dict:
        state = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        try:
            import numpy

            state["numpy"] = numpy.random.get_state()
        except ImportError:
            pass
        return state

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        if "cuda" in state:
            torch.cuda.set_rng_state_all(state["cuda"])
        if "numpy" in state:
            import numpy

            numpy.random.set_state(state["numpy"])


class ModuleBuffers:
    """A module's persistent buffers as this rank's own state, found without registration.

    Buffers look replicated and are not: BatchNorm's running statistics are updated by each
    rank from its own batch (under DDP's default ``broadcast_buffers=True`` rank 0's copy is
    broadcast at the start of each forward, then every rank updates its own; with ``False`` each
    rank keeps its own for the whole run; FSDP2 never shards or syncs them). A counter every rank
    bumps in its forward is replicated in value, and its own copy is still exact. So every
    registered module's buffers are per-rank state: restored when a step runs again (its forward
    already changed them) and mirrored so that a rank taking this one's place gets this rank's
    values, not a peer's. Buffers are small (BatchNorm: 2 floats per channel)."""

    def __init__(self, module: torch.nn.Module, owner: str):
        self.module = module
        self.owner = owner  # the registered object whose state_dict() also carries these tensors
        self._plan: _Packing | None = None

    def _slots(self):
        """(module, leaf) of every persistent buffer, in ``state_dict()`` order with its name."""
        for prefix, module in self.module.named_modules():
            skip = module._non_persistent_buffers_set  # not in state_dict(): built from the config, never trained
            for leaf, buffer in module._buffers.items():
                if buffer is not None and leaf not in skip:
                    yield f"{prefix}.{leaf}" if prefix else leaf, module, leaf

    def _packing(self) -> _Packing:
        """How the buffers pack into one flat tensor per dtype, kept while the module holds the
        same buffer objects (a script may replace one: ``self.count = self.count + 1``)."""
        plan = self._plan
        if plan is not None and plan.still_valid():
            return plan
        self._plan = plan = _Packing(list(self._slots()))
        return plan

    def _buffers(self):
        for name, module, leaf in self._packing().slots:
            buffer = module._buffers[leaf]
            local = getattr(buffer, "to_local", None)  # a DTensor: this rank's shard
            yield name, local() if local is not None else buffer

    def keys(self) -> set:
        """The names these buffers have in the module's ``state_dict()`` (left out of the
        module's replica fingerprint: ranks differ there by design)."""
        return {name for name, _, _ in self._packing().slots}

    def state_dict(self) -> dict:
        """All buffers packed in one tensor per dtype (``flat``) with their ``layout``: per-rank
        state is copied, compared and pickled twice a step, and torch pickles a tensor in ~0.3 ms
        whatever its size (a ResNet-50 has 160 buffers); the packing is one fused copy."""
        return self._packing().pack()

    def load_state_dict(self, state: dict) -> None:
        values = _Packing.unpack(state)
        with torch.no_grad():
            for name, buffer in self._buffers():
                if name in values:
                    buffer.copy_(values[name])  # in place: DDP and the script hold these tensors


class _Packing:
    """The buffers of one module laid out in one flat staging tensor per (device, dtype)."""

    def __init__(self, slots: list):
        self.slots = slots  # [(name, module, leaf)]
        self._held = [module._buffers[leaf] for _, module, leaf in slots]
        self._sharded = any(hasattr(b, "to_local") for b in self._held)  # DTensor buffers: their local shards
        layout, sizes = [], {}
        for (name, _, _), buffer in zip(slots, self._held):
            local = buffer.to_local() if hasattr(buffer, "to_local") else buffer
            key = f"{local.device}|{str(local.dtype).removeprefix('torch.')}"
            layout.append((name, key, tuple(local.shape), sizes.get(key, 0)))
            sizes[key] = sizes.get(key, 0) + local.numel()
        self.layout = json.dumps(layout)  # one string: copied, compared and pickled as one object
        self._flats = {}
        for key, size in sizes.items():
            device, dtype = key.split("|")
            self._flats[key] = torch.empty(size, dtype=getattr(torch, dtype), device=device)
        self._views = [self._flats[key][offset : offset + _numel(shape)].view(shape) for _, key, shape, offset in layout]

    def still_valid(self) -> bool:
        now = [module._buffers.get(leaf) for _, module, leaf in self.slots]
        return all(map(operator.is_, now, self._held))

    def pack(self) -> dict:
        """The buffers now, copied into the staging tensors in one fused call (a view: the caller
        copies it, as ``PerRankState`` does)."""
        if self._views:
            held = self._held if not self._sharded else [b.to_local() if hasattr(b, "to_local") else b for b in self._held]
            with torch.no_grad():
                torch._foreach_copy_(self._views, held)
        return {"layout": self.layout, "flat": dict(self._flats)}

    @staticmethod
    def unpack(state: dict) -> dict:
        flats = state["flat"]
        return {
            name: flats[key][offset : offset + _numel(shape)].view(shape)
            for name, key, shape, offset in ((n, k, tuple(sh), o) for n, k, sh, o in json.loads(state["layout"]))
        }


_DROPPED = object()


def _without(state, memory: set, names: set):
    """``state`` without the tensors whose memory starts at one of ``memory``'s addresses, nor the
    tensors a dict holds under one of ``names`` (a framework that copied the module's state_dict)."""
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return _DROPPED if local.numel() and local.data_ptr() in memory else state
    if isinstance(state, dict):
        kept = {k: _DROPPED if k in names and isinstance(v, torch.Tensor) else _without(v, memory, names) for k, v in state.items()}
        return {k: v for k, v in kept.items() if v is not _DROPPED}
    if isinstance(state, (list, tuple)) and not only_immutable(state):
        return type(state)(v for v in (_without(v, memory, names) for v in state) if v is not _DROPPED)
    return state


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def modules_in(obj) -> list:
    """The modules a registered object holds: itself, or the ``parts()`` of a framework checkpoint."""
    if isinstance(obj, torch.nn.Module):
        return [obj]
    return [part for part in (obj.parts() if hasattr(obj, "parts") else ()) if isinstance(part, torch.nn.Module)]


AUTO_RNG = "tm:rng"  # the name of the global RNGs' entry when the script registered none


class PerRankState:
    """The registered per-rank objects of one worker, their step snapshot and their mirror.

    Found without registration: the process's global RNGs (``RNGState``, unless the script
    registered its own or ``tm_launch.init(rng_per_rank=False)``) and every registered module's
    buffers (``ModuleBuffers``)."""

    def __init__(self, rng: bool = False):
        self.rng = rng  # the global RNGs are per-rank state unless the script registers its own
        self.objects: dict = {AUTO_RNG: RNGState()} if rng else {}
        self._snapshot: dict | None = None
        self._voted: tuple[int, dict] | None = None  # (the step it belongs to, the states) of the last vote
        self._exact = True  # per-rank state never changed between a committed vote and the next step
        self.pending: dict = {}  # loaded states of objects not registered yet (``load``)
        self._moved: set = set()  # the objects seen changing between a committed vote and the next step
        self._moved_keys: set = set()  # the loop's variables among them (``loop_variables``)
        self._settled: tuple[int, dict] | None = None  # (step, states) mirrored as that step's start (``mirror_settled``)
        self._settled_trusted = True  # every step so far started from what was mirrored as settled before it

    def __bool__(self) -> bool:
        return bool(self.objects)

    def add(self, objects: dict) -> None:
        """Per-rank objects the script registered (its own RNG state replaces the automatic one)."""
        if any(isinstance(obj, RNGState) for obj in objects.values()):
            self.objects.pop(AUTO_RNG, None)
        self.objects.update(objects)

    def add_buffers_of(self, name: str, obj) -> None:
        """The buffers of the modules registered object ``name`` holds, as per-rank state."""
        for i, module in enumerate(modules_in(obj)):
            buffers = ModuleBuffers(module, name)
            if buffers.keys():
                self.objects[f"tm:buffers:{name}" + (f":{i}" if i else "")] = buffers

    def buffer_keys(self, owner: str) -> set:
        """The keys of ``owner``'s state_dict that are per-rank buffers (a module registered as is)."""
        return {k for obj in self.objects.values() if isinstance(obj, ModuleBuffers) and obj.owner == owner for k in obj.keys()}

    def without_buffers(self, owner: str, state):
        """``state`` (``owner``'s ``state_dict()``) without the per-rank buffers it carries: a
        module's own keys, and wherever they sit in a framework's nested checkpoint (found by
        the memory they share with the module's buffers). Ranks differ there by design: what
        replicas must agree on (their fingerprints, the audit) leaves them out."""
        held = [obj for obj in self.objects.values() if isinstance(obj, ModuleBuffers) and obj.owner == owner]
        if not held:
            return state
        memory = {buffer.data_ptr() for obj in held for _, buffer in obj._buffers() if buffer.numel()}
        names = {name for obj in held for name in obj.keys()}
        return _without(state, memory, names)

    def _approximate(self, name: str) -> bool:
        return getattr(self.objects.get(name), "approximate_after_vote", False)

    def _approximate_only(self) -> bool:
        """Nothing but objects whose vote-time state may serve approximately has moved after a vote."""
        return all(self._approximate(name) for name in self._moved)

    def fresh(self) -> PerRankState:
        """For a script that runs again from the top: only what was found without registration."""
        return PerRankState(rng=self.rng)

    def _states(self) -> dict:
        return {name: cpu_copy(obj.state_dict()) for name, obj in self.objects.items()}

    @property
    def at_step_start(self) -> dict | None:
        """The states taken at the start of the current step (what a snapshot of the step keeps)."""
        return self._snapshot

    def begin_step(self, step: int, publish) -> bool:
        """Snapshot at the start of ``step``. Once the state has moved between a committed vote
        and the next step's start (a loop that draws randomness after its optimizer step, or
        starts a loader iterator between epochs), vote-time mirrors are no longer trusted and
        every later step mirrors its exact start-of-step state (``publish(tag, exact,
        record)``; None in the sandbox), also when this step's state happens not to have moved
        (its vote-time mirror is marked inexact all the same). False when that mirror could
        not be published (its holder is gone)."""
        if not self.objects:
            return True
        for obj in self.objects.values():  # job.data()'s batches forget those a re-run cannot need
            getattr(obj, "step_begins", lambda: None)()
        self._snapshot = now = self._states()
        voted, self._voted = self._voted, None
        settled, self._settled = self._settled, None
        if voted is None or voted[0] != step or publish is None:
            return True  # nothing voted, or the vote was for a step that did not commit
        if self._approximate_only() and not _same(now, voted[1]):  # once another object moved, no need to compare
            self._exact = False  # from now on, every step's exact start is published
            for name in now:
                if not _same(now[name], voted[1].get(name)):
                    self._moved.add(name)
                    if self._approximate(name):
                        self._moved_keys |= {k for k in now[name] if not _same(now[name][k], (voted[1].get(name) or {}).get(k))}
        if settled is not None and settled[0] == step:
            if _same(now, settled[1]):
                return True  # the holder has this start already
            self._settled_trusted = False
            log.info(
                f"tm-launch: per-rank state moved between the framework's end of step {step - 1} and step {step}'s start: "
                "from now on only each step's start is mirrored"
            )
            return publish(step, True, dumps_record({"step": step, "exact": True, "states": now}))
        if not self._exact:
            return publish(step, True, dumps_record({"step": step, "exact": True, "states": now}))
        return True

    def states_now(self) -> dict | None:
        """The per-rank states now (host copies); None without per-rank objects."""
        return self._states() if self.objects else None

    def record_now(self, tag: int) -> tuple[int, bool, bytes]:
        """(tag, exact, record) of the state now, which is exactly step ``tag``'s start (a rank
        that just returned to, or received, that step)."""
        return tag, True, dumps_record({"step": tag, "exact": True, "states": self._states()})

    def mirror_settled(self, step: int, publish) -> bool:
        """Mirror, between two steps, what step ``step`` starts from (``publish(tag, exact,
        record)``), once a framework's own bookkeeping after the committed step ``step - 1`` is
        done (the HF ``Trainer``'s logging sums): a rank lost before that start is then taken over
        live, where its vote-time mirror predates the bookkeeping. Trusted until a step's start
        differs from it (something moved after the framework said it was done); from then on
        only step starts are mirrored (``begin_step``). False when the mirror was not sent."""
        if not self.objects or not self._settled_trusted:
            return True
        states = self._states()
        if not publish(step, True, dumps_record({"step": step, "exact": True, "states": states})):
            return False
        self._settled = (step, states)
        return True

    def restore(self) -> None:
        """The step runs again: back to the state it started with."""
        if self._snapshot is not None:
            self.load(self._snapshot)

    def load(self, states: dict) -> None:
        for name, state in states.items():
            if name in self.objects:
                self.objects[name].load_state_dict(state)
            else:  # registered later in this process (a loader its loop first iterates later: loop_loaders)
                self.pending[name] = state

    def differs_from(self, states: dict) -> list:
        """The per-rank objects whose state now is not ``states`` (what a joiner loaded, checked:
        an object whose ``load_state_dict`` did not take, or took only in part, is named)."""
        return sorted(
            name for name, state in states.items() if name in self.objects and not _same(cpu_copy(self.objects[name].state_dict()), state)
        )

    def vote_mirror(self, step: int) -> tuple[int, bool, bytes] | None:
        """(tag, exact, record) this rank mirrors with its vote on ``step``: its state after the step."""
        if not self.objects:
            return None
        self._voted = (step + 1, self._states())
        record = {"step": step + 1, "exact": self._exact, "states": self._voted[1]}
        if not self._exact and self._approximate_only():
            # Only the loop's plain variables move after the vote (a logged loss, a counter):
            # the vote-time values serve a rank taking over after the commit, named as such.
            record.update(exact=True, approximate=sorted(self._moved_keys))
        return step + 1, record["exact"], dumps_record(record)

    def load_mirror(self, found: tuple[bool, bytes] | None, rank: int, step: int) -> str | None:
        """Load rank ``rank``'s mirror of ``step`` (``(exact, record)`` from its holder, None when
        it holds none); the reason when it cannot be used."""
        if not self.objects:
            return None
        if found is None or not found[0]:
            return f"rank {rank}'s per-rank state at step {step} was not mirrored exactly ({'none found' if found is None else 'only at its vote'})"
        record = pickle.loads(found[1])
        states = record["states"]
        if record.get("approximate"):
            log.info(
                f"tm-launch: warning: rank {rank} died after its step's commit: the loop's variable(s) {', '.join(record['approximate'])} "
                f"continue from their values at its vote on step {step - 1}; the body changed them after it"
            )
        missing = set(self.objects) - set(states)
        if missing:
            return f"rank {rank}'s mirror has no per-rank object(s) {sorted(missing)}"
        self.load(states)
        wrong = self.differs_from(states)
        if wrong:
            return f"rank {rank}'s per-rank state {wrong} did not load exactly (its state_dict() after load_state_dict() differs)"
        return None


def dumps_record(record: dict) -> bytes:
    """A per-rank record (a step's mirror) as bytes that ``pickle.loads`` reads back.

    Written twice a step by every live rank, so its cost is per step: torch pickles a tensor
    through its legacy serializer (~1-2 ms each here, whatever its size), this writes a host
    tensor as its raw bytes with dtype and shape (~10x less for a step's few tensors)."""
    out = io.BytesIO()
    _RecordPickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(record)
    return out.getvalue()


class _RecordPickler(pickle.Pickler):
    def reducer_override(self, obj):
        if type(obj) is torch.Tensor and obj.layout == torch.strided and obj.device.type == "cpu" and not obj.is_quantized:
            raw = obj.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes() if obj.numel() else b""
            return tensor_from_bytes, (raw, str(obj.dtype).removeprefix("torch."), tuple(obj.shape))
        return NotImplemented  # anything else (a DTensor, a GPU tensor, numpy, Python): pickle's own way


def tensor_from_bytes(raw: bytes, dtype: str, shape: tuple) -> torch.Tensor:
    """The tensor ``_RecordPickler`` wrote (a fresh host tensor that owns its memory)."""
    kind = getattr(torch, dtype)
    if not raw:
        return torch.empty(shape, dtype=kind)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(kind).reshape(shape)


def _same(a, b) -> bool:
    """Equal per-rank states (tensors and arrays by value: their pickles are not canonical)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        if not (isinstance(b, (list, tuple)) and len(a) == len(b)):
            return False
        if only_immutable(a) and only_immutable(b):  # Python's RNG state: 625 ints, compared at once
            return tuple(a) == tuple(b)
        return all(_same(x, y) for x, y in zip(a, b))
    if type(a).__module__ == "numpy":
        import numpy

        return numpy.array_equal(a, b)
    return a == b
