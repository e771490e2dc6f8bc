"""One worker's snapshots: the local copies it keeps, the stream to its holder, what it holds.

``Snapshots`` is what the live job (``runtime``) and the generation protocol (``generations``)
use; the package docstring says why it exists. It runs one background thread, the snapshot
thread, which finishes each capture and sends it; everything the step waits for is a wait on
that thread's result for the step (``ready_to_commit``).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

from .. import failpoints
from ..agent_client import first_line, log
from ..transfer import human_size
from .image import Capture, StateImage
from .link import LinkError, SnapshotClient, SnapshotServer
from .placement import holder_of, source_of


class SnapshotRefused(Exception):
    """The snapshots would not fit in the memory the job allows them (``--snapshot-memory-limit``)."""


class Snapshots:
    def __init__(self, host: str | None, every: int, memory_limit: int, local_world: int):
        self.every = max(0, every)  # 0: no snapshots (layouts without a replica fall back to the checkpoint)
        self.memory_limit = memory_limit  # bytes per node (0: no limit); each worker gets its share
        self.local_world = max(1, local_world)
        self.server = SnapshotServer(host)
        self.remote: frozenset = frozenset()  # registered objects no live rank replicates: sent to the holder
        self.remote_generation = -1  # the generation ``remote`` was worked out in
        self._local: dict[int, StateImage] = {}  # step -> complete local image (at most the newest two)
        self._pending: dict[int, concurrent.futures.Future] = {}  # step -> capture (and send) under way
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tm-snapshot")
        self._lock = threading.Lock()
        self._rank = self._holder = -1
        self._endpoint_of: Callable[[int], tuple] | None = None
        self._client: SnapshotClient | None = None
        self._client_for: tuple | None = None  # (holder rank, address) the client is connected to
        self._sent: set[int] = set()  # steps whose image the current holder acknowledged
        self.bytes_sent = 0
        self._checked_remote: frozenset | None = None  # ``remote`` when the memory limit was last checked
        self._plans: dict = {}  # object name -> image.ModulePlan: a module's walk, kept while it holds

    @property
    def holder(self) -> int:
        """The rank that keeps this rank's snapshots (-1: none)."""
        return self._holder

    @property
    def enabled(self) -> bool:
        """This rank snapshots its objects: it holds something no live rank replicates."""
        return self.every > 0 and bool(self.remote)

    # -- each generation ---------------------------------------------------------------------------
    def set_remote(self, names, generation: int) -> None:
        """What this rank sends its holder in ``generation``: the objects no live rank replicates."""
        self.remote, self.remote_generation = frozenset(names), generation

    def forget(self) -> None:
        """The script runs again for other ranks: its old images are no state of this process's."""
        self.wait_idle()
        with self._lock:
            self._local.clear()
            self._pending.clear()
            self._sent.clear()
        self._plans.clear()  # they hold the old run's tensors
        self.remote, self.remote_generation = frozenset(), -1

    def enter(self, rank: int, world: int, endpoint_of: Callable[[int], tuple]) -> None:
        """A new generation: this process is ``rank`` of ``world``; ``endpoint_of(r)`` gives the
        snapshot server address of rank ``r`` in it (published in the generation's store). A
        send still under way (to a holder that may be gone) is cut short: its connection closes."""
        self._drop_client()
        self.wait_idle()
        holder = holder_of(rank, world, self.local_world)
        with self._lock:
            self._rank, self._endpoint_of = rank, endpoint_of
            self._holder = -1 if holder is None else holder
            source = source_of(rank, world, self.local_world)
            self.server.keep_only([] if source is None else [source])

    def settle(self, step: int) -> None:
        """The job continues from ``step``: snapshots of later steps (of this rank, and of the
        rank it holds for) belong to a timeline the job left, and must never be returned to.
        Snapshots under way are dropped too: the step is captured afresh when it runs again."""
        self.wait_idle()
        with self._lock:
            self._pending.clear()
            for later in [s for s in self._local if s > step]:
                del self._local[later]
            self._sent = {s for s in self._sent if s <= step}
        self.server.drop_after(step)

    def _drop_client(self) -> None:
        if self._client is not None:
            self._client.close()
        self._client, self._client_for = None, None
        self._sent.clear()

    def _holder_client(self) -> SnapshotClient | None:
        """The connection to this rank's holder (the snapshot thread's, or the entering thread's)."""
        with self._lock:
            holder, endpoint_of = self._holder, self._endpoint_of
        if holder < 0 or endpoint_of is None:
            return None
        address = tuple(endpoint_of(holder))
        if self._client is None or self._client_for != (holder, address):
            self._drop_client()
            self._client = SnapshotClient(address, source=self._rank)
            self._client_for = (holder, address)
        return self._client

    # -- each step ------------------------------------------------------------------------------------
    def boundary(self, step: int, objects: dict, per_rank: dict | None) -> None:
        """The start of step ``step``: take its snapshot if it is a snapshot step (the buffers now,
        the rest on the snapshot thread, then the send to the holder)."""
        if not self.enabled or step % self.every or step in self._pending:
            return
        with self._lock:
            spare = None
            if len(self._local) >= 2:  # the older of two: the newest complete one must survive this capture
                spare = self._local.pop(min(self._local))
        capture = Capture(step, objects, per_rank, reuse=spare, plans=self._plans)
        if capture.allocated or self._checked_remote != self.remote:  # a reused layout was checked when allocated
            self._check_memory(capture.image)  # here, on the main thread: the job stops at once, in the open
            self._checked_remote = self.remote
        self._pending[step] = self._thread.submit(self._finish, capture)
        for old in [s for s in self._pending if s < step and self._pending[s].done()]:
            del self._pending[old]

    def _finish(self, capture: Capture) -> bool:
        image = capture.copy()
        with self._lock:
            self._local[image.step] = image
            for old in sorted(self._local)[:-2]:
                del self._local[old]
        return self._send(image)

    def _send(self, image: StateImage) -> bool:
        try:
            client = self._holder_client()
            if client is None:
                return True  # no other rank to hold it (a one-rank job)
            failpoints.reached("snapshot", self._rank, image.step)  # tests: a kill while the snapshot is on its way
            share = image.subset(self.remote)
            client.put_image(share)
        except (LinkError, OSError, RuntimeError) as e:
            log(f"snapshot of step {image.step} not sent to its holder (rank {self._holder}): {first_line(e)}")
            self._drop_client()
            return False
        self._sent.add(image.step)
        self.bytes_sent += share.nbytes
        return True

    def ready_to_commit(self, step: int, give_up: Callable[[], bool]) -> bool:
        """Before step ``step`` commits: its snapshot (if it takes one) is complete locally and on
        the holder. False when it could not be sent (the holder is gone: a peer failed) or
        ``give_up()`` says a newer generation is on its way."""
        pending = self._pending.get(step)
        if pending is None:
            return True
        while True:
            try:
                return bool(pending.result(timeout=0.05))
            except concurrent.futures.TimeoutError:
                if give_up():
                    return False
            except Exception as e:  # noqa: BLE001 -- a capture that failed is a step that must not commit
                log(f"snapshot of step {step} failed: {first_line(e)}")
                return False

    def publish_mirror(self, tag: int, exact: bool, record: bytes) -> bool:
        """Per-rank state of step ``tag`` to the holder, acknowledged (the commit vote's part)."""
        with self._lock:
            if self._holder < 0:
                return True
        try:
            client = self._holder_client()
            if client is not None:
                client.put_mirror(tag, exact, record)
            return True
        except (LinkError, OSError, RuntimeError) as e:
            log(f"per-rank state of step {tag} not sent to its holder (rank {self._holder}): {first_line(e)}")
            self._drop_client()
            return False

    def wait_idle(self) -> None:
        """Let the snapshot thread finish what it started (entering a generation needs a settled state)."""
        for future in list(self._pending.values()):
            try:
                future.result()
            except Exception:  # noqa: BLE001 -- reported where the step waited for it
                pass

    # -- what this rank holds, and returning to it ---------------------------------------------------
    def local_digests(self) -> dict:
        """step -> {name: (structure, values)} of the complete local images: where this rank can return."""
        with self._lock:
            return {s: dict(i.fingerprints()) for s, i in self._local.items()}

    def holds_own(self, step: int) -> bool:
        """This rank's holder acknowledged its image of ``step``."""
        return step in self._sent

    def restore(self, step: int, objects: dict, per_rank) -> None:
        """Return every registered object (and the per-rank state) to the local image of ``step``."""
        with self._lock:
            image = self._local[step]
        image.load_into(objects)
        if image.per_rank is not None:
            per_rank.load(image.per_rank)

    def resend(self, step: int, objects: dict, per_rank: dict | None) -> None:
        """After a change: make sure the holder (maybe a new process) holds this rank's ``step``,
        so that a second failure right after the first still finds it. Synchronous."""
        if not self.enabled or self.holds_own(step):
            return
        with self._lock:
            image = self._local.get(step)
        if image is None:
            image = Capture(step, objects, per_rank, reuse=None, plans=self._plans).copy()
            with self._lock:
                self._local[step] = image
                for old in sorted(self._local)[:-2]:
                    del self._local[old]
        if not self._send(image):
            raise LinkError(f"rank {self._holder} did not take this rank's snapshot of step {step}")

    def fetch(self, holder: int, of_rank: int, step: int, names) -> StateImage:
        """``of_rank``'s snapshot of ``step`` (objects ``names``) from ``holder`` (the rank that replaces it)."""
        client = SnapshotClient(tuple(self._endpoint_of(holder)), source=self._rank)
        try:
            image = client.get_image(of_rank, step, list(names))
        finally:
            client.close()
        if image is None:
            raise LinkError(f"rank {holder} no longer holds rank {of_rank}'s snapshot of step {step}")
        return image

    def fetch_mirror(self, holder: int, of_rank: int, tag: int) -> tuple[bool, bytes] | None:
        client = SnapshotClient(tuple(self._endpoint_of(holder)), source=self._rank)
        try:
            return client.get_mirror(of_rank, tag)
        finally:
            client.close()

    # -- memory ---------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Host memory this worker's snapshots take: its own images and what it holds for another rank."""
        with self._lock:
            own = sum(i.nbytes for i in self._local.values())
        return own + self.server.nbytes

    def _check_memory(self, image: StateImage) -> None:
        """Refuse snapshots that would not fit: two local images of everything and, on the holder,
        two of what no replica holds, for every worker of the node (each gets its share)."""
        if not self.memory_limit:
            return
        need = 2 * image.nbytes + 2 * image.subset(self.remote).nbytes
        share = self.memory_limit // self.local_world
        if need > share:
            raise SnapshotRefused(
                f"snapshots need {human_size(need)} of host memory per worker ({human_size(need * self.local_world)} per node with "
                f"{self.local_world} worker(s)), over --snapshot-memory-limit {human_size(self.memory_limit)}: raise the limit, or "
                f"run without snapshots (--snapshot-every 0: a lost shard then restarts the job from its checkpoint)"
            )

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        self._drop_client()
        self.server.close()
