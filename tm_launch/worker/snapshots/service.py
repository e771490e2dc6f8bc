"""One worker's snapshots: the local copies it keeps, the stream to its holder, what it holds.

``Snapshots`` is what the live job (``runtime``) and the generation protocol (``generations``)
use; the package docstring says why it exists. It runs two background threads: the snapshot
thread finishes each capture (the copy the step's commit waits for) and the sender thread sends
each finished image to the holder. When the send must be done is ``--snapshot-send``:

* ``commit`` (default): before the snapshot's own step commits, so a committed step's snapshot
  (of its start) is on its holder and a fault returns the job at most one step before the
  interrupted one; the send overlaps the step's forward and backward, and what of it they do
  not cover is step time.
* ``overlap``: before the next snapshot step commits, so a send overlaps a whole step. The
  holders are then sure to have the snapshot before the newest one, not the newest: every rank
  keeps the local images from that one on (three with a snapshot every step, two with a longer
  interval; the holder alike), and a fault while a send is on its way returns the job one step
  further. docs/benchmarks.md has the measurements (``bench/snapshot_copy.py``).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

from .. import failpoints
from ..log import first_line, log
from ..state.transfer import human_size
from .image import Capture, StateImage, wire_size
from .link import LinkError, SnapshotClient, SnapshotServer
from .parity import stripe
from .parity_rebuild import rebuild_from_parity
from .placement import holder_of, parity_group, parity_holders, source_of, stripes_held


class SnapshotRefused(Exception):
    """The snapshots would not fit in the memory the job allows them (``--snapshot-memory-limit``)."""


class Snapshots:
    def __init__(self, host: str | None, every: int, memory_limit: int, local_world: int, overlap_send: bool = False, parity: int = 0):
        self.every = max(0, every)  # 0: no snapshots (layouts without a replica fall back to the checkpoint)
        self.overlap_send = overlap_send  # ``--snapshot-send overlap``: a step's commit does not wait for its own send
        self.parity = max(0, parity)  # ``--snapshot-parity K``: XOR parity over groups of K nodes instead of a copy (0: a copy)
        self.memory_limit = memory_limit  # bytes per node (0: no limit); each worker gets its share
        self.local_world = max(1, local_world)
        self.server = SnapshotServer(host)
        self.server.own_image = self._own_image  # a parity member's share, for the rank rebuilding a lost one
        self._closed = False
        self.remote: frozenset = frozenset()  # registered objects no live rank replicates: sent to the holder
        self.remote_generation = -1  # the generation ``remote`` was worked out in
        self._local: dict[int, StateImage] = {}  # step -> complete local image (from ``_floor`` on)
        self._floor = -1  # the newest snapshot step every holder is sure to have: older images are not needed
        self._copies: dict[int, concurrent.futures.Future] = {}  # step -> local copy under way (its commit waits)
        self._sends: dict[int, concurrent.futures.Future] = {}  # step -> send under way (a commit waits: ``_sent_by``)
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tm-snapshot")
        self._sender = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tm-snapshot-send")
        self._lock = threading.Lock()
        self._rank = self._holder = -1
        self._group: list[int] = []  # with parity: the ranks whose snapshots share this rank's parity
        self._stripe_holders: list[int] = []  # with parity: the rank keeping each stripe of it
        self._endpoint_of: Callable[[int], tuple] | None = None
        # One connection for images (the sender thread's; with parity one per stripe holder), one
        # for per-rank mirrors (the voter's): a mirror never waits behind an image on its way.
        self._clients: dict[str, SnapshotClient] = {}
        self._client_for: dict[str, tuple] = {}  # kind -> (rank, address) its client is connected to
        self._sent: set[int] = set()  # steps whose image the current holder acknowledged
        self.bytes_sent = 0
        self._checked_remote: frozenset | None = None  # ``remote`` when the memory limit was last checked
        self._plans: dict = {}  # object name -> image.ModulePlan: a module's walk, kept while it holds

    @property
    def holder(self) -> int:
        """The rank that keeps this rank's snapshots (-1: none); with parity, its per-rank mirrors."""
        return self._holder

    def describe_placement(self) -> str:
        """Where this rank's snapshots go, for the log."""
        if self.parity:
            return (
                f"into the parity of ranks {self._group}, in {len(self._stripe_holders)} stripe(s) kept by rank(s) {self._stripe_holders}"
            )
        return f"to rank {self._holder}"

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
            self._copies.clear()
            self._sends.clear()
            self._sent.clear()
            self._floor = -1
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
            if self.parity:
                self._group = parity_group(rank, world, self.local_world, self.parity)
                self._stripe_holders = parity_holders(rank, world, self.local_world, self.parity)
            stripes = stripes_held(rank, world, self.local_world, self.parity) if self.parity else ()
            self.server.keep_only([] if source is None else [source], stripes)

    def settle(self, step: int) -> None:
        """The job continues from ``step``: snapshots of later steps (of this rank, and of the
        rank it holds for) belong to a timeline the job left, and must never be returned to.
        Snapshots under way are dropped too: the step is captured afresh when it runs again."""
        self.wait_idle()
        with self._lock:
            self._copies.clear()
            self._sends.clear()
            for later in [s for s in self._local if s > step]:
                del self._local[later]
            self._sent = {s for s in self._sent if s <= step}
            self._floor = step  # ``resend`` puts ``step`` on the holder before the job goes on
        self.server.drop_after(step)

    def _drop_client(self) -> None:
        with self._lock:
            clients, self._clients, self._client_for = list(self._clients.values()), {}, {}
            self._sent.clear()
        for client in clients:
            client.close()

    def _holder_client(self, kind: str, rank: int | None = None) -> SnapshotClient | None:
        """The connection for ``kind`` ("image": the sender thread's, or the entering thread's
        while the sender is idle; "stripe<j>": the same, to a parity stripe's holder; "mirror":
        the voter's) to ``rank`` (default: this rank's holder)."""
        with self._lock:
            rank, endpoint_of = self._holder if rank is None else rank, self._endpoint_of
        if rank < 0 or endpoint_of is None:
            return None
        address = tuple(endpoint_of(rank))  # may read the generation's store: not under the lock
        stale = None
        with self._lock:
            if self._client_for.get(kind) != (rank, address):  # a new holder: the old connection goes
                stale, self._client_for[kind] = self._clients.pop(kind, None), (rank, address)
                if kind != "mirror":
                    self._sent.clear()  # what the old one acknowledged is not on the new one
            client = self._clients.get(kind)
        if stale is not None:
            stale.close()
        if client is None:
            client = SnapshotClient(address, source=self._rank)
            with self._lock:
                self._clients[kind] = client
        return client

    # -- each step ------------------------------------------------------------------------------------
    def boundary(self, step: int, objects: dict, per_rank: dict | None) -> None:
        """The start of step ``step``: take its snapshot if it is a snapshot step (the buffers now,
        the rest on the snapshot thread, then the send to the holder)."""
        with self._lock:
            if not self.enabled or step % self.every or step in self._copies:
                return
            if self.parity and step in self._local:
                # The job returned to a step it holds: those are the bytes that went into the
                # parity (or go in again, ``resend``), and a member's image must stay the bytes
                # it XORed in: a rebuild reads it. A new capture would be the same bytes.
                return
            # The previous step committed: every snapshot its commit waited for is on its holder,
            # so the newest of those is the oldest the job may return to.
            self._floor = max([s for s in self._local if s < self._sent_by(step - 1)], default=self._floor)
            older = sorted(s for s in self._local if s < self._floor)
            spare = self._local.pop(older[-1]) if older else None  # its buffers take this capture
            for s in older[:-1]:
                del self._local[s]
            floor = self._floor
        if self.parity:
            self.server.drop_images_before(floor)  # a drained rank's whole copy, once the job is past it
        capture = Capture(step, objects, per_rank, reuse=spare, plans=self._plans)
        if capture.allocated or self._checked_remote != self.remote:  # a reused layout was checked when allocated
            self._check_memory(capture.image)  # here, on the main thread: the job stops at once, in the open
            self._checked_remote = self.remote
        copied = self._thread.submit(self._finish, capture)
        sent = self._sender.submit(self._send_when_copied, copied, floor)
        with self._lock:
            self._copies[step], self._sends[step] = copied, sent

    def _finish(self, capture: Capture) -> StateImage:
        image = capture.copy()
        with self._lock:
            self._local[image.step] = image
        return image

    def _send_when_copied(self, copied: concurrent.futures.Future, floor: int) -> bool:
        try:
            image = copied.result()
        except Exception:  # noqa: BLE001 -- the step's own commit reports the failed copy
            return False
        return self._send(image, floor)

    def _send(self, image: StateImage, keep_from: int, whole: bool = False) -> bool:
        """Put ``image``'s share on the holder, which may then drop what it holds from before
        ``keep_from`` (the oldest step the job may return to); with parity, into its group's
        parity unless ``whole`` (a whole copy on the ring's holder, as without parity)."""
        try:
            share = image.subset(self.remote)
            if self.parity and not whole:
                if not self._send_stripes(share, keep_from):
                    return True  # no other rank to hold it (a one-rank job)
            else:
                client = self._holder_client("image")
                if client is None:
                    return True  # no other rank to hold it (a one-rank job)
                failpoints.reached("snapshot", self._rank, image.step)  # tests: a kill while the snapshot is on its way
                client.put_image(share, keep_from)
        except (LinkError, OSError, RuntimeError) as e:
            if not self._closed:
                log.info(f"snapshot of step {image.step} not sent to its holder (rank {self._holder}): {first_line(e)}")
            self._drop_client()
            return False
        with self._lock:
            self._sent.add(image.step)
            self.bytes_sent += share.nbytes
        return True

    def _send_stripes(self, share: StateImage, keep_from: int) -> bool:
        """Send each stripe of ``share`` into its holder's parity (``--snapshot-parity``); False
        when there is no holder. The description travels with every stripe: the rank rebuilding
        this one needs it (its objects, per-rank state, size) and the fingerprints to check the
        rebuilt bytes against."""
        with self._lock:
            holders, group = list(self._stripe_holders), self._group[0] if self._group else -1
        if not holders:
            return False
        meta = {
            "names": tuple(share.names()),
            "skeleton": share.skeleton,
            "modules": sorted(share.modules),
            "per_rank": share.per_rank,
            "nbytes": wire_size(share.specs),
            "digests": dict(share.fingerprints()),
        }
        chunks = share.wire_chunks()
        for j, holder in enumerate(holders):
            client = self._holder_client(f"stripe{j}", holder)
            if j == 0:
                failpoints.reached("snapshot", self._rank, share.step)  # tests: a kill while the snapshot is on its way
            if not client.put_stripe(group, j, len(holders), share.step, meta, stripe(chunks, j, len(holders)), keep_from):
                raise LinkError(f"rank {holder} does not keep stripe {j} of the parity of ranks {self._group}")
        return True

    def _sent_by(self, step: int) -> int:
        """The snapshots on their holders once ``step`` commits: every one before the step this
        returns (with ``commit``, the step's own too; with ``overlap``, the ones before it)."""
        return step if self.overlap_send else step + 1

    def ready_to_commit(self, step: int, give_up: Callable[[], bool]) -> bool:
        """Before step ``step`` commits: its snapshot (if it takes one) is complete locally, and
        every one before ``_sent_by(step)`` is on the holder. False when a copy failed, a send
        could not be made (the holder is gone: a peer failed) or ``give_up()`` says a newer
        generation is on its way. A step that commits thus tells every rank which snapshots
        the holders have (the floor of the next ``boundary``)."""
        sent_by = self._sent_by(step)
        with self._lock:
            waits = [(s, f) for s, f in self._copies.items() if s == step]
            waits += [(s, f) for s, f in sorted(self._sends.items()) if s < sent_by]
        for s, future in waits:
            while True:
                try:
                    if not future.result(timeout=0.05):
                        return False  # the send said why
                    break
                except concurrent.futures.TimeoutError:
                    if give_up():
                        return False
                except Exception as e:  # noqa: BLE001 -- a capture that failed is a step that must not commit
                    log.info(f"snapshot of step {s} failed: {first_line(e)}")
                    return False
        with self._lock:
            for s in [s for s in self._copies if s <= step and self._copies[s].done()]:
                del self._copies[s]
            for s in [s for s in self._sends if s < sent_by and self._sends[s].done()]:
                del self._sends[s]
        return True

    def publish_mirror(self, tag: int, exact: bool, record: bytes) -> bool:
        """Per-rank state of step ``tag`` to the holder, acknowledged (the commit vote's part)."""
        with self._lock:
            if self._holder < 0:
                return True
        try:
            client = self._holder_client("mirror")
            if client is not None:
                client.put_mirror(tag, exact, record)
            return True
        except (LinkError, OSError, RuntimeError) as e:
            log.info(f"per-rank state of step {tag} not sent to its holder (rank {self._holder}): {first_line(e)}")
            self._drop_client()
            return False

    def wait_idle(self) -> None:
        """Let the snapshot thread finish what it started (entering a generation needs a settled state)."""
        with self._lock:
            futures = [*self._copies.values(), *self._sends.values()]
        for future in futures:
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

    def resend(self, step: int, objects: dict, per_rank: dict | None, leaving: bool = False) -> None:
        """After a change: make sure the holder (maybe a new process) holds this rank's ``step``,
        so that a second failure right after the first still finds it. Synchronous.
        ``leaving`` (a drained rank at its switch step): a whole copy goes to the ring's holder
        even with parity, since the rank taking over starts from that very step, and the group's
        other members keep no snapshot of it unless it is a snapshot step."""
        whole = leaving and bool(self.parity)
        if not self.enabled or (self.holds_own(step) and not whole):
            return
        with self._lock:
            image = self._local.get(step)
        if image is None:
            image = Capture(step, objects, per_rank, reuse=None, plans=self._plans).copy()
            with self._lock:
                self._local[step] = image
                for old in [s for s in self._local if s < step]:
                    del self._local[old]
        if not self._send(image, keep_from=step, whole=whole):
            raise LinkError(f"rank {self._holder} did not take this rank's snapshot of step {step}")

    def fetch(self, holder: int, of_rank: int, step: int, names) -> StateImage:
        """``of_rank``'s snapshot of ``step`` (objects ``names``) from ``holder`` (the rank that replaces it)."""
        image = self._ask(holder, lambda client: client.get_image(of_rank, step, list(names)))
        if image is None:
            raise LinkError(f"rank {holder} no longer holds rank {of_rank}'s snapshot of step {step}")
        return image

    def _ask(self, rank: int, call):
        """``call(client)`` over a connection of its own to ``rank``'s snapshot server."""
        client = SnapshotClient(tuple(self._endpoint_of(rank)), source=self._rank)
        try:
            return call(client)
        finally:
            client.close()

    def _own_image(self, step: int) -> StateImage | None:
        with self._lock:
            return self._local.get(step)

    def rebuild(self, holders: list, group: int, of_rank: int, step: int, members: dict) -> tuple[StateImage, int]:
        """``of_rank``'s snapshot of ``step`` rebuilt from its group's parity (``parity_rebuild``)."""
        return rebuild_from_parity(self._ask, holders, group, of_rank, step, members)

    def needs_resend(self, step: int, holdings: list) -> bool:
        """True when one of this rank's holders (``holdings``: every rank's ``recovery.Holding``,
        by rank) lacks this rank's snapshot of ``step``: the holder is new, or its copy was lost."""
        if self.parity:
            with self._lock:
                holders, group = list(self._stripe_holders), self._group[0] if self._group else -1
            return any(
                self._rank not in next((steps.get(step, {}) for (g, _, _), steps in holdings[h].stripes.items() if g == group), {})
                for h in holders
            )
        holder = next((h.rank for h in holdings if self._rank in h.held), None)
        ours = holdings[holder].held.get(self._rank, {}) if holder is not None else {}
        return step not in (ours.get("images") or {})

    def fetch_mirror(self, holder: int, of_rank: int, tag: int) -> tuple[bool, bytes] | None:
        return self._ask(holder, lambda client: client.get_mirror(of_rank, tag))

    # -- memory ---------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Host memory this worker's snapshots take: its own images and what it holds for another rank."""
        with self._lock:
            own = sum(i.nbytes for i in self._local.values())
        return own + self.server.nbytes

    def _check_memory(self, image: StateImage) -> None:
        """Refuse snapshots that would not fit: the local images of everything and, on the holder,
        as many of what no replica holds (``kept_images`` of each), for every worker of the node
        (each gets its share)."""
        if not self.memory_limit:
            return
        copies = self.kept_images
        held = image.subset(self.remote).nbytes  # a copy of another rank's share, as big as this rank's
        if self.parity:  # the stripes of the groups' parities this rank keeps
            held = sum(held // stripes for _, _, stripes in self.server.stripes_held())
        need = copies * image.nbytes + copies * held
        share = self.memory_limit // self.local_world
        if need > share:
            raise SnapshotRefused(
                f"snapshots need {human_size(need)} of host memory per worker ({human_size(need * self.local_world)} per node with "
                f"{self.local_world} worker(s)), over --snapshot-memory-limit {human_size(self.memory_limit)}: raise the limit, or "
                f"run without snapshots (--snapshot-every 0: a lost shard then restarts the job from its checkpoint)"
            )

    @property
    def kept_images(self) -> int:
        """Images of a rank kept at once, locally and on its holder: the one the job may return to,
        the one being taken and, with ``overlap`` and a snapshot every step, the one on its way."""
        return 3 if self.overlap_send and self.every == 1 else 2

    def close(self) -> None:
        self._closed = True  # a send cut short by closing is no news
        self._thread.shutdown(wait=False, cancel_futures=True)
        self._sender.shutdown(wait=False, cancel_futures=True)
        self._drop_client()
        self.server.close()
