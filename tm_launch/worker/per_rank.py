"""State that each rank advances by itself in every step and that only it holds: random number
generators (``RNGState``) and data position (a sampler or loader with ``state_dict()``).

Registered with ``job.register(per_rank=True, rng=tm_launch.RNGState(), data=sampler)``. Two
things make it safe across failures:

* **A step that runs again runs with the same per-rank state**: it is snapshotted at the start
  of every step and restored when the step is interrupted, so a re-run draws the same dropout
  masks and the same batch as the first attempt (and as the fault-free run).
* **A joiner gets the lost rank's own state**: it exists on no other rank, so every rank
  mirrors it into the generation's store together with its commit vote (a few KB per step).
  The mirror is tagged with the step it belongs to and whether it is exact: it is written at
  the vote, and if the script changes per-rank state after the optimizer step (a random draw
  while logging), the rank writes the start-of-step state again and later vote-time mirrors
  count as inexact. A joiner that finds no exact mirror of its rank at the agreed step (the
  store's node died too, or the rank died between its commit and the end of the step in such a
  script) has lost state: the job restarts from the checkpoint, as for a shard without replica.
"""

from __future__ import annotations

import datetime
import pickle
import random

import torch
import torch.distributed as dist

from .agent_client import first_line
from .commit import commit_store
from .store_clients import open_client
from .transfer import cpu_copy


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

    def begin_step(self, step: int, commit) -> None:
        """Snapshot at the start of ``step``. Once the state has moved between a committed vote
        and the next step's start (a loop that draws randomness after its optimizer step, or
        starts a loader iterator between epochs), vote-time mirrors are no longer trusted and
        every later step mirrors its exact start-of-step state, also when this step's state
        happens not to have moved (its vote-time mirror is marked inexact all the same)."""
        if not self.objects:
            return
        self._snapshot = now = self._states()
        voted, self._voted = self._voted, None
        if voted is None or voted[0] != step or commit.store is None:
            return  # nothing voted, or the vote was for a step that did not commit
        if not _same(now, voted[1]):
            self._exact = False
        if not self._exact:
            commit.mirror(step, pickle.dumps({"step": step, "exact": True, "states": now}))

    def restore(self) -> None:
        """The step runs again: back to the state it started with."""
        if self._snapshot is not None:
            for name, state in self._snapshot.items():
                self.objects[name].load_state_dict(state)

    def vote_mirror(self, step: int) -> tuple[int, bytes] | None:
        """(tag, record) this rank mirrors with its vote on ``step``: its state after the step."""
        if not self.objects:
            return None
        self._voted = (step + 1, self._states())
        return step + 1, pickle.dumps({"step": step + 1, "exact": self._exact, "states": self._voted[1]})

    def fetch(self, where: tuple | None, rank: int, step: int) -> str | None:
        """Load rank ``rank``'s mirror of ``step`` from the store at ``where`` (generation,
        address, port); the reason when there is none."""
        if not self.objects:
            return None
        if where is None:
            return f"no step was committed with a mirror of rank {rank}'s per-rank state"
        generation, addr, port = where
        key = f"pr/{rank}/{step}"
        try:  # a dead store is refused at once; a live one may cost a dropped name lookup (store_clients)
            client = open_client(addr, port, timeout=datetime.timedelta(seconds=5))
            votes = commit_store(client, generation)
            record = pickle.loads(votes.get(key)) if votes.check([key]) else None
        except (RuntimeError, dist.DistError, OSError) as e:
            return f"the store holding rank {rank}'s per-rank state is gone ({first_line(e, 80)})"
        if record is None or not record["exact"]:
            return f"rank {rank}'s per-rank state at step {step} was not mirrored exactly ({'none found' if record is None else 'only at its vote'})"
        states = record["states"]
        missing = set(self.objects) - set(states)
        if missing:
            return f"rank {rank}'s mirror has no per-rank object(s) {sorted(missing)}"
        for name, obj in self.objects.items():
            obj.load_state_dict(states[name])
        return None


def _same(a, b) -> bool:
    """Equal per-rank states (tensors and arrays by value: their pickles are not canonical)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if type(a).__module__ == "numpy":
        import numpy

        return numpy.array_equal(a, b)
    return a == b
