"""The worker's side of the agent protocol (``tm_launch.protocol``): its own agent's local TCPStore.

The agent writes one ``Directive`` per generation and pushes its number onto each local worker's
queue; the worker writes its status, a heartbeat, and what it measured when it entered a
generation. Workers never talk to etcd.

Why a queue: a worker's watch thread blocks in ``queue_pop`` (the store's server answers the
moment the agent pushes, ~0.3 ms here) instead of polling, and the worker can wake its own
thread to end it (``close``), which a wait on a key the agent sets could not. Every other wait
for a directive (a parked spare, a rank after a failed collective) waits on what that thread
heard, and the per-step check reads it from memory.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time

import torch.distributed as dist

from ..protocol import (
    CLOSE,
    LATEST,
    Directive,
    EnteredRecord,
    FirstStepRecord,
    RefusedRecord,
    ScriptErrorRecord,
    StateLostRecord,
    WorkerEnv,
    WorkerKeys,
    WorkerStatus,
    directive_key,
)
from ..waits import Every
from .log import first_line, log

_poke_socket: socket.socket | None = None


def poke(address: str | None) -> None:
    """Wake the agent at ``address`` (its wake socket, ``WorkerEnv.wake``; never blocks, never
    raises: the store write it follows is what counts, this only saves the agent's next tick)."""
    global _poke_socket
    if not address:
        return
    try:
        if _poke_socket is None:
            _poke_socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        _poke_socket.sendto(b"!", socket.MSG_DONTWAIT, f"\0{address}")
    except OSError:
        pass


class AgentClient:
    """One worker's connection to its agent's store, with its heartbeat and directive watch."""

    def __init__(self, env: WorkerEnv):
        host, port = env.agent_store.rsplit(":", 1)
        self.local_rank = env.local_rank
        self.keys = WorkerKeys(env.local_rank)
        self.store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
        self._wake = env.wake
        self._closing = threading.Event()
        self._news = threading.Condition()
        self._heard = -1  # the newest generation the watch thread has heard of
        self._watcher: threading.Thread | None = None
        self._status_lock = threading.Lock()  # one status write at a time: the newest is written last
        self._pending_lock = threading.Lock()
        self._pending_status: str | None = None  # a progress report the heartbeat thread writes next
        self._wakeup = threading.Event()  # the heartbeat thread: a report is pending, or close()
        self._gone = False  # the heartbeat thread's write failed: the agent's store is gone
        beat_store = self.store.clone()  # its own connection: a blocked main thread must not stop it
        self._beat = threading.Thread(target=self._heartbeat, args=(beat_store,), daemon=True)
        self._beat.start()

    def _heartbeat(self, store) -> None:
        """Tell the agent this process is alive, also while the main thread waits in a collective
        (gloo releases the GIL). A stopped or wedged process stops beating: the agent kills it.
        The same thread writes the progress reports handed to it (``report_status``)."""
        beat_at = 0.0
        while not self._closing.is_set():
            try:
                if time.monotonic() - beat_at >= 0.5:
                    store.set(self.keys.beat, f"{time.time():.3f}")
                    beat_at = time.monotonic()
                with self._status_lock:
                    pending = self._take_pending()
                    if pending is not None:
                        store.set(self.keys.status, pending)
            except Exception:
                self._gone = True  # the agent's store: later reports raise, as a write of their own would
                return
            self._wakeup.wait(max(0.0, 0.5 - (time.monotonic() - beat_at)))  # close() ends the wait at once
            self._wakeup.clear()

    def _take_pending(self) -> str | None:
        with self._pending_lock:
            pending, self._pending_status = self._pending_status, None
        return pending

    def close(self) -> None:
        """End the threads: the watcher is woken by a close of its own on its queue (a stale one,
        left by an earlier process of this local rank, names another pid and is ignored)."""
        self._closing.set()
        self._wakeup.set()
        if self._watcher is not None:
            try:
                self.store.queue_push(self.keys.directives, f"{CLOSE} {os.getpid()}")
            except Exception:  # noqa: BLE001 -- the agent is gone, and with it the thread's wait
                pass
            self._watcher.join(timeout=2)
        self._beat.join(timeout=2)

    def watch(self, on_directive) -> None:
        """Call ``on_directive(d)`` from a background thread for the generation the agent handed
        over last and then for every newer one, the moment it is pushed: a rank blocked in a
        commit vote or a collective is told that a peer is gone without polling anything."""
        store = self.store.clone()  # its own connection: it blocks in queue_pop
        store.set_timeout(datetime.timedelta(hours=1))  # the agent's death ends the wait at once
        queue, mine = self.keys.directives, f"{CLOSE} {os.getpid()}"

        def hear(latest: int) -> None:
            if latest <= self._heard or not store.check([directive_key(latest)]):
                return
            with self._news:
                self._heard = latest
                self._news.notify_all()
            try:
                on_directive(Directive.from_json(store.get(directive_key(latest))))
            except Exception as e:  # noqa: BLE001 -- the watcher must live on
                log.info(f"acting on generation {latest} failed: {first_line(e)}")

        def run():
            try:
                hear(store.add(LATEST, 0))
                while not self._closing.is_set():
                    try:
                        item = store.queue_pop(queue).decode()
                    except dist.DistStoreError as e:
                        if "timeout" in str(e):  # the hour passed with nothing handed over
                            continue
                        raise
                    if item == mine:
                        return
                    if not item.startswith(f"{CLOSE} "):
                        hear(store.add(LATEST, 0))  # the newest, also when several were pushed
            except Exception:  # noqa: BLE001 -- the agent is gone: PR_SET_PDEATHSIG ends this process
                return
            finally:
                with self._news:
                    self._news.notify_all()

        self._watcher = threading.Thread(target=run, daemon=True, name="tm-generation-watch")
        self._watcher.start()

    # -- what the worker reports (``wake``: the agent acts on it now, not at its next tick) -----
    def _put(self, key: str, value: str, wake: bool) -> None:
        self.store.set(key, value)
        if wake:
            poke(self._wake)

    def report_status(self, status: WorkerStatus, wake: bool = False, now: bool | None = None) -> None:
        """Write this worker's status. ``now`` (default: ``wake``, the agent acts on it): on this
        thread, before returning (a state change, a worker's end). Otherwise a progress report,
        handed to the heartbeat thread, which writes the newest one it has: the main thread never
        waits for the agent's process to be scheduled to answer (several ms on a busy machine,
        every ``STATUS_INTERVAL``), and a report written now is never overwritten by an older one."""
        value = status.to_json()
        if now if now is not None else wake:
            with self._status_lock:
                self._take_pending()  # older than this one
                self._put(self.keys.status, value, wake)
            return
        if self._gone:
            raise ConnectionError("tm-launch: the agent's store is gone (its heartbeat could not be written)")
        with self._pending_lock:
            self._pending_status = value
        self._wakeup.set()

    def mark_live(self) -> None:
        """This worker runs ``job.steps()``: the agent repairs the job in place from now on."""
        self._put(self.keys.live, "1", wake=True)

    def report_entered(self, generation: int, record: EnteredRecord) -> None:
        self._put(self.keys.entered(generation), record.to_json(), wake=False)

    def report_first_step(self, generation: int, record: FirstStepRecord) -> None:
        self._put(self.keys.first_step(generation), record.to_json(), wake=True)

    def report_state_lost(self, record: StateLostRecord) -> None:
        self._put(self.keys.state_lost, record.to_json(), wake=True)

    def report_refused(self, record: RefusedRecord) -> None:
        self._put(self.keys.refused, record.to_json(), wake=True)

    def report_script_error(self, record: ScriptErrorRecord) -> None:
        self._put(self.keys.script_error, record.to_json(), wake=True)

    # -- what the agent handed over ------------------------------------------------------------
    def latest(self) -> int:
        return self.store.add(LATEST, 0)

    def newer_than(self, generation: int) -> bool:
        """The per-step check: what the watch thread heard, no round trip (``watch`` first)."""
        return self._heard > generation

    def has_directive(self, generation: int) -> bool:
        return self.store.check([directive_key(generation)])

    def directive(self, generation: int) -> Directive:
        return Directive.from_json(self.store.get(directive_key(generation)))

    def wait_directive(self, after: int, repeat: bool = True) -> Directive:
        """Block until the agent hands over a generation newer than ``after`` (``watch`` first);
        say so every few seconds (once only with ``repeat=False``: a parked spare waits by
        design)."""
        if self._watcher is None:
            raise RuntimeError("AgentClient.wait_directive needs watch() first: the watch thread hears the agent")
        ticker, said = Every(), False
        while True:
            latest = self.latest()  # the store is written before the push: never behind the thread
            if latest > after:
                return self.directive(latest)
            if ticker.due() and (repeat or not said):
                log.info(f"waiting for generation > {after} from the agent ({ticker.elapsed:.0f} s so far)")
                said = True
            if not self._watcher.is_alive():  # it ends only with the agent (whose store then fails first) or close()
                raise RuntimeError(f"tm-launch: waiting for generation > {after}, but the watch of the agent's directives has ended")
            with self._news:
                self._news.wait_for(lambda: self._heard > latest or not self._watcher.is_alive(), timeout=1.0)
