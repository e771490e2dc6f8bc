"""The job-wide commit: a step's effects are applied on every rank or on none.

Why a vote through the generation's store and not a collective: ranks of one collective can see
different outcomes when a peer dies inside it (some complete the ring, some get 'connection
closed'), so an allreduce of "my step went fine" can commit on one rank and abort on another,
and a tensor-parallel peer of a rank that aborted then holds a step the other shard never took.
The store is one linearizable place (torchft's ``should_commit`` in the same spirit):

* a rank whose collectives of the step all worked adds one to ``<step>/n``; the rank whose add
  makes it the world size writes ``commit`` into ``<step>/d`` by compare-and-set;
* a rank that saw a failure, or that learns of a newer generation while waiting, writes
  ``abort`` by compare-and-set (nobody can reach the world size without its vote);
* everybody acts on what ``<step>/d`` holds: the first writer wins, so all ranks agree.

The vote is taken at the step's first effect (an optimizer, scheduler or scaler step) or at
the end of the body; collectives after it (loss logging, metrics) can fail without undoing or
redoing the step. If the store itself is lost mid-vote (its node died), a rank cannot know the
outcome: it counts the step as not done and says so; the next generation's agreement then finds
which ranks are ahead, and a shard without a replica at the newest step falls back to a checkpoint.
"""

from __future__ import annotations

import datetime
import threading

import torch.distributed as dist

from . import failpoints

COMMIT, ABORT = b"commit", b"abort"
_PATIENCE = datetime.timedelta(seconds=5)


class StepCommit:
    """One decision per step on one generation's store; ``None`` until the vote is taken."""

    def __init__(self):
        self._lock = threading.Lock()
        self._abort_store = None  # another client: abort() runs on the watcher thread
        self.store: dist.Store | None = None
        self.rank, self.world, self.generation = 0, 1, -1
        self.step = -1
        self.decision: bool | None = None
        self.uncertain = False  # the store was lost mid-vote: the outcome is unknown here

    def use(self, store: dist.Store | None, rank: int, world: int, generation: int) -> None:
        """Generation ``generation``'s store (None: the sandbox, where every step commits locally)."""
        with self._lock:
            self.store, self.rank, self.world, self.generation = store, rank, world, generation
            self._abort_store = None if store is None else store.clone()

    def begin(self, step: int) -> None:
        with self._lock:
            self.step, self.decision, self.uncertain = step, None, False

    def abort(self, newer: int) -> None:
        """A peer is gone (generation ``newer``, unplanned, arrived): settle the current step as
        aborted unless it already committed. Called from the watcher thread; wakes a blocked
        voter. A no-op once this rank votes in ``newer`` or later itself."""
        with self._lock:
            store, step = self._abort_store, self.step
            if store is None or step < 0 or self.generation >= newer:
                return
        try:
            store.compare_set(f"{step}/d", "", ABORT.decode())
        except (RuntimeError, dist.DistError):
            pass

    def decide(self, ok: bool, newer_generation) -> bool:
        """Vote once per step; later calls return the same decision."""
        if self.decision is None:
            self.decision = True if self.store is None else self._vote(ok, newer_generation)
            if self.store is not None and self.decision and self.step % self.world == self.rank and self.step >= 2:
                self._forget(self.step - 2)
        return self.decision

    def _vote(self, ok: bool, newer_generation) -> bool:
        store, key = self.store, str(self.step)
        try:
            if not ok:
                return store.compare_set(f"{key}/d", "", ABORT.decode()) == COMMIT
            votes = store.add(f"{key}/n", 1)
            failpoints.reached("vote", self.rank, self.step)
            if votes == self.world:
                return store.compare_set(f"{key}/d", "", COMMIT.decode()) == COMMIT
            while True:
                try:  # the watcher thread writes 'abort' here if a peer is gone
                    store.wait([f"{key}/d"], _PATIENCE)
                    return store.get(f"{key}/d") == COMMIT
                except dist.DistStoreError as e:
                    if "timeout" not in str(e):
                        raise
                    if newer_generation():  # the watcher missed it: settle it here
                        return store.compare_set(f"{key}/d", "", ABORT.decode()) == COMMIT
        except (RuntimeError, dist.DistError):  # the store is gone with its node
            self.uncertain = True
            return False

    def _forget(self, step: int) -> None:
        try:
            self.store.delete_key(f"{step}/n")
            self.store.delete_key(f"{step}/d")
        except (RuntimeError, dist.DistError):
            pass
