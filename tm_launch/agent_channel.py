"""A live worker's only link to the outside: its own agent's local TCPStore.

The agent writes one *directive* per generation (``node/plan/<gen>``, the newest number in
``node/latest``, and a line appended to ``TM_LATEST_FILE`` so that the per-step check is a
``stat``, not a round trip). The worker writes its status, a heartbeat, and what it measured when
it entered a generation. Workers never talk to etcd.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time

import torch.distributed as dist

from .wakeup import WAKE_ENV, poke


def log(msg: str) -> None:
    print(f"[tm-launch worker {os.environ.get('RANK', '?')}] {msg}", file=sys.stderr, flush=True)


def first_line(error: BaseException, limit: int = 160) -> str:
    """An error in one log line: its message's first line (its type when the message is empty)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:limit]


class AgentChannel:
    def __init__(self, env=os.environ):
        host, port = env["TM_AGENT_STORE"].rsplit(":", 1)
        self.local_rank = int(env["LOCAL_RANK"])
        self.store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
        self._latest_file = env.get("TM_LATEST_FILE")
        self._wake = env.get(WAKE_ENV)
        self._latest_size = -2  # forces the first check through the store
        self._closing = False
        beat_store = self.store.clone()  # its own connection: a blocked main thread must not stop it
        self._beat = threading.Thread(target=self._heartbeat, args=(beat_store,), daemon=True)
        self._beat.start()

    def _heartbeat(self, store) -> None:
        """Tell the agent this process is alive, also while the main thread waits in a collective
        (gloo releases the GIL). A stopped or wedged process stops beating: the agent kills it."""
        key = f"worker/{self.local_rank}/beat"
        while not self._closing:
            try:
                store.set(key, f"{time.time():.3f}")
            except Exception:
                return
            time.sleep(0.5)

    def close(self) -> None:
        self._closing = True
        self._beat.join(timeout=2)

    def watch(self, on_directive) -> None:
        """Call ``on_directive(d)`` from a background thread for every generation the agent hands
        over, within a few milliseconds: a rank blocked in a commit vote or a collective is told
        that a peer is gone without polling anything remote (a local ``stat`` every 5 ms)."""
        store = self.store.clone()

        def run():
            seen, size = -1, -1
            while not self._closing:
                time.sleep(0.005)
                try:
                    now = os.stat(self._latest_file).st_size if self._latest_file else -1
                except OSError:
                    continue
                if now == size:
                    continue
                size = now
                try:
                    latest = store.add("node/latest", 0)
                    if latest > seen:
                        seen = latest
                        on_directive(json.loads(store.get(f"node/plan/{latest}")))
                except Exception:  # the agent is gone: PR_SET_PDEATHSIG ends this process
                    return

        threading.Thread(target=run, daemon=True, name="tm-generation-watch").start()

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
        """Cheap per-step check: the agent appends a line to a file for every generation."""
        try:
            size = os.stat(self._latest_file).st_size if self._latest_file else -1
        except OSError:
            size = -1
        if size == self._latest_size and size >= 0:
            return False
        self._latest_size = size
        return self.latest() > generation

    def directive(self, generation: int) -> dict:
        return json.loads(self.store.get(f"node/plan/{generation}"))

    def wait_directive(self, after: int, repeat: bool = True) -> dict:
        """Block until the agent hands over a generation newer than ``after``; say so every few
        seconds (once only with ``repeat=False``: a parked spare waits by design)."""
        from .waits import Every

        ticker, said = Every(), False
        while True:
            latest = self.latest()
            if latest > after:
                return self.directive(latest)
            if ticker.due() and (repeat or not said):
                log(f"waiting for generation > {after} from the agent ({ticker.elapsed:.0f} s so far)")
                said = True
            time.sleep(0.005)
