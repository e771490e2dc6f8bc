"""Training state the script keeps and never registered, found at the first step of ``job.steps()``.

An ordinary torchrun script keeps more state than its model, optimizer and scheduler: an EMA of
the weights (``torch.optim.swa_utils.AveragedModel``), a teacher, a metric module, a second
optimizer, a GradScaler, any object with ``state_dict()``/``load_state_dict()`` (torch's
``Stateful``). Left unregistered, a joiner kept its sandbox's copy and a survivor re-running a step
updated its EMA twice: silent divergence. So the runtime looks for them itself:

* ``find`` (once per loop, at its first step): ``gc.get_objects()`` gives every Module, Optimizer,
  LR scheduler and GradScaler alive in the process; a walk from the variables of the frame that
  iterates ``job.steps()`` (and one level into its dicts, lists and plain objects) names them and
  finds the other ``Stateful`` objects the script keeps. A module that holds only tensors of the
  registered objects (the raw model under a registered DDP, a registered model's submodule) is not
  state of its own, nor a module inside another found one, nor a stateless one (a loss, an
  activation), nor what ``register(exclude=[...])`` leaves out. Data loaders and samplers are
  ``job.data()``'s concern.
* What is found is then registered as the script would have registered it
  (``LiveJob._adopt``): carried to a rank taking over from a replica of the same copy, or from
  the lost rank's snapshot, and compared by the audit after a change. Optimizer, scheduler and
  scaler steps are effects: they wait for the step's commit like the registered ones and need no
  rollback.
* ``Rollback``: modules and ``Stateful`` objects change in the step's body (an EMA update, a
  metric's ``update()``), which runs to its end even when its vote failed. Such a step runs again,
  so they are put back first, from a copy taken where it is cheapest: an object whose tensors'
  version counters show it changes only after the step's vote (an EMA updated after
  ``optimizer.step()``) still holds its start-of-step value at that vote, so it is copied only when
  a vote fails; one that changes before the vote (a metric updated in the forward), or whose
  state the counters cannot see (a ``Stateful``, a module with state beyond its parameters and
  buffers), is copied at every step's start. Until a step has shown which, the copy is taken at the
  start. An object that was seen changing only after the vote and then changes before a vote
  that fails cannot be put back: the step ends live mode (``lost``), never a silent re-run.
"""

from __future__ import annotations

import gc
import itertools
import types
from dataclasses import dataclass, field

import torch

from .transfer import cpu_copy

SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
_KINDS = (torch.nn.Module, torch.optim.Optimizer, *SCHEDULERS, torch.amp.GradScaler)  # what gc.get_objects() is searched for
_NOT_STATE = (torch.utils.data.DataLoader, torch.utils.data.Sampler, torch.utils.data.Dataset, torch.Tensor, type)


@dataclass
class Found:
    name: str  # its variable's name in the loop's frame (``ema``, ``trainer.teacher``), else ``Type#i``
    obj: object
    kind: str  # module, optimizer, scheduler, scaler, stateful

    @property
    def effect(self) -> bool:
        """Changes only in a step the commit guards (an optimizer's, scheduler's or scaler's step)."""
        return self.kind in ("optimizer", "scheduler", "scaler")


def kind_of(obj) -> str | None:
    if isinstance(obj, torch.nn.Module):
        return "module"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, SCHEDULERS):
        return "scheduler"
    if isinstance(obj, torch.amp.GradScaler):
        return "scaler"
    if isinstance(obj, _NOT_STATE) or isinstance(obj, (types.ModuleType, types.FunctionType, types.MethodType)):
        return None
    if _ours(obj):
        return None  # the runtime's own objects (the job, RNGState, job.data()'s batches)
    cls = type(obj)  # the class's methods: an instance's __getattr__ may do anything (ctypes loads a library)
    if callable(getattr(cls, "state_dict", None)) and callable(getattr(cls, "load_state_dict", None)):
        return "stateful"
    return None


def script_frame(frame):
    """The script's frame that iterates ``job.steps()``: the first caller outside tm-launch, seen
    from a frame inside it; None when a framework's loop drives the steps (an integration)."""
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] == "tm_launch":
        if frame.f_globals.get("__name__", "").startswith("tm_launch.worker.integrations"):
            return None
        frame = frame.f_back
    return frame


def frame_variables(frame) -> dict:
    """The loop frame's own variables: a module-level loop's globals, or a function's locals
    (with the module's globals behind them, where a function keeps its model at module level)."""
    if frame.f_code.co_name == "<module>" or frame.f_locals is frame.f_globals:
        return dict(frame.f_globals)
    return {**frame.f_globals, **frame.f_locals}


def named_objects(variables: dict, depth: int = 2) -> dict:
    """id -> (name, object) for what the variables hold, and one or two levels into their dicts,
    lists, tuples and plain objects' attributes (``trainer.teacher``, ``state['ema']``); the first
    name found wins, variables before their contents."""
    out: dict = {}
    level = [(name, value) for name, value in variables.items() if not name.startswith("__")]
    for _ in range(depth + 1):
        below = []
        for name, value in level:
            if id(value) in out or isinstance(value, (types.ModuleType, type, types.FunctionType, str, bytes)):
                continue
            out[id(value)] = (name, value)
            if kind_of(value) in ("module", "optimizer", "scheduler", "scaler"):
                continue  # its insides are its own state
            if isinstance(value, dict):
                below += [(f"{name}[{k!r}]", v) for k, v in itertools.islice(value.items(), 64)]
            elif isinstance(value, (list, tuple)):
                below += [(f"{name}[{i}]", v) for i, v in enumerate(value[:64])]
            elif hasattr(value, "__dict__") and kind_of(value) is None and not callable(value) and not _ours(value):
                below += [(f"{name}.{k}", v) for k, v in itertools.islice(vars(value).items(), 64) if not k.startswith("__")]
        level = below
    return out


def _ours(obj) -> bool:
    """One of tm-launch's objects (the job): what it holds is the runtime's, not the script's."""
    return type(obj).__module__.split(".")[0] == "tm_launch"


def _tensors(obj) -> list:
    if isinstance(obj, torch.nn.Module):
        return [*obj.parameters(), *obj.buffers()]
    if isinstance(obj, torch.optim.Optimizer):
        return [p for g in obj.param_groups for p in g["params"]]
    return []


def find(variables: dict, registered: list, excluded: list = ()) -> list[Found]:
    """Every object holding training state that ``registered`` (the objects the script registered
    and those they carry) does not cover, named from the loop frame's ``variables``; ``excluded``:
    left out by the script (``register(exclude=[...])``). Deterministic across ranks running the
    same script: names come from the script's variables, and objects no variable reaches are
    numbered by type in the collector's order."""
    covered = {id(o) for o in [*registered, *excluded]}
    owned = {id(t) for o in [*registered, *excluded] for t in _tensors(o)}
    named = named_objects(variables)
    gc.collect()  # garbage in a cycle (a model built and dropped) is nobody's state
    candidates = [o for o in gc.get_objects() if issubclass(type(o), _KINDS)]  # type(): no __class__ property runs
    seen = {id(o) for o in candidates}
    candidates += [o for _, o in named.values() if id(o) not in seen and kind_of(o) == "stateful"]
    inner = {id(sub) for o in candidates if isinstance(o, torch.nn.Module) for sub in itertools.islice(o.modules(), 1, None)}
    found, counts = [], {}
    for obj in candidates:
        kind = kind_of(obj)
        if id(obj) in covered or id(obj) in inner or _is_registered_state(obj, kind, owned, covered):
            continue
        if kind == "module" and not obj.state_dict():
            continue  # a loss, an activation: nothing to carry
        if kind == "scheduler" and id(getattr(obj, "optimizer", None)) in covered and _wraps_registered(obj, registered):
            continue
        name = named[id(obj)][0] if id(obj) in named else None
        if name is None:
            counts[type(obj).__name__] = counts.get(type(obj).__name__, -1) + 1
            name = f"{type(obj).__name__}#{counts[type(obj).__name__]}"
        found.append(Found(name, obj, kind))
    return sorted(found, key=lambda f: f.name)


def _is_registered_state(obj, kind: str, owned: set, covered: set) -> bool:
    """A module or optimizer all of whose tensors belong to registered objects (the raw model
    under a registered DDP, ZeRO's inner optimizer) is registered state seen through another object."""
    if kind not in ("module", "optimizer"):
        return False
    tensors = _tensors(obj)
    return bool(tensors) and all(id(t) in owned for t in tensors)


def _wraps_registered(scheduler, registered: list) -> bool:
    """A scheduler a registered wrapper steps (accelerate's ``AcceleratedScheduler.scheduler``)."""
    return any(getattr(o, "scheduler", None) is scheduler for o in registered)


def describe(found: list[Found]) -> str:
    """The one log line: what was found and how each is carried."""
    how = {
        "module": "carried like the registered objects, put back when a step runs again",
        "stateful": "carried like the registered objects, copied at each step's start",
        "optimizer": "carried like the registered objects, its step waits for the commit",
        "scheduler": "carried like the registered objects, its step waits for the commit",
        "scaler": "carried like the registered objects, its update waits for the commit",
    }
    parts = [f"{f.name} ({type(f.obj).__name__}: {how[f.kind]})" for f in found]
    return (
        f"found {len(found)} object(s) holding training state that the script did not register: "
        + "; ".join(parts)
        + " (register(exclude=[obj]) leaves one out)"
    )


# -- the rollback: pure decisions, then the object that applies them ------------------------------

START, AT_VOTE = "start", "at-vote"


def copy_policy(history: list, versions_known: bool) -> str:
    """When to copy an object a step may change: at every step's ``START``, or only ``AT_VOTE``
    when the vote fails. ``history``: (changed before the vote, changed after it) of each step
    seen so far. The cheap way only once a step has shown the object changes after its vote alone
    (or not at all) and its tensors' version counters can show it."""
    if not versions_known or not history:
        return START
    return START if any(before for before, _ in history) else AT_VOTE


def at_failed_vote(policy: str, changed_since_start: bool) -> str:
    """A vote failed: ``have`` (copied at the start), ``copy`` (it still holds the start's value:
    copy it now) or ``lost`` (it changed before this vote and no copy exists: live mode ends)."""
    if policy == START:
        return "have"
    return "lost" if changed_since_start else "copy"


def versions_known(obj) -> bool:
    """Whether the tensors' version counters see every change of ``obj``'s state: a module whose
    ``state_dict()`` holds only its parameters and persistent buffers."""
    if not isinstance(obj, torch.nn.Module):
        return False
    keys = set(obj.state_dict(keep_vars=True))
    held = {n for n, _ in obj.named_parameters()} | {n for n, _ in obj.named_buffers()}
    return keys <= held


def signature(obj) -> tuple:
    """The identity and version counter of every tensor of a module: equal means unchanged (an
    in-place update bumps the counter, a replaced tensor changes the identity)."""
    out = []
    for t in _tensors(obj):
        local = getattr(t, "_local_tensor", t)  # a DTensor: its shard's counter
        out.append((id(local), local._version))
    return tuple(out)


@dataclass
class _Watched:
    name: str
    obj: object
    versions: bool
    history: list = field(default_factory=list)
    start: tuple | None = None  # signature at the step's start
    at_vote: tuple | None = None  # signature at the step's vote
    copy: dict | None = None  # its state when the step began

    @property
    def policy(self) -> str:
        return copy_policy(self.history, self.versions)


class Rollback:
    """Puts found modules and ``Stateful`` objects back to their start-of-step state when a step
    runs again (see the module's docstring for when each is copied)."""

    def __init__(self, found: list[Found]):
        self.watched = [_Watched(f.name, f.obj, versions_known(f.obj)) for f in found if not f.effect]
        self.lost: list[str] = []  # objects that cannot be put back this step
        self._decided = False

    def __bool__(self) -> bool:
        return bool(self.watched)

    def begin_step(self) -> None:
        self.lost, self._decided = [], False
        for w in self.watched:
            w.start = signature(w.obj) if w.versions else None
            w.at_vote = None
            w.copy = cpu_copy(w.obj.state_dict()) if w.policy == START else None

    def at_decision(self, committed: bool) -> None:
        """The step's vote is decided (once per step)."""
        if self._decided:
            return
        self._decided = True
        for w in self.watched:
            w.at_vote = signature(w.obj) if w.versions else None
            if committed:
                continue
            action = at_failed_vote(w.policy, w.at_vote != w.start)
            if action == "copy":
                w.copy = cpu_copy(w.obj.state_dict())
            elif action == "lost":
                self.lost.append(w.name)

    def end_step(self, committed: bool) -> None:
        """The body ended: learn when each object changed; a step that runs again puts them back."""
        for w in self.watched:
            if w.versions and w.at_vote is not None:
                end = signature(w.obj)
                w.history.append((w.at_vote != w.start, end != w.at_vote))
                del w.history[:-8]
            if not committed and w.copy is not None and w.name not in self.lost:
                w.obj.load_state_dict(w.copy)
            w.copy = None

    def policies(self) -> str:
        """What a step learned: how each watched object is copied from now on (one log line)."""
        return "; ".join(
            f"{w.name}: "
            + ("changes only after the commit, copied only when a vote fails" if w.policy == AT_VOTE else "copied at each step's start")
            for w in self.watched
        )
