"""``batches = job.data(loader)``: the batches of a loop, exact across a step that runs again and
across a rank that joins in another's place.

A torchrun loop holds an iterator of its ``DataLoader`` and calls ``next(it)`` once per step. Under
live substitution that loop goes wrong three ways: a step that runs again (a peer died before it
committed) gets the *next* batch, since the iterator already handed out the first attempt's; a
joiner's fresh iterator starts the epoch over; and ``load_state_dict()`` on torchdata's
``StatefulDataLoader`` only takes effect at the next ``iter()``, not on the iterator the loop holds.
So tm-launch owns the iterator, and the epochs:

* **A step that runs again gets the batch of its first attempt.** Every batch handed out since the
  current step began is kept (``Batches.step_begins``, called at each step's start, forgets the
  older ones) under the position it was drawn at. The per-rank machinery
  (``tm_launch.worker.state.per_rank``) snapshots this object's state at every step's start and loads it
  back when the step runs again; ``next()`` then finds the batch of that position kept, and the
  loader's iterator, already past it, goes on from where it is.
* **A joiner continues at the lost rank's epoch and position, without loading what lies before.**
  The state (epoch, batch index, the loader's own state where it has one) is per-rank state: it
  travels to the joiner with the lost rank's per-rank mirror. Loading it moves nothing at once;
  the next ``next()`` builds an iterator at that position: a map-style loader whose sampler is
  deterministic given (seed, epoch, rank) (``DistributedSampler``, ``SequentialSampler``) skips the
  batch sampler's first indices without fetching a sample; a ``StatefulDataLoader`` loads its own
  state and starts a fresh ``iter()``; an ``IterableDataset`` with ``state_dict()`` loads its own.
* **tm-launch owns the epoch loop.** When an epoch's iterator runs out, ``next()`` calls
  ``set_epoch(next epoch)`` on the sampler (and on an iterable dataset that has it) and starts the
  next epoch's iterator; ``batches.epoch`` says the epoch of the last batch. The same code runs
  under plain torchrun (``PlainJob``), so the fault-free torchrun run and the live run see the same
  batches.
* **Random numbers stay where the fault-free run has them.** A DataLoader draws its workers' base
  seed from the global generator (or ``loader.generator``) at every ``iter()``. Starting an epoch
  draws it as torch would; building an iterator only to reposition it draws nothing (the
  generators are put back); and a re-run step that finds the epoch's first batch kept gets the
  generators as the first attempt left them.

Loaders that cannot be made exact are refused when handed over, with one line that says what to
do (``DataRefused``; live mode then fails the job, no restart helps).
"""

from __future__ import annotations

import contextlib
import copy
import os
import weakref

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, SequentialSampler

SAMPLER = "sampler"  # map-style DataLoader, deterministic sampler: skip by indices
STATEFUL_LOADER = "stateful-loader"  # StatefulDataLoader (state_dict/load_state_dict, then a fresh iter())
STATEFUL_DATASET = "stateful-dataset"  # DataLoader over an IterableDataset with state_dict, no workers

owned: weakref.WeakSet = weakref.WeakSet()  # loaders job.data() or a framework's loop iterates: never routed (loop_loaders)
CACHE_LIMIT = 256  # batches kept at most (a loop drawing more per step rebuilds instead: exact, slower)


class DataRefused(ValueError):
    """A loader (or a registered object) tm-launch cannot keep exact; the message is one line."""


def _stateful(obj) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _base_sampler(loader):
    """The sampler that orders the samples (a batch sampler's inner one), None for iterable datasets."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    if batch_sampler is not None and not isinstance(batch_sampler, BatchSampler):
        return batch_sampler  # a custom batch sampler: judged as it is
    return getattr(batch_sampler, "sampler", None) or getattr(loader, "sampler", None)


def _deterministic(sampler) -> bool:
    """Its order is a function of (seed, epoch, rank): iterating it again gives the same indices."""
    return isinstance(sampler, (DistributedSampler, SequentialSampler))


def loader_kind(loader) -> str:
    """How ``loader`` is repositioned (``SAMPLER``, ``STATEFUL_LOADER``, ``STATEFUL_DATASET``), or
    ``DataRefused`` with what to do where it cannot be made exact."""
    name = type(loader).__name__
    if not isinstance(loader, DataLoader):
        if _stateful(loader) and hasattr(loader, "__iter__"):
            return STATEFUL_LOADER  # the StatefulDataLoader contract: iter() after load_state_dict() resumes
        raise DataRefused(f"job.data() takes a torch DataLoader or a loader with state_dict()/load_state_dict(), not {name}")
    dataset = loader.dataset
    iterable = isinstance(dataset, IterableDataset)
    if iterable and not _stateful(dataset):
        raise DataRefused(
            f"job.data(): the IterableDataset {type(dataset).__name__} has no state_dict()/load_state_dict(), so a rank "
            "taking over could only find its position by reading every sample before it; give it both (its iter() resuming "
            "from the loaded state)"
        )
    sampler = None if iterable else _base_sampler(loader)
    if _stateful(loader):  # torchdata's StatefulDataLoader
        if sampler is not None and not (_deterministic(sampler) or _stateful(sampler)):
            raise DataRefused(
                f"job.data(): the StatefulDataLoader's sampler {type(sampler).__name__} draws a new order on every "
                "iteration and keeps no state; use a DistributedSampler, or torchdata's RandomSampler / StatefulDistributedSampler"
            )
        return STATEFUL_LOADER
    if iterable:
        if loader.num_workers > 0:
            raise DataRefused(
                f"job.data(): with num_workers={loader.num_workers} each worker iterates its own copy of "
                f"{type(dataset).__name__}, whose state the main process cannot see; use torchdata's StatefulDataLoader "
                "(it keeps every worker's state), or num_workers=0"
            )
        return STATEFUL_DATASET
    if not _deterministic(sampler):
        raise DataRefused(
            f"job.data(): the DataLoader's sampler {type(sampler).__name__} is not a function of (seed, epoch, rank), "
            "so a rank taking over cannot find its position without loading every batch before it; use a DistributedSampler "
            "(tm-launch calls set_epoch), or torchdata's StatefulDataLoader"
        )
    return SAMPLER


def refuse_registered(objects: dict) -> str | None:
    """Why ``job.register(...)`` must not take one of ``objects``: a loader, sampler or loader
    iterator registered as state cannot rewind the iterator the loop holds (torchdata's
    ``load_state_dict`` waits for the next ``iter()``), so a re-run step or a joiner would read
    other batches than the fault-free run. None when all are fine."""
    from torch.utils.data import Sampler
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    for name, obj in objects.items():
        if isinstance(obj, (DataLoader, Sampler, _BaseDataLoaderIter)):
            return (
                f"job.register({name}=<{type(obj).__name__}>) cannot rewind the iterator your loop holds; hand the "
                f"loader to tm-launch instead: batches = job.data(loader), then batch = next(batches) once per step"
            )
    return None


# -- position arithmetic: pure decisions ---------------------------------------------------------


def next_action(at: tuple, cached: bool, iterator_at: tuple | None, exhausted: bool, length: int | None) -> str:
    """What ``next()`` does at position ``at`` = (epoch, index):

    * ``cached``: this position's batch was handed out in the current step already (a re-run);
    * ``draw``: the live iterator stands at ``at``; take its next batch;
    * ``begin``: start epoch ``at[0]`` (index 0: nothing drawn in it yet), or the next one (the
      live iterator ran out at ``at``, or a map-style loader of ``length`` batches is past its end);
    * ``rebuild``: build an iterator standing at ``at`` (a joiner, a return to an older step)."""
    if cached:
        return "cached"
    if iterator_at == at:
        return "begin" if exhausted else "draw"
    if at[1] == 0 or (length is not None and at[1] >= length):
        return "begin"
    return "rebuild"


def begin_epoch(at: tuple) -> int:
    """The epoch that ``begin`` starts at position ``at``: ``at``'s own when nothing was drawn in it."""
    return at[0] if at[1] == 0 else at[0] + 1


def kept(keys, at: tuple) -> list:
    """Cache keys (token, epoch, index) still needed at a step that starts at ``at``
    (token, epoch, index): those of this lineage at or after it (a re-run goes back to ``at``)."""
    return [k for k in keys if k[0] == at[0] and k[1:] >= at[1:]]


class SkipOnce:
    """An index sampler whose iterations skip its first ``n`` items (batches of indices, or
    indices) until ``n`` is set to 0: a DataLoader iterator built on it stands at batch ``n``
    without fetching a sample. The iterator's constructor iterates it more than once (the base
    class, then the workers' reset); later iterations (persistent workers reuse it for the next
    epoch) are the sampler's own."""

    def __init__(self, inner, n: int):
        self.inner, self.n = inner, n

    def __iter__(self):
        it = iter(self.inner)
        for _ in range(self.n):
            next(it, None)
        return it

    def __len__(self) -> int:
        return len(self.inner)


def skipping_iterator(loader, index: int, make_iterator):
    """``make_iterator(loader)`` standing at batch ``index`` of the epoch its sampler is set to,
    without fetching a sample before it (the sampler's first indices are skipped)."""
    attr = "batch_sampler" if loader._auto_collation else "sampler"
    original = getattr(loader, attr)
    loader._iterator = None  # persistent workers: a new iterator, on the skipping sampler
    skipping = SkipOnce(original, index)
    object.__setattr__(loader, attr, skipping)  # DataLoader forbids setting it
    try:
        return make_iterator(loader)
    finally:
        skipping.n = 0
        object.__setattr__(loader, attr, original)


def generators_of(loader) -> list:
    """The generators an ``iter()`` of ``loader`` may draw from: torch's default one (the workers'
    base seed), the loader's and its sampler's own."""
    found = [torch.default_generator]
    for g in (
        getattr(loader, "generator", None),
        getattr(_base_sampler(loader) if isinstance(loader, DataLoader) else None, "generator", None),
    ):
        if isinstance(g, torch.Generator) and all(g is not f for f in found):
            found.append(g)
    return found


@contextlib.contextmanager
def draws_nothing(generators):
    """Build an iterator only to reposition it: whatever it draws is put back."""
    states = [g.get_state() for g in generators]
    try:
        yield
    finally:
        for g, s in zip(generators, states):
            g.set_state(s)


def same_states(a, b) -> bool:
    return a is not None and b is not None and len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


class Batches:
    """The iterator ``job.data(loader)`` returns: ``next(batches)`` once per step (see the module
    docstring). ``state_dict()``/``load_state_dict()`` make it registrable per-rank state (and
    checkpointable by the script); a loaded state takes effect at the next ``next()``."""

    def __init__(self, loader, cached: bool = True):
        self.kind = loader_kind(loader)
        self.loader = loader
        if isinstance(loader, DataLoader):
            owned.add(loader)  # its iterators are this object's, not the loop's (state.loop_loaders)
        self._cached = cached  # False under plain torchrun: no step ever runs again
        self._gens = generators_of(loader)
        # Where the next batch comes from: (lineage, epoch, index, inner). The lineage names the
        # run of batches this state belongs to: a state loaded from another process (a joiner's)
        # has another, and then nothing kept or live here is of use.
        self._state = {"token": os.urandom(8).hex(), "epoch": 0, "index": 0, "inner": None, "generators": self._gen_states()}
        self._it = None
        self._it_at: tuple | None = None  # (epoch, index) the live iterator stands at
        self._exhausted = False  # the live iterator ran out
        self._began = None  # the generators before the last draw started an epoch (its iter() draws the workers' base seed)
        self._cache: dict = {}  # (token, epoch, index) -> (batch, state after, generators before/after an epoch start)

    # -- the loop's side -------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch of the last batch handed out (0 before the first)."""
        return self._state["epoch"]

    @property
    def index(self) -> int:
        """Batches handed out in the current epoch."""
        return self._state["index"]

    def __iter__(self):
        return self

    def __next__(self):
        key = self._key()
        hit = self._cache.get(key)
        length = len(self.loader) if self.kind == SAMPLER else None
        action = next_action(key[1:], hit is not None, self._it_at, self._exhausted, length)
        if action == "cached":
            batch, after, rng = hit
            if rng is not None and same_states(self._gen_states(all_gens=True), rng[0]):
                self._set_gens(rng[1], all_gens=True)  # as the first attempt's epoch start left them
            self._state = after
            return batch
        if action == "rebuild":
            self._rebuild(key[1:])
            return next(self)
        self._began = None
        if action == "begin":
            self._begin(begin_epoch(key[1:]))
        batch = self._draw()  # may begin the next epoch too
        if self._cached:
            rng = (self._began, self._gen_states(all_gens=True)) if self._began is not None else None
            if len(self._cache) >= CACHE_LIMIT:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = (batch, self._state, rng)
        return batch

    # -- per-rank state ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        # A shallow copy: the state is replaced, never changed in place, and the per-rank
        # machinery copies it deeply anyway (a deep copy here doubled the wrapper's cost per step).
        return dict(self._state)

    def load_state_dict(self, state: dict) -> None:
        state = copy.deepcopy(state)
        if state["token"] != self._state["token"]:  # another process's batches: nothing here is of use
            self._cache.clear()
            self._drop_iterator()
        self._state = state
        if state.get("generators") is not None:
            self._set_gens(state["generators"])

    def step_begins(self) -> None:
        """A step starts at the current position (``per_rank.PerRankState.begin_step``): batches
        handed out before it are not needed again by a re-run."""
        keep = set(kept(self._cache, self._key()))
        for k in [k for k in self._cache if k not in keep]:
            del self._cache[k]

    # -- inside ----------------------------------------------------------------------------------
    def _key(self) -> tuple:
        s = self._state
        return s["token"], s["epoch"], s["index"]

    def _gen_states(self, all_gens: bool = False):
        """States of the loader's own generators (per-rank state: no RNGState holds them); with
        ``all_gens`` torch's default one too."""
        gens = self._gens if all_gens else self._gens[1:]
        return [g.get_state() for g in gens] if gens else None

    def _set_gens(self, states, all_gens: bool = False) -> None:
        for g, s in zip(self._gens if all_gens else self._gens[1:], states):
            g.set_state(s)

    def _set_epoch(self, epoch: int) -> None:
        targets = [self.loader]
        if isinstance(self.loader, DataLoader):
            targets = [_base_sampler(self.loader), self.loader.dataset]
        for t in targets:
            if t is not None and callable(getattr(t, "set_epoch", None)):
                t.set_epoch(epoch)

    def _drop_iterator(self) -> None:
        self._it, self._it_at, self._exhausted = None, None, False

    def _begin(self, epoch: int) -> None:
        """Start ``epoch`` as a fault-free run does: ``set_epoch``, then a fresh ``iter()``."""
        self._began = self._gen_states(all_gens=True)  # nothing drew from them yet in this next()
        if self.kind == STATEFUL_LOADER and isinstance(self.loader, DataLoader) and not self._exhausted:
            self.loader.load_state_dict({})  # no state of an older position left to resume from
        self._drop_iterator()
        self._set_epoch(epoch)
        self._it = iter(self.loader)
        self._it_at = (epoch, 0)
        self._state = {**self._state, "epoch": epoch, "index": 0, "inner": None}

    def _draw(self):
        while True:
            try:
                batch = next(self._it)
            except StopIteration:
                self._exhausted = True
                if self._it_at[1] == 0:
                    raise RuntimeError(f"job.data(): epoch {self._it_at[0]} of the loader has no batch") from None
                self._begin(self._it_at[0] + 1)
                continue
            epoch, index = self._it_at[0], self._it_at[1] + 1
            self._it_at = (epoch, index)
            self._state = {**self._state, "epoch": epoch, "index": index, "inner": self._inner(), "generators": self._gen_states()}
            return batch

    def _inner(self):
        """The loader's own state after a batch (none for a sampler: its position is the index)."""
        if self.kind == STATEFUL_LOADER:
            return self.loader.state_dict()
        if self.kind == STATEFUL_DATASET:
            return self.loader.dataset.state_dict()
        return None

    def _rebuild(self, at: tuple) -> None:
        """An iterator standing at ``at`` = (epoch, index), built without loading a sample before it."""
        epoch, index = at
        self._drop_iterator()
        with draws_nothing(self._gens):
            self._set_epoch(epoch)
            if self.kind == SAMPLER:
                self._it = skipping_iterator(self.loader, index, iter)
            elif self.kind == STATEFUL_LOADER:
                self.loader.load_state_dict(copy.deepcopy(self._state["inner"]))  # the loader may keep it
                self._it = iter(self.loader)
            else:
                self.loader.dataset.load_state_dict(copy.deepcopy(self._state["inner"]))
                self._it = iter(self.loader)
        self._it_at = at


def name_for(objects: dict) -> str:
    """The per-rank name of the next ``job.data()`` loader (the n-th call on every rank: the same name)."""
    n = sum(1 for k in objects if k.startswith("tm-data"))
    return "tm-data" if n == 0 else f"tm-data.{n}"
