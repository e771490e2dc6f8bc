"""What wakes the agent's loop: every source of news sets one event, the moment it happens.

The loop used to learn of a dead worker or a worker's report at its next tick (up to
``--monitor-interval``, 0.1 s), and of an etcd change from a watch it blocked on itself, which
nothing else could interrupt. Now each source has a thread that blocks on its own event and
sets ``Wakeup``; the loop waits on that alone (the tick stays as the upper bound for time-based
rules):

- ``watch_exit``: a worker process ended (``waitid(WNOWAIT)`` in a thread per worker: it sees
  the exit at once and leaves the reaping to ``Popen``);
- ``WakeSocket``: a worker wrote something the agent must act on now (it entered a generation,
  finished its first step, saw a collective fail, lost the state): a datagram on an abstract
  Unix socket, sent by the worker's ``agent_client.poke`` right after the store write (the
  socket's address reaches workers as ``WorkerEnv.wake``);
- ``StateWatch``: an etcd watch stream kept open in a thread, compared with the revision of
  the agent's last read;
- ``tm_launch.launcher.peer_link.PeerLink``: the connection to the next active node's agent ended.
"""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator

from rendezvous.kv import WatchNews

from .etcd_retry import MAX_S, retry_delay


class Wakeup:
    """One event the agent waits on, with the names of what set it since the last wait."""

    def __init__(self):
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._reasons: set[str] = set()

    def set(self, reason: str) -> None:
        with self._lock:
            self._reasons.add(reason)
            self._event.set()

    def wait(self, timeout: float) -> set[str]:
        """Block until something happened or ``timeout``; what happened (empty on timeout)."""
        self._event.wait(timeout)
        with self._lock:
            reasons, self._reasons = self._reasons, set()
            self._event.clear()
        return reasons


def watch_exit(pid: int, on_exit: Callable[[], None]) -> None:
    """Call ``on_exit`` from a thread as soon as child ``pid`` ends (it stays a zombie for its
    ``Popen`` to reap: ``WNOWAIT``)."""

    def run():
        try:
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            pass  # already reaped by its Popen: the loop knows
        on_exit()

    threading.Thread(target=run, daemon=True, name=f"tm-exit-{pid}").start()


class WakeSocket:
    """An abstract Unix datagram socket (no file to clean up, private to the network
    namespace) whose every datagram wakes the agent."""

    def __init__(self, wakeup: Wakeup):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(f"\0tm-launch-wake-{os.getpid()}-{os.urandom(6).hex()}")
        self.address = self._sock.getsockname()[1:].decode()  # without the leading NUL: env-safe
        self._wakeup = wakeup
        self._closed = False
        threading.Thread(target=self._run, daemon=True, name="tm-wake-socket").start()

    def _run(self) -> None:
        while not self._closed:
            try:
                self._sock.recv(64)
            except OSError:
                return  # closed
            if not self._closed:  # a shut-down socket returns at once, empty
                self._wakeup.set("worker")

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


class StateWatch:
    """Keeps an etcd watch stream open per scope, in a thread, and wakes the loop on a change.

    ``arm(scope, open_stream, revision)`` after every read of etcd (``revision``: the read's):
    ``open_stream()`` gives ``KV.watch_stream`` for the scope (``Membership.watch`` for
    ``state/``, ``watch_plan`` for the plan only). The stream for a scope is opened on its
    first arm and kept: an open stream reports each change within milliseconds, where a watch
    opened anew from the loop's last read lagged up to 100 ms (see ``EtcdV3.watch_stream``).
    The loop is woken when a change newer than its read arrives, or at once when one already
    did, or when the stream started after the read (what happened in between is unknown: the
    loop reads again). A stream whose scope is no longer armed ends at its next message; an
    ended stream is reopened; an error wakes the loop, whose next read meets it and backs off."""

    WIDEST = "state"

    def __init__(self, wakeup: Wakeup, retry_s: float = MAX_S):
        self._wakeup = wakeup
        self._retry_s = retry_s
        self._lock = threading.Lock()
        self._wanted: tuple[str, int] | None = None  # (scope, revision of the loop's last read)
        self._known: dict[str, tuple[int, int]] = {}  # scope -> (stream created at, newest change seen)
        self._streams: set[str] = set()  # scopes with a thread
        self._closed = False

    def arm(self, scope: str, open_stream: Callable[[], Iterator[WatchNews]], revision: int) -> None:
        with self._lock:
            self._wanted = (scope, revision)
            if scope not in self._streams:
                self._streams.add(scope)
                threading.Thread(target=self._follow, args=(scope, open_stream), daemon=True, name=f"tm-etcd-watch-{scope}").start()
                return
            created, newest = self._known.get(scope, (0, 0))
            news = created > revision or newest > revision
        if news:
            self._wakeup.set("etcd")

    def close(self) -> None:
        with self._lock:
            self._closed = True

    def _wanted_revision(self, scope: str) -> int | None:
        """The revision of the loop's read while ``scope`` is armed; None once it is not."""
        wanted = self._wanted
        return wanted[1] if wanted is not None and wanted[0] == scope and not self._closed else None

    def _follow(self, scope: str, open_stream) -> None:
        failed = 0  # reopenings in a row that failed
        while True:
            try:
                for kind, revision, _ in open_stream():
                    failed = 0
                    with self._lock:
                        wanted = self._wanted_revision(scope)
                        if wanted is None:
                            return self._end(scope)
                        created, newest = self._known.get(scope, (0, 0))
                        if kind == "created":
                            created = revision
                        else:
                            newest = max(newest, revision)
                        self._known[scope] = (created, newest)
                    if revision > wanted:
                        self._wakeup.set("etcd")
            except Exception:  # etcd unreachable, or anything else: the loop's own read says what
                self._wakeup.set("etcd")
                failed += 1  # reopened under the agent's retry policy: soon after a blip, once a second in an outage
                time.sleep(retry_delay(failed, ttl=3 * self._retry_s, jitter=random.random()))
            with self._lock:
                if self._wanted_revision(scope) is None:
                    return self._end(scope)

    def _end(self, scope: str) -> None:
        """Under the lock, in the same hold as the decision: an ``arm`` right after must start
        a new stream, not count on this one."""
        self._streams.discard(scope)
        self._known.pop(scope, None)
