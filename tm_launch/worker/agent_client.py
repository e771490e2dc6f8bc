"""A live worker's only link to the outside: its own agent's local TCPStore.

The agent writes one *directive* per generation (``node/plan/<gen>``, the newest number in
``node/latest``) and pushes that number onto each local worker's queue (``directives_queue``).
The worker writes its status, a heartbeat, and what it measured when it entered a generation.
Workers never talk to etcd.

Why a queue: a worker's watch thread blocks in ``queue_pop`` (the store's server answers the
moment the agent pushes, ~0.3 ms here) instead of polling, and the worker can wake its own
thread to end it (``close``), which a wait on a key the agent sets could not. Every other wait
for a directive (a parked spare, a rank after a failed collective) waits on what that thread
heard, and the per-step check reads it from memory.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time

import torch.distributed as dist

from ..launcher.wakeup import WAKE_ENV, poke  # TEMP


def log(msg: str) -> None:
    print(f"[tm-launch worker {os.environ.get('RANK', '?')}] {msg}", file=sys.stderr, flush=True)


def directives_queue(local_rank: int) -> str:
    """The store queue the agent pushes every newer generation's number onto, for one worker."""
    return f"worker/{local_rank}/directives"


def first_line(error: BaseException, limit: int = 160) -> str:
    """An error in one log line: its message's first line (its type when the message is empty)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:limit]


class AgentClient:
    def __init__(self, env=os.environ):
        host, port = env["TM_AGENT_STORE"].rsplit(":", 1)
        self.local_rank = int(env["LOCAL_RANK"])
        self.store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
        self._wake = env.get(WAKE_ENV)
        self._closing = threading.Event()
        self._news = threading.Condition()
        self._heard = -1  # the newest generation the watch thread has heard of
        self._watcher: threading.Thread | None = None
        beat_store = self.store.clone()  # its own connection: a blocked main thread must not stop it
        self._beat = threading.Thread(target=self._heartbeat, args=(beat_store,), daemon=True)
        self._beat.start()

    def _heartbeat(self, store) -> None:
        """Tell the agent this process is alive, also while the main thread waits in a collective
        (gloo releases the GIL). A stopped or wedged process stops beating: the agent kills it."""
        key = f"worker/{self.local_rank}/beat"
        while not self._closing.is_set():
            try:
                store.set(key, f"{time.time():.3f}")
            except Exception:
                return
            self._closing.wait(0.5)  # close() ends the wait at once: a worker's exit waits for no beat

    def close(self) -> None:
        """End the threads: the watcher is woken by a close of its own on its queue (a stale one,
        left by an earlier process of this local rank, names another pid and is ignored)."""
        self._closing.set()
        if self._watcher is not None:
            try:
                self.store.queue_push(directives_queue(self.local_rank), f"close {os.getpid()}")
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
        queue, mine = directives_queue(self.local_rank), f"close {os.getpid()}"

        def hear(latest: int) -> None:
            if latest <= self._heard or not store.check([f"node/plan/{latest}"]):
                return
            with self._news:
                self._heard = latest
                self._news.notify_all()
            try:
                on_directive(json.loads(store.get(f"node/plan/{latest}")))
            except Exception as e:  # noqa: BLE001 -- the watcher must live on
                log(f"acting on generation {latest} failed: {first_line(e)}")

        def run():
            try:
                hear(store.add("node/latest", 0))
                while not self._closing.is_set():
                    try:
                        item = store.queue_pop(queue).decode()
                    except dist.DistStoreError as e:
                        if "timeout" in str(e):  # the hour passed with nothing handed over
                            continue
                        raise
                    if item == mine:
                        return
                    if not item.startswith("close "):
                        hear(store.add("node/latest", 0))  # the newest, also when several were pushed
            except Exception:  # noqa: BLE001 -- the agent is gone: PR_SET_PDEATHSIG ends this process
                return
            finally:
                with self._news:
                    self._news.notify_all()

        self._watcher = threading.Thread(target=run, daemon=True, name="tm-generation-watch")
        self._watcher.start()

    def set(self, what: str, value, wake: bool = False) -> None:
        """``worker/<local rank>/<what>``: status, live, entered/<gen>, ... ``wake``: the agent
        acts on this report (a generation entered, a collective failed): wake its loop now
        rather than at its next tick."""
        self.store.set(f"worker/{self.local_rank}/{what}", value if isinstance(value, str) else json.dumps(value))
        if wake:
            poke(self._wake)

    def latest(self) -> int:
        return self.store.add("node/latest", 0)

    def newer_than(self, generation: int) -> bool:
        """The per-step check: what the watch thread heard, no round trip (``watch`` first)."""
        return self._heard > generation

    def directive(self, generation: int) -> dict:
        return json.loads(self.store.get(f"node/plan/{generation}"))

    def wait_directive(self, after: int, repeat: bool = True) -> dict:
        """Block until the agent hands over a generation newer than ``after`` (``watch`` first);
        say so every few seconds (once only with ``repeat=False``: a parked spare waits by
        design)."""
        from ..waits import Every

        if self._watcher is None:
            raise RuntimeError("AgentClient.wait_directive needs watch() first: the watch thread hears the agent")
        ticker, said = Every(), False
        while True:
            latest = self.latest()  # the store is written before the push: never behind the thread
            if latest > after:
                return self.directive(latest)
            if ticker.due() and (repeat or not said):
                log(f"waiting for generation > {after} from the agent ({ticker.elapsed:.0f} s so far)")
                said = True
            if not self._watcher.is_alive():  # it ends only with the agent (whose store then fails first) or close()
                raise RuntimeError(f"tm-launch: waiting for generation > {after}, but the watch of the agent's directives has ended")
            with self._news:
                self._news.wait_for(lambda: self._heard > latest or not self._watcher.is_alive(), timeout=1.0)
