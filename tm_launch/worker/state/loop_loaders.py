"""A ``DataLoader`` the script iterates itself inside ``job.steps()`` (``it = iter(loader)`` and
``next(it)`` each step, ``sampler.set_epoch(e)`` and a new ``iter()`` at an epoch's end; ``for
batch in loader:`` inside a step), made exact as ``job.data()`` makes its batches
(``state.data_loaders``), without the script handing the loader over.

What goes wrong without it: a step that runs again (a peer died before it committed) takes the
*next* batch from the iterator the first attempt advanced, and a rank taking over runs the script
from the top, so its iterator starts the epoch over. So, in live mode, ``iter(loader)`` on such a
loader (``torch_patches.route_loader_iteration``) returns a ``PassIterator``, a view of the
loader's ``LoopLoader``: this loader's position, per-rank state like the RNGs, so that the
per-rank machinery (``state.per_rank``) restores it when a step runs again and carries it to the
rank taking over:

* the position is (pass, epoch, index): how many ``iter()`` calls the loop made on the loader,
  the sampler's epoch at the last one (``set_epoch`` is the script's, as under torchrun), and the
  batches drawn from it;
* every batch (and an iterator's end) handed out since the step began is kept under its
  position, and so is each ``iter()``'s effect on the generators: a re-run replays the step,
  ``StopIteration`` and new passes included, with the first attempt's batches. The iterators the
  script holds are views: one the rolled-back attempt made, or one the script made before a
  state came from another process (a joiner's), reads the loader's current pass;
* a joiner's next ``next()`` builds an iterator at the lost rank's position, skipping the
  sampler's first indices without loading a sample (``DistributedSampler`` and
  ``SequentialSampler`` are functions of (seed, epoch, rank)), with the generators as they stood
  at that pass's ``iter()`` (its workers' base seed); an ``IterableDataset`` with
  ``state_dict()`` (no workers) loads its state at the pass's start and skips what it yielded.

A loader this cannot make exact (torch's ``RandomSampler``: a new order from the generator at
every iteration; an ``IterableDataset`` without ``state_dict()``) is refused in one line when the
loop first iterates it inside a step. A loader tm-launch does not know how to reposition (a
framework's sampler, a custom batch sampler) is left as torch has it, and said once. A batch drawn
between two steps (the loader's loop around the steps': ``for batch in loader: step =
next(steps)``) is refused: the step that runs again begins after it was drawn.
Framework integrations and ``job.data()`` own their loaders (``owned``): left alone.
"""

from __future__ import annotations

import copy
import os
import weakref

from torch.utils.data import DataLoader, IterableDataset, RandomSampler
from torch.utils.data.dataloader import _BaseDataLoaderIter

from .data_loaders import (
    CACHE_LIMIT,
    DataRefused,
    _base_sampler,
    _deterministic,
    _stateful,
    draws_nothing,
    generators_of,
    kept,
    owned,
    same_states,
    skipping_iterator,
)

SAMPLER = "sampler"  # map-style, deterministic sampler: skip by indices
STATEFUL_DATASET = "stateful-dataset"  # an IterableDataset with state_dict(), no workers
LEAVE = "leave"  # not ours to reposition: torch's iterator, said once
REFUSE = "refuse"

_STOP = object()  # a pass's end, kept like a batch


def direct_kind(loader) -> tuple[str, str | None]:
    """How a loader the loop iterates itself is kept exact: (kind, why) where ``why`` is the
    refusal's line (``REFUSE``) or what is left to torch (``LEAVE``)."""
    name = type(loader).__name__
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):
        if not _stateful(dataset):
            return REFUSE, (
                f"the {name} over the IterableDataset {type(dataset).__name__} is iterated inside job.steps(), and that dataset "
                "has no state_dict()/load_state_dict(): a step that runs again, or a rank taking over, could not find its "
                "position; give it both, or use torchdata's StatefulDataLoader with job.data(loader)"
            )
        if loader.num_workers > 0:
            return REFUSE, (
                f"the {name} over {type(dataset).__name__} with num_workers={loader.num_workers} is iterated inside "
                "job.steps(): each worker iterates its own copy of the dataset, whose state this process cannot see; "
                "use num_workers=0, or torchdata's StatefulDataLoader with job.data(loader)"
            )
        return STATEFUL_DATASET, None
    sampler = _base_sampler(loader)
    if _deterministic(sampler):
        return SAMPLER, None
    if type(sampler) is RandomSampler:
        return REFUSE, (
            f"the {name} iterated inside job.steps() shuffles with a RandomSampler, which draws a new order at every "
            "iteration: a step that runs again, or a rank taking over, could not get the same batches; use a "
            "DistributedSampler (and set_epoch), or torchdata's StatefulDataLoader with job.data(loader)"
        )
    return LEAVE, (
        f"the {name} iterated inside job.steps() has a sampler tm-launch cannot reposition ({type(sampler).__name__}): "
        "its batches are exact across a re-run or a rank taking over only if the script positions its iterator itself; "
        "batches = job.data(loader) does it for a DistributedSampler or a StatefulDataLoader"
    )


def _never() -> bool:
    return False


def _raise(refused: DataRefused):
    raise refused


class PassIterator:
    """What ``iter(loader)`` returns in live mode: a view of the loader's current pass."""

    def __init__(self, loop: LoopLoader, token: str, pass_no: int):
        self._loop, self.token, self.pass_no = loop, token, pass_no

    def __iter__(self):
        return self

    def __next__(self):
        return self._loop.next_batch(self)

    def __len__(self) -> int:
        return len(self._loop.loader)

    def position(self) -> int:
        """Batches drawn from the loader's current pass (what torch's iterator counts as ``_num_yielded``)."""
        return self._loop.state_dict()["index"]


def positions(variables: dict) -> dict:
    """Where the loop's loaders stand, for ``tm-launch rehearse`` to compare with plain torchrun's
    run: ``{name: batches drawn from its pass}`` for each DataLoader iterator among ``variables``
    (torch's own, or a ``PassIterator``), ``{name.epoch: epoch}`` for each DataLoader whose
    sampler keeps one. A loader a recovery left at another position (one tm-launch cannot
    reposition) is named there, not only through the batches and weights that follow it."""
    out = {}
    for name, value in variables.items():
        if isinstance(value, PassIterator):
            out[name] = value.position()
        elif isinstance(value, _RefusedLater):
            out[name] = value._inner._num_yielded
        elif isinstance(value, _BaseDataLoaderIter):
            out[name] = value._num_yielded  # read, never changed: torch's count of the batches it handed out
        elif isinstance(value, DataLoader):
            epoch = getattr(_base_sampler(value), "epoch", None)
            if isinstance(epoch, int):
                out[f"{name}.epoch"] = epoch
    return out


class LoopLoader:
    """One loader's position in the loop, as per-rank state (see the module docstring)."""

    def __init__(self, loader, make_iterator, kind: str):
        self.loader, self.kind = loader, kind
        self._make = make_iterator  # torch's own DataLoader.__iter__
        self.refuse = _raise  # LoopLoaders: ends the job with the line
        self.between_steps = _never  # LoopLoaders: the loop of job.steps() runs and no step is in progress
        self._gens = generators_of(loader)
        self._state = {"token": os.urandom(8).hex(), "pass": 0, "epoch": None, "index": 0, "begun": None, "inner": None}
        self._state["generators"] = self._gen_states(own=True)
        self._it = None
        self._it_at: tuple | None = None  # (pass, index) the live torch iterator stands at
        self._cache: dict = {}  # (token, pass, index) -> (batch or _STOP, state after)
        self._starts: dict = {}  # (token, pass) -> (epoch, generators before iter(), after)

    # -- the loop's side -------------------------------------------------------------------------
    def begin_pass(self) -> PassIterator:
        """``iter(loader)``: the next pass, as torch starts it (its generators drawn as torch draws
        them), or as the first attempt of this step started it."""
        s = self._state
        number, epoch, before = s["pass"] + 1, self._epoch_now(), self._gen_states()
        start = self._starts.get((s["token"], number))
        if start is not None and start[0] == epoch and same_states(before, start[1]):
            self._set_gens(start[2])  # a re-run: the first attempt's iterator (or a rebuild) serves it
        else:
            self._drop_iterator()
            self._it, self._it_at = self._make(self.loader), (number, 0)
            self._remember(self._starts, (s["token"], number), (epoch, before, self._gen_states()))
        inner = self._dataset_state()
        self._state = {**s, "pass": number, "epoch": epoch, "index": 0, "begun": before, "inner": inner}
        return PassIterator(self, s["token"], number)

    def next_batch(self, it: PassIterator):
        s = self._state
        if it.token == s["token"] and it.pass_no < s["pass"]:
            self.refuse(
                DataRefused(
                    f"an iterator of {type(self.loader).__name__} was used after a newer iter() of the same loader inside "
                    "job.steps(): tm-launch keeps one position per loader; iterate each loader through one iterator at a time"
                )
            )
        if self.between_steps():
            self.refuse(
                DataRefused(
                    f"a batch of {type(self.loader).__name__} was drawn between two steps of job.steps() (the loader's loop "
                    "around the steps': `for batch in loader: step = next(steps)`): a step that runs again could not get it "
                    "back; draw it inside the step (`for step in job.steps(n): batch = next(it)`), or use batches = job.data(loader)"
                )
            )
        key = (s["token"], s["pass"], s["index"])
        hit = self._cache.get(key)
        if hit is not None:
            batch, self._state = hit
            if batch is _STOP:
                raise StopIteration
            return batch
        if self._it_at != (s["pass"], s["index"]):
            self._rebuild()
        try:
            batch = next(self._it)
        except StopIteration:
            self._remember(self._cache, key, (_STOP, s))
            raise
        self._it_at = (s["pass"], s["index"] + 1)
        inner = self._dataset_state()
        self._state = {**s, "index": s["index"] + 1, "inner": inner if inner is not None else s["inner"]}
        self._state["generators"] = self._gen_states(own=True)
        self._remember(self._cache, key, (batch, self._state))
        return batch

    # -- per-rank state ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return dict(self._state)  # replaced, never changed in place (as job.data()'s Batches)

    def load_state_dict(self, state: dict) -> None:
        state = copy.deepcopy(state)
        if state["token"] != self._state["token"]:  # another process's position: nothing here is of use
            self._cache.clear()
            self._starts.clear()
            self._drop_iterator()
        self._state = state
        if state.get("generators"):
            self._set_gens(state["generators"], own=True)

    def step_begins(self) -> None:
        """Forget what a re-run of the step starting now cannot need."""
        s = self._state
        keep = set(kept(self._cache, (s["token"], s["pass"], s["index"])))
        for k in [k for k in self._cache if k not in keep]:
            del self._cache[k]
        for k in [k for k in self._starts if k[0] != s["token"] or k[1] <= s["pass"]]:
            del self._starts[k]

    # -- inside ----------------------------------------------------------------------------------
    def _remember(self, table: dict, key, value) -> None:
        if len(table) >= CACHE_LIMIT:  # a pass longer than this is rebuilt on a re-run instead: exact, slower
            table.pop(next(iter(table)))
        table[key] = value

    def _dataset_state(self):
        """An iterable dataset's own position (a copy: a dataset may hand out the dict it keeps)."""
        return copy.deepcopy(self.loader.dataset.state_dict()) if self.kind == STATEFUL_DATASET else None

    def _epoch_now(self):
        holder = self.loader.dataset if self.kind == STATEFUL_DATASET else _base_sampler(self.loader)
        epoch = getattr(holder, "epoch", None)
        return epoch if isinstance(epoch, int) else None

    def _gen_states(self, own: bool = False) -> list:
        """The generators' states: torch's default one and the loader's own (``own``: those only)."""
        return [g.get_state() for g in (self._gens[1:] if own else self._gens)]

    def _set_gens(self, states, own: bool = False) -> None:
        for g, state in zip(self._gens[1:] if own else self._gens, states):
            g.set_state(state)

    def _drop_iterator(self) -> None:
        self._it, self._it_at = None, None

    def _rebuild(self) -> None:
        """A torch iterator standing at the current position, built without loading a sample
        before it, with the generators as they stood at the pass's ``iter()``; they are put
        back after."""
        s = self._state
        self._drop_iterator()
        with draws_nothing(self._gens):
            if s["begun"] is not None:
                self._set_gens(s["begun"])
            holder = self.loader.dataset if self.kind == STATEFUL_DATASET else _base_sampler(self.loader)
            if s["epoch"] is not None and callable(getattr(holder, "set_epoch", None)):
                holder.set_epoch(s["epoch"])
            if self.kind == SAMPLER:
                self._it = skipping_iterator(self.loader, s["index"], self._make)
            else:
                self.loader.dataset.load_state_dict(copy.deepcopy(s["inner"]))
                self._it = self._make(self.loader)
        self._it_at = (s["pass"], s["index"])


class _RefusedLater:
    """A refused loader's torch iterator, made before ``job.steps()``: refused at its first use
    inside a step."""

    def __init__(self, inner, why: str, loops: LoopLoaders):
        self._inner, self._why, self._loops = inner, why, loops

    def __iter__(self):
        return self

    def __next__(self):
        if self._loops.inside_step():
            self._loops.refuse(DataRefused(self._why))
        return next(self._inner)

    def __len__(self) -> int:
        return len(self._inner)


class LoopLoaders:
    """Every DataLoader a live worker's script iterates itself: ``iterate`` is what
    ``DataLoader.__iter__`` does in live mode. ``per_rank()`` is the worker's current
    ``PerRankState`` (a script that runs again from the top has a fresh one), ``inside_step()``
    whether a step of ``job.steps()`` is running, ``between_steps()`` whether the loop of
    ``job.steps()`` runs and no step is in progress (a batch drawn then cannot be replayed),
    ``refuse(DataRefused)`` ends the job with its line, ``say(line)`` logs one."""

    def __init__(self, per_rank, inside_step, refuse, say, between_steps=_never):
        self.per_rank, self.inside_step, self.refuse, self._say = per_rank, inside_step, refuse, say
        self.between_steps = between_steps
        # loader -> (kind, why, LoopLoader, its PerRankState), the last two by weak reference: a
        # value that held its key (a LoopLoader holds its loader) would keep it, and with it the
        # PerRankState of a script that ran again from the top (a spare promoted to other ranks):
        # its loop variables, the old frame, and that frame's model and optimizer, which the new
        # run's discovery then found as state of its own that no survivor holds.
        self._loops: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._said: set = set()

    def iterate(self, loader, make_iterator):
        if loader in owned or not isinstance(loader, DataLoader):
            return make_iterator(loader)
        entry = self._loops.get(loader)
        per_rank = self.per_rank()
        loop = entry[2]() if entry is not None and entry[2] is not None else None
        if entry is None or entry[3]() is not per_rank or (entry[2] is not None and loop is None):
            kind, why = direct_kind(loader)
            loop = LoopLoader(loader, make_iterator, kind) if kind in (SAMPLER, STATEFUL_DATASET) else None
            if loop is not None:
                loop.refuse, loop.between_steps = self.refuse, lambda: self.between_steps()
                name = _name_for(per_rank.objects)
                per_rank.objects[name] = loop  # what keeps it alive: the PerRankState it belongs to
                loaded = per_rank.pending.pop(name, None)  # a joiner's loop reaching a loader after it entered
                if loaded is not None:
                    loop.load_state_dict(loaded)
            entry = self._loops[loader] = (kind, why, None if loop is None else weakref.ref(loop), weakref.ref(per_rank))
        kind, why = entry[0], entry[1]
        if loop is not None:
            return loop.begin_pass()
        if kind == REFUSE:
            if self.inside_step():
                self.refuse(DataRefused(why))
            return _RefusedLater(make_iterator(loader), why, self)
        if self.inside_step() and why not in self._said:
            self._said.add(why)
            self._say(f"tm-launch: warning: {why}")
        return make_iterator(loader)


def _name_for(objects: dict) -> str:
    """The per-rank name of the n-th loader the loop iterates (every rank iterates them in the same order)."""
    n = sum(1 for k in objects if k.startswith("tm-loop"))
    return "tm-loop" if n == 0 else f"tm-loop.{n}"
