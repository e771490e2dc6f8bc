"""A worker's whole state at exit, for ``tm-launch rehearse`` (``tm_launch.rehearsal``).

The rehearsal runs the user's script once without a fault under plain torchrun and then with a
worker killed at each phase of a step under tm-launch's live mode, and compares what every rank
ends with. What a rank "ends with" is more than its parameters: every object registered with
``job.register(...)`` (its whole ``state_dict()``: module buffers, optimizer, scheduler, the
per-rank RNG and data position), the process's global torch RNG (dropout draws from it whether
or not the script registered it), and tensors kept in plain attributes of the registered
modules (state the runtime cannot see), every object holding training state that the script
keeps and never registered (an EMA, a GradScaler, a second optimizer: ``state.discovered``, found
at the loop's first step as live mode finds it, under torchrun too, and those
``register(exclude=[...])`` leaves out of the recovery) and the plain variables of
the loop's frame at exit (``state.loop_variables``, ``~loop/<name>``) with where the loaders it
iterates stand (``~data/<name>``: batches drawn from an iterator's pass, a loader's sampler
epoch; ``state.loop_loaders.positions``). Each rank writes it to ``<dir>/rank<r>.pt`` when
``TM_REHEARSAL_DUMP=<dir>`` is set, under ``PlainJob`` (torchrun) and ``LiveJob`` alike.

Armed by one line in ``runtime.init()``; with none of its variables set it does nothing (the job
object is returned untouched). The job's ``register`` and ``steps`` are wrapped on the instance
(not the class) to record what the script registered, as it passed it (a ZeRO optimizer as the
script holds it, not the runtime's partition view), and how many steps its loop ran.

* DTensors (FSDP2, tensor parallel) are saved as this rank's local shard (``to_local()``), as the
  tests' comparisons do: a rank's state is its shard.
* A spare that never took a rank (it parked until the job ended) writes nothing: it would write
  the last rank's file.
* ``TM_REHEARSAL_HOLD=<file>``: every rank of a live job waits at its first step until the file
  exists (the rehearsal's spare warms up meanwhile, so every fault meets a warm spare).
* ``TM_FAILPOINT`` naming a phase of a step arms ``phase_faults``.
"""

from __future__ import annotations

import atexit
import os
import pickle
import sys
import time

import torch

from . import phase_faults, torch_patches
from .job.step_effects import EffectCount
from .state import discovered, loop_loaders
from .state.loop_variables import LoopVariables

DUMP, HOLD = "TM_REHEARSAL_DUMP", "TM_REHEARSAL_HOLD"
FORMAT = 1


class Registry:
    """What the script registered (name -> (object, per_rank)) and the steps its loop ran."""

    def __init__(self):
        self.objects: dict[str, tuple[object, bool]] = {}
        self.steps = 0  # steps yielded by job.steps(); 0 when the loop is a framework's own
        self.optimizer_steps = 0  # optimizer.step() calls of registered optimizers (a framework's loop)
        self.counting = False  # the optimizer hook that counts them is installed
        self.found: dict[str, object] = {}  # name -> object found at the loop's first step (not registered)
        self.loop_frame = None  # the frame that iterates job.steps(): its plain variables are dumped
        # Optimizer steps per job.steps() step, every optimizer's, registered or not (an unregistered
        # second optimizer is a second effect all the same): what decides the between-effects kill.
        self.effects = EffectCount()
        self.in_loop = False
        self._stepped: list = []  # this step's optimizers so far

    def forget_run(self) -> None:
        """The script runs again from the top (a spare promoted to a rank it did not warm up as):
        what the first run registered and its loop's frame are dropped. Kept, they kept that run's
        model, optimizer and DDP alive, and live mode's discovery in the new run found them as
        state of the joiner's own that no survivor has (every worker restarted from the script's
        checkpoint, and the rehearsal passed a run that was never live). The counts stay: a
        joiner counts its sandbox steps' effects too."""
        self.objects, self.found, self.loop_frame = {}, {}, None
        self.in_loop, self._stepped = False, []

    def start_step(self) -> None:
        self.in_loop = True
        self.effects.start()
        self._stepped = []

    def optimizer_stepped(self, optimizer) -> None:
        """One more effect of the current step, unless ``optimizer`` wraps one that just stepped
        (ZeRO's wrapper steps its inner optimizer: one effect)."""
        if not self.in_loop:
            return
        if any(getattr(optimizer, "optim", None) is o for o in self._stepped):
            return
        self._stepped.append(optimizer)
        self.effects.applied()

    def effects_per_step(self) -> int:
        """The most optimizer steps one step had; a framework's own loop (no job.steps()) has no
        step boundaries to count in: its registered optimizers' count stands for it."""
        if self.steps:
            return self.effects.expected
        return sum(1 for obj, per_rank in self.objects.values() if object_kind(obj, per_rank) == "optim")

    def discover(self, here) -> None:
        """At the loop's first step (``here``: a frame inside tm-launch's steps()): what live mode
        finds without registration, by the same rule and names (``state.discovered.find``)."""
        frame = discovered.script_frame(here)
        if frame is None:
            return
        registered = [o for o, _ in self.objects.values()]
        registered += [p for o in registered if hasattr(o, "parts") for p in o.parts()]
        # What register(exclude=[...]) leaves out of the recovery is still what the run produces:
        # dumped, so that a difference there is named rather than unseen.
        self.found = {f.name: f.obj for f in discovered.find(discovered.frame_variables(frame), registered)}
        self.loop_frame = frame

    def modules(self) -> list[torch.nn.Module]:
        """Registered modules, and those a registered object names in ``parts()`` (a framework's checkpoint)."""
        out = []
        for obj, _ in self.objects.values():
            parts = [obj, *(obj.parts() if hasattr(obj, "parts") else [])]
            out += [p for p in parts if isinstance(p, torch.nn.Module)]
        return out

    def optimizers(self) -> list[torch.optim.Optimizer]:
        out = []
        for obj, _ in self.objects.values():
            for o in [obj, getattr(obj, "optimizer", None), getattr(obj, "optim", None), *(obj.parts() if hasattr(obj, "parts") else [])]:
                if isinstance(o, torch.optim.Optimizer):
                    out.append(o)
        return out


REGISTRY = Registry()
_exit_armed = False


def arm(job):
    """Wrap ``job`` for the rehearsal when its variables are set; returns ``job``."""
    global _exit_armed
    failpoint = phase_faults.armed_point()
    if not (os.environ.get(DUMP) or os.environ.get(HOLD) or failpoint):
        return job
    if getattr(job, "_tm_rehearsal", False):
        return job
    job._tm_rehearsal = True
    _wrap(job)
    if failpoint:
        phase_faults.install(job, REGISTRY, failpoint)
    if os.environ.get(DUMP) and not _exit_armed:
        _exit_armed = True
        # Registered after the job's own atexit handlers: it runs before them (LIFO), while the
        # objects and communicators are whole.
        atexit.register(_dump_at_exit, job, os.environ[DUMP])
    return job


def _wrap(job) -> None:
    register, steps = job.register, job.steps

    def recording_register(replicas=None, per_rank: bool = False, exclude=(), **objects):
        for name, obj in objects.items():
            REGISTRY.objects[name] = (obj, per_rank)
        return register(replicas=replicas, per_rank=per_rank, exclude=exclude, **objects)

    def counting_steps(total: int, start: int = 0):
        first = True
        try:
            for step in steps(total, start):
                if first:
                    first = False
                    REGISTRY.discover(sys._getframe())
                _hold(job)
                REGISTRY.start_step()
                yield step
                REGISTRY.steps = max(REGISTRY.steps, step + 1)
        finally:
            REGISTRY.in_loop = False

    job.register, job.steps = recording_register, counting_steps
    if not REGISTRY.counting:  # once per process, however many jobs init() made
        REGISTRY.counting = True
        torch_patches.after_every_optimizer_step(_count_optimizer_step)


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    if any(optimizer is o for o in REGISTRY.optimizers()):
        REGISTRY.optimizer_steps += 1
    REGISTRY.optimizer_stepped(optimizer)


_held = False


def _hold(job) -> None:
    """At the first step of a live job (a spare starts warming up only once the job is live,
    which it is from its first step), wait for ``TM_REHEARSAL_HOLD``'s file, once per process."""
    global _held
    path = os.environ.get(HOLD)
    if _held or not path or getattr(job, "in_sandbox", False) or not hasattr(job, "state"):
        return
    _held = True
    while not os.path.exists(path):
        time.sleep(0.05)


def _dump_at_exit(job, directory: str) -> None:
    if getattr(job, "in_sandbox", False):
        return  # a spare that never took a rank
    state = getattr(job, "state", None)
    if REGISTRY.steps and state is not None and state.step is not None:
        # A joiner that entered at the job's last step yields no step of its own (only its
        # sandbox's): the steps its loop holds are the job's committed ones.
        REGISTRY.steps = max(REGISTRY.steps, state.step)
    try:
        dump = collect(job.rank, job.world_size, "live" if state is not None else "plain", REGISTRY)
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"rank{job.rank}.pt")
        torch.save(dump, path + ".tmp")
        os.replace(path + ".tmp", path)
    except Exception as e:  # noqa: BLE001 -- a dump that fails must say so, not end the job differently
        print(f"[tm-launch] rehearsal: could not write rank state to {directory}: {type(e).__name__}: {e}", flush=True)


def collect(rank: int, world: int, mode: str, registry: Registry) -> dict:
    """The dump: ``entries`` (flat key -> CPU tensor or plain value) and ``roles`` (flat key ->
    what it is: param, buffer, optim, sched, rng, rng-os (a registered RNGState's Python and
    numpy generators, which start from OS entropy unless the script seeds them), data, other,
    attr, loop (a plain variable of the loop's frame), global-rng). Objects found without
    registration are entries like the registered ones' (``meta["found"]`` names them)."""
    entries, roles = {}, {}
    kinds = {}
    for name, (obj, per_rank) in registry.objects.items():
        kind = object_kind(obj, per_rank, name)
        kinds[name] = kind
        buffers = set()
        if isinstance(obj, torch.nn.Module):
            buffers = {n for n, _ in obj.named_buffers()}
        for key, value in flatten(_state_of(obj)).items():
            full = f"{name}/{key}"
            entries[full] = value
            roles[full] = ("buffer" if key in buffers else "param") if kind == "module" else kind
            if kind == "rng" and key.startswith(("python", "numpy")):
                roles[full] = "rng-os"  # seeded from the OS unless the script seeds it: may differ run to run
    for name, obj in registry.found.items():
        kind = object_kind(obj, False, name)
        kinds[name] = kind
        buffers = {n for n, _ in obj.named_buffers()} if isinstance(obj, torch.nn.Module) else set()
        for key, value in flatten(_state_of(obj)).items():
            full = f"{name}/{key}"
            entries[full] = value
            roles[full] = ("buffer" if key in buffers else "param") if kind == "module" else kind
    if registry.loop_frame is not None:
        for key, value in flatten(LoopVariables(registry.loop_frame, set()).state_dict()).items():
            entries[f"~loop/{key}"], roles[f"~loop/{key}"] = value, "loop"
        for key, value in loop_loaders.positions(discovered.frame_variables(registry.loop_frame)).items():
            entries[f"~data/{key}"], roles[f"~data/{key}"] = value, "data"
    seen = set()
    for module in registry.modules():
        for path, sub in module.named_modules():
            if id(sub) in seen:
                continue
            seen.add(id(sub))
            for attr, value in vars(sub).items():
                if isinstance(value, torch.Tensor):
                    key = f"~attr/{type(module).__name__}.{path + '.' if path else ''}{attr}"
                    entries[key], roles[key] = _plain(value), "attr"
    entries["~rng/torch"], roles["~rng/torch"] = torch.get_rng_state(), "global-rng"
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            entries[f"~rng/cuda{i}"], roles[f"~rng/cuda{i}"] = s, "global-rng"
    steps = registry.steps or registry.optimizer_steps
    meta = {
        "format": FORMAT,
        "rank": rank,
        "world_size": world,
        "mode": mode,
        "steps": steps,
        "objects": kinds,
        "found": sorted(registry.found),
        "effects": registry.effects_per_step(),
    }
    return {"meta": meta, "entries": entries, "roles": roles}


def object_kind(obj, per_rank: bool, name: str = "") -> str:
    """What a registered object is, for the rehearsal's causes (by type; a name for data objects
    registered without ``per_rank``)."""
    if isinstance(obj, torch.nn.Module):
        return "module"
    if isinstance(obj, torch.optim.Optimizer) or type(obj).__name__ == "ZeroRedundancyOptimizer":
        return "optim"
    if isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
        return "sched"
    if isinstance(getattr(obj, "scheduler", None), torch.optim.lr_scheduler.LRScheduler):
        return "sched"
    if isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer):
        return "optim"
    if type(obj).__name__ == "RNGState":
        return "rng"
    lowered = (type(obj).__name__ + " " + name).lower()
    if per_rank or any(w in lowered for w in ("sampler", "loader", "data")):
        return "data"
    return "other"


def _state_of(obj):
    """The object's state without collectives: a ZeRO optimizer's own partition (its
    ``state_dict()`` would gather every rank's first)."""
    if type(obj).__name__ == "ZeroRedundancyOptimizer":
        return obj.optim.state_dict()
    return obj.state_dict()


def _plain(t: torch.Tensor) -> torch.Tensor:
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.detach().cpu().clone()


def flatten(value, prefix: str = "") -> dict:
    """Nested dicts/lists/tuples -> ``{"a.b.0": leaf}``; tensors as plain CPU tensors (a DTensor's
    local shard), numbers and strings as they are, anything else by its type's name."""
    out = {}
    if isinstance(value, torch.Tensor):
        out[prefix] = _plain(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            out.update(flatten(v, f"{prefix}.{i}" if prefix else str(i)))
    elif isinstance(value, bytes) and value[:1] == b"\x80":  # a pickle (Lightning's checkpoint rest): its parts, named
        try:
            out.update(flatten(pickle.loads(value), prefix))
        except Exception:  # noqa: BLE001 -- not a pickle after all: compared as bytes
            out[prefix] = value
    elif value is None or isinstance(value, (bool, int, float, str, bytes)):
        out[prefix] = value
    else:
        try:
            import numpy

            if isinstance(value, numpy.ndarray):
                out[prefix] = torch.from_numpy(value.copy())
                return out
        except ImportError:
            pass
        out[prefix] = f"<{type(value).__name__}>"  # not compared: its repr may hold an address
    return out
