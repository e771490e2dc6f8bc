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
redoing the step. A step with several optimizer steps (a GAN's two) votes again before each
later one (``next_vote``: key ``<step>e<k>``, the same key on every rank, since every rank counts
its own optimizer steps alike); the step is committed when its last vote is
(``job.step_guard``). If the store itself is lost mid-vote (its node died), a rank cannot know the
outcome: it counts the step as not done and says so; the next generation's agreement then finds
which ranks are ahead, and a shard without a replica at the newest step falls back to a checkpoint.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import queue
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from .. import failpoints
from ..comms import telemetry as collective_telemetry

COMMIT, ABORT = b"commit", b"abort"
_PATIENCE = datetime.timedelta(seconds=5)
# After this long without every vote, a peer may be dead rather than slow: the voter says so
# (``on_slow_vote``) and its agent checks the peers' agents. A peer that died after its last
# collective of the step fails nothing here, so without this only its lease would tell.
_SLOW_VOTE = datetime.timedelta(milliseconds=200)
_UNANSWERED = 2.0  # s a vote still waits on its store once a newer generation is known


def commit_store(store: dist.Store, generation: int) -> dist.Store:
    """Generation ``generation``'s votes within its bootstrap store."""
    return dist.PrefixStore(f"tm/g{generation}/commit/", store)


def _write_abort(store: dist.Store, key: str) -> None:
    """Settle vote ``key`` as aborted for the ranks waiting on its decision, without waiting for the
    store's answer (a thread of its own). A store whose node was cut off the network neither
    answers nor refuses, and torch's store client has no timeout for a compare-and-set: the
    directive watcher, or a rank whose step failed, would hang on it for good, and with them
    the move to the next generation."""

    def write():
        try:
            store.compare_set(f"{key}/d", "", ABORT.decode())
        except (RuntimeError, dist.DistError):
            pass

    threading.Thread(target=write, name="tm-vote-abort", daemon=True).start()


class _Voter:
    """A daemon thread that runs one vote after another. Starting a thread for each vote cost a
    start handshake per step (0.2-0.5 ms on the 2-core benchmark machine, on the step's critical
    path); this one waits on a queue between votes. A vote walked away from may block its
    thread for good (a store cut off the network): that voter is abandoned (``StepCommit``
    starts another), as its thread would have been."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="tm-vote", daemon=True).start()

    def _run(self) -> None:
        while True:
            job, done = self._jobs.get()
            try:
                done.set_result(job())
            except BaseException as e:  # noqa: BLE001 -- handed to the waiting thread
                done.set_exception(e)

    def submit(self, job: Callable) -> concurrent.futures.Future:
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((job, done))
        return done


class StepCommit:
    """One decision per step on one generation's store; ``None`` until the vote is taken."""

    def __init__(self):
        self._lock = threading.Lock()
        self._abort_store = None  # another client: abort() runs on the watcher thread
        self.store: dist.Store | None = None
        self.rank, self.world, self.generation = 0, 1, -1
        self.step = -1
        self.key = ""  # the vote being taken: "<step>", then "<step>e<k>" before a later optimizer step
        self._later_votes: dict[int, int] = {}  # step -> later votes it took (their keys are forgotten with it)
        self.decision: bool | None = None
        self.uncertain = False  # the store was lost mid-vote: the outcome is unknown here
        self.on_slow_vote: Callable[[bool], None] = lambda waiting: None  # True: still waiting after _SLOW_VOTE; False: decided
        self._voter: _Voter | None = None  # started at the first vote

    def use(self, store: dist.Store | None, rank: int, world: int, generation: int, abort_store: dist.Store | None = None) -> None:
        """Generation ``generation``'s store (None: the sandbox, where every step commits
        locally); ``abort_store``: the same store on a connection of its own, for the watcher
        thread's abort while a vote may be blocked on ``store`` (default: a clone of ``store``)."""
        with self._lock:
            self.store, self.rank, self.world, self.generation = store, rank, world, generation
            self._abort_store = None if store is None else abort_store if abort_store is not None else store.clone()

    def begin(self, step: int) -> None:
        with self._lock:
            self.step, self.decision, self.uncertain = step, None, False
            self.key = str(step)
            # A step run again (a new generation: a store prefix of its own) numbers its votes
            # from the start, as a joiner does; only the last two steps' counts are still to forget.
            self._later_votes = {s: k for s, k in self._later_votes.items() if step - 3 <= s < step}

    def next_vote(self) -> None:
        """A later optimizer step of a step whose votes so far committed: it gets a vote of its
        own (a peer may have died since the last one), on the next key."""
        with self._lock:
            k = self._later_votes.get(self.step, 0) + 1
            self._later_votes[self.step] = k
            self.key, self.decision = f"{self.step}e{k}", None

    def abort(self, newer: int) -> None:
        """A peer is gone (generation ``newer``, unplanned, arrived): settle the current step as
        aborted unless it already committed. Called from the watcher thread; wakes a blocked
        voter. A no-op once this rank votes in ``newer`` or later itself."""
        with self._lock:
            store, step, key = self._abort_store, self.step, self.key
            if store is None or step < 0 or self.generation >= newer:
                return
        _write_abort(store, key)

    def decide(
        self, ok: bool, newer_generation, before_count: Callable[[], bool] | None = None, peer_gone: Callable[[], bool] | None = None
    ) -> bool:
        """Vote once per step; later calls return the same decision. ``before_count``: what must
        be done before this rank's vote counts (its snapshot complete on its holder, its per-rank
        mirror acknowledged: ``snapshots``); False votes to abort. ``peer_gone``: whether an
        unplanned newer generation is known (the vote may then walk away from a store, or a
        holder, that does not answer; default ``newer_generation``)."""
        if self.decision is None:
            token = None if self.store is None else collective_telemetry.vote_entered(self.generation, self.rank)
            self.decision = (
                True if self.store is None else self._vote_or_walk_away(ok, newer_generation, before_count, peer_gone or newer_generation)
            )
            collective_telemetry.vote_done(token)
            if self.decision and self.store is not None:
                if self.step % self.world == self.rank and self.step >= 2:
                    self._forget(self.step - 2)
        return self.decision

    def _vote_or_walk_away(self, ok: bool, newer_generation, before_count, peer_gone) -> bool:
        """``_vote`` on the voter thread, given up (an uncertain abort, as when the store is
        lost) once a peer is known gone and the store has not answered for
        ``_UNANSWERED``. A store whose node was cut off the network neither answers nor
        refuses, and torch's store client has no timeout for a count or a compare-and-set: the
        vote would hold this rank, and its move to the next generation, for good. Walking away
        is safe: where peers committed and this rank did not, the next generation's agreement
        finds it a step behind and it receives that step's state (``transfer``)."""
        if self._voter is None:
            self._voter = _Voter()
        vote = self._voter.submit(lambda: self._vote(ok, newer_generation, before_count))
        newer_since = None
        while True:
            try:
                return vote.result(timeout=0.05)
            except concurrent.futures.TimeoutError:
                if peer_gone():
                    newer_since = newer_since or time.monotonic()
                    if time.monotonic() - newer_since > _UNANSWERED:
                        self.uncertain = True
                        self._voter = None  # its thread may never come back: the next vote gets another
                        return False

    def _vote(self, ok: bool, newer_generation, before_count) -> bool:
        store, key = self.store, self.key
        try:
            if ok and before_count is not None and not before_count():
                ok = False
            if not ok:  # no commit without this rank's count: the decision is known here
                _write_abort(self._abort_store, key)
                return False
            votes = store.add(f"{key}/n", 1)
            failpoints.reached("vote", self.rank, self.step)
            if votes == self.world:
                failpoints.reached("last-vote", self.rank, self.step)
                return store.compare_set(f"{key}/d", "", COMMIT.decode()) == COMMIT
            patience, slow = _SLOW_VOTE, False
            try:
                while True:
                    try:  # the watcher thread writes 'abort' here if a peer is gone
                        store.wait([f"{key}/d"], patience)
                        return store.get(f"{key}/d") == COMMIT
                    except dist.DistStoreError as e:
                        if "timeout" not in str(e):
                            raise
                        if not slow:
                            slow, patience = True, _PATIENCE
                            self.on_slow_vote(True)
                        elif newer_generation():  # the watcher missed it: settle it here
                            return store.compare_set(f"{key}/d", "", ABORT.decode()) == COMMIT
            finally:
                if slow:
                    self.on_slow_vote(False)
        except (RuntimeError, dist.DistError):  # the store is gone with its node
            self.uncertain = True
            return False

    def _forget(self, step: int) -> None:
        keys = [str(step), *(f"{step}e{k}" for k in range(1, self._later_votes.pop(step, 0) + 1))]
        try:
            for key in keys:
                self.store.delete_key(f"{key}/n")
                self.store.delete_key(f"{key}/d")
        except (RuntimeError, dist.DistError):
            pass
