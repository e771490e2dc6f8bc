"""A generation's communicators as they are built: on the generation's store, on a thread while
this one watches for a newer generation, or ahead of time.

Every group is built by ``communicators.build`` with the job's devices (``LiveJob.devices``, from
``tm_launch.init(backend=...)``): gloo for CPU tensors, NCCL too for CUDA tensors, each on a
fresh ``tm/g<N>/<group>/`` prefix of the generation's store (reusing a prefix reads stale
addresses). A build waits for every member, so a member that died would hold this process for
the whole set-up timeout: builds run on a thread while the caller watches the directives
(``Superseded``). A world may be built *ahead*: a promoted spare's while it runs the script again
for its new ranks, a survivor's while its interrupted step ends (``build_ahead_as_survivor``).
"""

from __future__ import annotations

import threading

import torch.distributed as dist

from ...protocol import Directive, StoreAddress, WorkerEnv
from ..comms import communicators, connections
from ..comms.store_clients import StoreClients
from .directives import Directives


class Superseded(Exception):
    """A newer generation arrived while this process was entering an older one."""

    def __init__(self, directive: Directive):
        super().__init__(f"generation {directive.generation}")
        self.directive = directive


class WorldBuilds:
    def __init__(self, state, directives: Directives, env: WorkerEnv, devices: tuple):
        self.state = state  # the worker's TrainingState: is it in the sandbox, which rank it holds
        self.directives = directives
        self.local_rank = env.local_rank
        self.devices = devices  # every group of the job serves these (``communicators.job_devices``)
        self._addr = env.local_addr
        self._timeout = env.collective_timeout
        self.setup_timeout = env.setup_timeout  # joiners may start cold
        self.clients = StoreClients(self.setup_timeout)  # the generation stores' connections, opened ahead
        self.current: Directive | None = None  # the generation being entered or trained in
        self._ahead: tuple | None = None  # (generation, (thread, box)): a world communicator built ahead of enter()
        self._ahead_lock = threading.Lock()  # the directive watcher starts builds ahead; the main thread takes them
        self._entering = -1  # the newest generation the main thread began to enter: none is built ahead for it now

    def close(self) -> None:
        self.take_ahead(None)
        self.clients.close()

    def store(self, where: StoreAddress | None) -> dist.Store:
        """A connection of its own to the store ``where`` names (``tm_launch.worker.comms.store_clients``)."""
        return self.clients.take(where)

    def build(self, ranks, global_rank: int, gen: int, d: Directive | None = None, key: str | None = None):
        """A communicator for ``ranks`` (None: the world) in generation ``gen``, via a fresh prefix,
        on the job's devices (``communicators.build``: the one place that builds them). ``key``:
        a subgroup's own name in that prefix (``LiveGroup.store_key``)."""
        d = d or self.current
        name = "world" if ranks is None else key
        store = dist.PrefixStore(f"tm/g{gen}/{name}/", self.store(d.store))
        rank, size = (global_rank, d.world_size) if ranks is None else (ranks.index(global_rank), len(ranks))
        return communicators.build(
            store, rank, size, devices=self.devices, timeout_s=self._timeout, setup_timeout_s=self.setup_timeout, hostname=self._addr
        )

    def build_in_background(self, ranks, global_rank: int, gen: int, d: Directive, key: str | None = None) -> tuple:
        """``build`` in a daemon thread: (thread, box); the box gets ``pg`` or ``error``, and
        ``mark``: the sockets open before the build (``connections.Mark``), from which entering
        with it counts what it opened. A build given up before it finished (``_give_up``) is
        released by its own thread when it does: peers that entered that generation must not
        wait on this rank's sockets until the collective timeout."""
        box: dict = {"mark": connections.Mark(), "lock": threading.Lock()}

        def work():
            try:
                pg = self.build(ranks, global_rank, gen, d, key)
            except BaseException as e:  # noqa: BLE001 -- handed to the thread that waits for it
                box["error"] = e
                return
            with box["lock"]:
                if not box.get("given_up"):
                    box["pg"] = pg
                    return
            communicators.release(pg)  # gloo: its connections shut down; NCCL: aborted off this thread

        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        return thread, box

    def build_ahead(self, d: Directive) -> None:
        """Start building generation ``d``'s world communicator now, for a process that has work
        to do before it can enter ``d`` (a promoted spare running the script again for its new
        ranks): its peers' set-up is not kept waiting for that work, and ``enter(d)`` uses it."""
        with self._ahead_lock:
            self._start_ahead(d)

    def build_ahead_as_survivor(self, d: Directive) -> bool:
        """Directive watcher, an unplanned generation ``d`` that keeps this process at its rank:
        start building ``d``'s world communicator now. The main thread learns of the failure only
        when its step reaches a collective (on a CPU, after the step's compute; on a GPU, after
        an aborted NCCL communicator fails its work), and its set-up then found the communicator
        connected instead of connecting it (NCCL's initialisation is the expensive one). Not for a
        generation the main thread already began to enter (it builds its own): each rank builds a
        generation's world once. True when a build was started."""
        if d.stop or d.planned or not d.active or self.state.in_sandbox or d.rank_of(self.local_rank) != self.state.rank:
            return False
        with self._ahead_lock:
            if d.generation <= self._entering or (self._ahead is not None and self._ahead[0] >= d.generation):
                return False
            self._start_ahead(d)
        return True

    def _start_ahead(self, d: Directive) -> None:
        """(Holding ``_ahead_lock``.) The build for ``d`` replaces any other started ahead."""
        self._give_up(self._ahead)
        self._ahead = (d.generation, self.build_in_background(None, d.rank_of(self.local_rank), d.generation, d))

    def take_ahead(self, gen: int | None):
        """The build started ahead for generation ``gen``, if any, for the main thread entering
        it (from now on none is started for ``gen`` or older); one for another generation is given
        up. ``None``: give up any."""
        with self._ahead_lock:
            if gen is not None:
                self._entering = max(self._entering, gen)
            ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == gen:
            return ahead[1]
        self._give_up(ahead)
        return None

    @staticmethod
    def _give_up(ahead) -> None:
        """A build started ahead that nobody will enter: released now if it has finished, else by
        its thread when it finishes (``_build_in_background``) or fails at its own timeout."""
        if ahead is not None:
            box = ahead[1][1]
            with box["lock"]:
                box["given_up"] = True
                pg = box.pop("pg", None)
            communicators.release(pg)

    def build_watching(self, ranks, global_rank: int, gen: int, d: Directive, pending=None, key: str | None = None):
        """``build`` in a thread while this one watches for a newer generation: the setup waits
        for every member, so a member that died would otherwise hold this process for the whole
        setup timeout. An abandoned build is left to fail at its own timeout (a daemon thread).
        ``pending``: a build already started (``_build_in_background``) to wait for instead."""
        pending, box = pending or self.build_in_background(ranks, global_rank, gen, d, key)
        while pending.is_alive():
            pending.join(0.01)
            newer = self.directives.newest_after(gen) if pending.is_alive() else None
            if newer is not None:
                raise Superseded(newer)
        if "error" in box:
            raise box["error"]
        return box["pg"]
