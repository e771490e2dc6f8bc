"""The plain values the script keeps in the frame that runs ``job.steps()``, as per-rank state.

A tokens-seen counter that drives the learning rate, a best loss, an accumulation counter: a
torchrun script keeps them in variables of its loop, and a step that runs again counted its
tokens twice, a joiner started them from its sandbox's values. ``LoopVariables`` makes them one
per-rank object (``per_rank.PerRankState``, beside the RNG and the module buffers): copied at
each step's start and put back when the step runs again, mirrored with the vote so that a rank
taking over continues with the lost rank's values.

Which frame: the first caller outside tm-launch of the ``steps()`` generator (the frame whose
``for`` iterates it). A module-level loop keeps its variables in ``frame.f_globals`` (a dict,
written as is); a loop inside ``main()`` in the frame's fast locals, which CPython 3.11 reads
through ``frame.f_locals`` (a copy) and writes back with ``PyFrame_LocalsToFast`` (3.13's
``f_locals`` writes through: PEP 667).

What is carried (``carriable``, pure): None, booleans, numbers, strings, short bytes, dtypes and
devices; lists, tuples, dicts and sets of them up to ``MAX_ITEMS`` leaves; tensors up to
``MAX_NUMEL`` elements that are not parameters and need no gradient (a loss with its graph is a
result of the step, recomputed when it runs again). A list, dict or tensor the variable still
holds since the step's start (``step_begins``: the body changed it in place) is put back in place,
so another reference to it sees the value too; one the body rebound (a batch: ``x, y = next(it)``)
is rebound to the saved value and the new object is left alone, since a loader may hand that very
object to the step that runs again. What cannot be carried and may be state (an open file, a
tensor or container over the limits) is named once (``not_carried``).
"""

from __future__ import annotations

import ctypes
import io
import sys
import types

import torch

MAX_NUMEL = 4096  # a small tensor: a counter, a running mean, a few metrics
MAX_ITEMS = 1024  # leaves of a container (a short history)
_LEAVES = (type(None), bool, int, float, complex, str, torch.dtype, torch.device)


def _leaves(value, budget: list) -> bool:
    """Whether ``value`` is made of plain leaves only, within ``budget[0]`` leaves (consumed)."""
    budget[0] -= 1
    if budget[0] < 0:
        return False
    if isinstance(value, _LEAVES) or (isinstance(value, bytes) and len(value) <= 4096):
        return True
    if isinstance(value, torch.Tensor):
        return _small_tensor(value)
    if isinstance(value, dict):
        return all(isinstance(k, _LEAVES) for k in value) and all(_leaves(v, budget) for v in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(_leaves(v, budget) for v in value)
    return False


def _small_tensor(t: torch.Tensor) -> bool:
    return type(t) is torch.Tensor and not t.requires_grad and t.layout == torch.strided and t.numel() <= MAX_NUMEL


def carriable(value) -> bool:
    """A plain value the loop keeps (see the module's docstring)."""
    return _leaves(value, [MAX_ITEMS + 1])


def cannot_carry(value) -> str | None:
    """Why a variable that may hold state cannot be carried (one phrase), or None when it is
    carriable or none of this module's business (a module, optimizer, function, iterator, the
    job: the runtime or the script's code deals with those)."""
    if isinstance(value, io.IOBase) and not value.closed:
        return "an open file"
    if isinstance(value, torch.Tensor) and type(value) is torch.Tensor and not value.requires_grad and value.numel() > MAX_NUMEL:
        return f"a tensor of {value.numel()} elements"
    if isinstance(value, (list, tuple, dict, set)) and not carriable(value):
        if _leaves(value, [sys.maxsize]):
            return f"a {type(value).__name__} of more than {MAX_ITEMS} values"
    return None


def _copy(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return type(value)(_copy(v) for v in value)
    return value


def _put_back(current, saved):
    """``saved`` as the variable's new value: a list, dict or tensor of the same kind is filled in
    place (other references to it see the value), anything else replaced."""
    if type(current) is list and type(saved) is list:
        current[:] = _copy(saved)
        return current
    if type(current) is dict and type(saved) is dict:
        current.clear()
        current.update(_copy(saved))
        return current
    if (
        isinstance(current, torch.Tensor)
        and isinstance(saved, torch.Tensor)
        and current.shape == saved.shape
        and current.dtype == saved.dtype
    ):
        with torch.no_grad():
            current.copy_(saved)
        return current
    return _copy(saved)


class LoopVariables:
    """One frame's plain variables as an object with ``state_dict()``/``load_state_dict()``.

    ``approximate_after_vote``: a rank that dies after its step's commit leaves its mirror from
    the vote; variables the body changes after the vote (a loss kept for logging, a counter) are
    then carried with their vote-time values and named in a warning (``PerRankState``), rather
    than ending live mode: most are recomputed before they are read."""

    approximate_after_vote = True

    def __init__(self, frame: types.FrameType, skip: set):
        self.frame = frame
        self.module_level = frame.f_code.co_name == "<module>"
        self.skip = skip  # names never carried: the loop's own step variable is not among them
        self._held: dict = {}  # name -> the object the variable held at the step's start

    def step_begins(self) -> None:
        """The step's start (``PerRankState.begin_step``): which object each variable holds now."""
        self._held = {name: value for name, value in self._carried()}

    def _carried(self):
        return [
            (name, value)
            for name, value in self._namespace().items()
            if not name.startswith("__") and name not in self.skip and carriable(value)
        ]

    def _namespace(self) -> dict:
        return self.frame.f_globals if self.module_level else self.frame.f_locals

    def state_dict(self) -> dict:
        return {name: _copy(value) for name, value in self._carried()}

    def load_state_dict(self, state: dict) -> None:
        namespace = self._namespace()
        gone = [n for n, v in namespace.items() if n not in state and not n.startswith("__") and n not in self.skip and carriable(v)]
        for name in gone:  # the lost rank did not hold it at this step
            del namespace[name]
        for name, saved in state.items():
            current = namespace.get(name)
            held = current is not None and current is self._held.get(name)
            namespace[name] = _put_back(current, saved) if held else _copy(saved)
        if not self.module_level:
            ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(self.frame), ctypes.c_int(1 if gone else 0))

    def not_carried(self) -> str | None:
        """The one line naming the variables that may hold state and cannot be carried."""
        named = [
            f"{name} ({why})"
            for name, value in self._namespace().items()
            if not name.startswith("__") and (why := cannot_carry(value)) is not None
        ]
        if not named:
            return None
        return "the loop's variables " + ", ".join(named) + " cannot be carried to a rank taking over nor put back when a step runs again"
