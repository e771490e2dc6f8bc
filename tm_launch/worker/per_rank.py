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
  checkpoint, as for a shard without replica.
"""

from __future__ import annotations

import pickle
import random

import torch

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


class PerRankState:
    """The registered per-rank objects of one worker, their step snapshot and their mirror."""

    def __init__(self):
        self.objects: dict = {}
        self._snapshot: dict | None = None
        self._voted: tuple[int, dict] | None = None  # (the step it belongs to, the states) of the last vote
        self._exact = True  # per-rank state never changed between a committed vote and the next step

    def __bool__(self) -> bool:
        return bool(self.objects)

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
        if voted is None or voted[0] != step or publish is None:
            return True  # nothing voted, or the vote was for a step that did not commit
        if not _same(now, voted[1]):
            self._exact = False
        if not self._exact:
            return publish(step, True, pickle.dumps({"step": step, "exact": True, "states": now}))
        return True

    def states_now(self) -> dict | None:
        """The per-rank states now (host copies); None without per-rank objects."""
        return self._states() if self.objects else None

    def record_now(self, tag: int) -> tuple[int, bool, bytes]:
        """(tag, exact, record) of the state now, which is exactly step ``tag``'s start (a rank
        that just returned to, or received, that step)."""
        return tag, True, pickle.dumps({"step": tag, "exact": True, "states": self._states()})

    def restore(self) -> None:
        """The step runs again: back to the state it started with."""
        if self._snapshot is not None:
            self.load(self._snapshot)

    def load(self, states: dict) -> None:
        for name, state in states.items():
            self.objects[name].load_state_dict(state)

    def vote_mirror(self, step: int) -> tuple[int, bool, bytes] | None:
        """(tag, exact, record) this rank mirrors with its vote on ``step``: its state after the step."""
        if not self.objects:
            return None
        self._voted = (step + 1, self._states())
        return step + 1, self._exact, pickle.dumps({"step": step + 1, "exact": self._exact, "states": self._voted[1]})

    def load_mirror(self, found: tuple[bool, bytes] | None, rank: int, step: int) -> str | None:
        """Load rank ``rank``'s mirror of ``step`` (``(exact, record)`` from its holder, None when
        it holds none); the reason when it cannot be used."""
        if not self.objects:
            return None
        if found is None or not found[0]:
            return f"rank {rank}'s per-rank state at step {step} was not mirrored exactly ({'none found' if found is None else 'only at its vote'})"
        states = pickle.loads(found[1])["states"]
        missing = set(self.objects) - set(states)
        if missing:
            return f"rank {rank}'s mirror has no per-rank object(s) {sorted(missing)}"
        self.load(states)
        return None


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
