"""A step with several optimizer steps is one transaction: its earlier effects are rolled back
when a later one cannot commit.

A GAN's step runs ``opt_a.step()``, then model B's backward (a gradient all-reduce) and
``opt_b.step()``. If a peer dies between the two, ``opt_a``'s update is already applied on every
survivor while ``opt_b``'s gradients are what a failed all-reduce left. Each optimizer step gets
a job-wide vote of its own (``commit.StepCommit.next_vote``); the step commits with its last.
Where a later vote fails, the survivors load the state the step started its effects from (a
copy taken just before its first optimizer step applies), so every rank stands at the step's
start again: the step runs again from the top, and a joiner receives that start-of-step state
from a replica like any other.

The copy is taken only in steps known to have more than one optimizer step (``EffectCount``:
the most any step of this process had, counted from the first step on, sandbox steps
included), so the ordinary single-optimizer step costs what it did: one vote, no copy. A step
whose later vote fails without a copy (the first step, before the count is known; a count that
grew) cannot be made exact: live mode ends loudly before the effect applies (``StateLost``:
every worker restarts from the script's checkpoint, one line saying why), never silently.
"""

from __future__ import annotations

import time

import torch


def _clone(value):
    """A deep copy of a state dict: tensors cloned (a DTensor stays one), containers rebuilt,
    other values kept (numbers, strings, and objects a state dict hands over as they are)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):  # an OrderedDict stays one, with a module's version metadata
        out = type(value)((k, _clone(v)) for k, v in value.items())
        if hasattr(value, "_metadata"):
            out._metadata = value._metadata
        return out
    if isinstance(value, list):
        return [_clone(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    return value


class EffectCount:
    """How many optimizer steps a step has: counted per step, the most seen is what a step is
    expected to have (a discriminator updated every other step still gets its copy)."""

    def __init__(self):
        self.expected = 0  # 0: no step counted yet
        self.this_step = 0

    def start(self) -> None:
        self.this_step = 0

    def applied(self) -> None:
        self.this_step += 1
        self.expected = max(self.expected, self.this_step)

    @property
    def several(self) -> bool:
        return self.expected > 1


class StartOfStep:
    """The registered objects' state just before the step's first optimizer step applied."""

    def __init__(self):
        self._saved: dict | None = None
        self.ms = 0.0  # what the last copy took

    @property
    def held(self) -> bool:
        return self._saved is not None

    def take(self, objects: dict) -> None:
        t0 = time.perf_counter()
        with torch.no_grad():
            self._saved = {name: _clone(obj.state_dict()) for name, obj in objects.items()}
        self.ms = (time.perf_counter() - t0) * 1000

    def drop(self) -> None:
        self._saved = None

    def restore(self, objects: dict) -> None:
        """Every object back to the copy (in place for modules' tensors)."""
        saved, self._saved = self._saved, None
        with torch.no_grad():
            for name, obj in objects.items():
                if name in saved:
                    obj.load_state_dict(saved[name])
