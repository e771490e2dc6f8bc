"""A connection kept open to one peer agent, so that a node that dies is known when it dies.

A node whose agent is SIGKILLed (its workers die with it, by PDEATHSIG) was found when a
survivor's collective failed: up to a whole step later when the survivor was computing. The
kernel closes the dead agent's sockets at once, though, so an agent holding a connection to the
peer's port sees the end of the stream within microseconds.

Every active node watches one other: its successor in the plan's node order (``successor``, a
ring). That is one connection per node whatever the job's size, and every active node is
watched by exactly one peer. The end of the stream is only a hint that wakes the agent's loop:
the agent reads etcd again and probes that peer (``FailureWatch.report_dead_peers``: a refused
connection, checked against the peer's record read now). A peer that left the plan, finished,
or only closed this connection is never reported; one whose agent still answers is watched
again a second later (``PeerLink.answered``). A machine that vanishes without closing
anything (power loss) is still found by its lease.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

REWATCH_AFTER = 1.0  # seconds before a peer whose link ended but whose agent answered is watched again


def successor(nodes, me: str) -> str | None:
    """The node ``me`` watches: the next one after it in ``nodes`` (the plan's order), wrapping
    round; None when ``me`` is not among them or is alone."""
    nodes = list(nodes)
    if me not in nodes or len(nodes) < 2:
        return None
    return nodes[(nodes.index(me) + 1) % len(nodes)]


def probe_targets(nodes, me: str) -> list[str]:
    """The peers ``me`` probes when a local collective fails or a commit vote waits long
    (``FailureWatch.report_dead_peers``): those at ring distances 1, 2, 4, 8, ... after it in
    ``nodes`` (the plan's order). A node makes about log2(N) connections per probe, and every
    node is probed by as many peers, so a dead node is found even when its nearest predecessors
    died with it. Probing every peer cost each node N - 1 connections: N^2 across the job for
    one failure (a million at 1,024 nodes), every survivor's agent accepting N - 1 at once, in
    the milliseconds the new plan is being made."""
    nodes = list(nodes)
    if me not in nodes:
        return []
    at, n = nodes.index(me), len(nodes)
    targets, distance = [], 1
    while distance < n:
        targets.append(nodes[(at + distance) % n])
        distance *= 2
    return targets


def _family(addr: str) -> int:
    """The address family ``addr`` resolves to, as the probe's ``create_connection`` would use it
    (a host name may resolve to IPv6 only); IPv4 when it does not resolve (the connect then
    fails, and the probe decides)."""
    try:
        return socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)[0][0]
    except OSError:
        return socket.AF_INET


class PeerLink:
    """The kept-open connection to one peer's agent port; ``wake()`` when it ends."""

    def __init__(self, wake: Callable[[], None]):
        self._wake = wake
        self._lock = threading.Lock()
        self._target: tuple | None = None  # (node, addr, port)
        self._sock: socket.socket | None = None
        self._dropped: str | None = None  # the peer whose connection ended, until taken
        self._ended: tuple | None = None  # (generation, node): not connected to again in that generation
        self._rewatch_at: float | None = None  # monotonic time after which the ended peer is watched again

    def watch(self, target: tuple | None, generation: int) -> None:
        """Keep a connection to ``target`` (node, addr, port), or to nobody (None). A peer whose
        connection ended is not connected to again in the same generation: the probe decides
        about it, and a new plan picks the peer anew (a dead peer's refusals would spin)."""
        if target is not None and (generation, target[0]) == self._ended:
            if self._rewatch_at is None or time.monotonic() < self._rewatch_at:
                target = None
            else:
                self._ended = self._rewatch_at = None
        if target == self._target:
            return
        family = _family(target[1]) if target is not None else None  # resolved once per new target
        with self._lock:
            self._close_locked()
            self._target = target
            if target is None:
                return
            sock = socket.socket(family, socket.SOCK_STREAM)
            self._sock = sock
        threading.Thread(target=self._run, args=(sock, target, generation), daemon=True, name=f"tm-peer-{target[0]}").start()

    def _run(self, sock: socket.socket, target: tuple, generation: int) -> None:
        node, addr, port = target
        try:
            sock.settimeout(2.0)
            sock.connect((addr, port))
            sock.settimeout(None)
            while sock.recv(4096):  # the peer's store sends nothing unasked: this returns at its end
                pass
        except OSError:
            pass  # refused, reset, or closed by watch()/close(): the same question for the probe
        with self._lock:
            if self._sock is not sock:
                return  # this connection was given up on purpose
            self._sock, self._target = None, None
            self._dropped, self._ended, self._rewatch_at = node, (generation, node), None
        sock.close()
        self._wake()

    def answered(self, node: str) -> None:
        """The probe found ``node``'s agent answering after its link ended (the link broke, the
        peer did not die): watch it again from ``REWATCH_AFTER`` seconds on, instead of leaving
        it to its lease for the rest of the generation. A peer that answers and then closes
        every link costs one reconnection per ``REWATCH_AFTER``, not a spin."""
        with self._lock:
            if self._ended is not None and self._ended[1] == node:
                self._rewatch_at = time.monotonic() + REWATCH_AFTER

    def take_dropped(self) -> str | None:
        """The peer whose connection ended since the last call (None: none)."""
        with self._lock:
            node, self._dropped = self._dropped, None
        return node

    def close(self) -> None:
        with self._lock:
            self._close_locked()
            self._target = None

    def _close_locked(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # ends the thread's recv
            except OSError:
                pass
            sock.close()


ETCD_CONTACT = "agent/etcd_contact"  # in each agent's own store: when etcd last answered it (wall time)


def last_etcd_contacts(peers: list[tuple[str, int]], timeout: float = 0.5) -> list[float | None]:
    """When etcd last answered each of ``peers`` (agent address, store port), read from the
    peer's own store (``ETCD_CONTACT``, which every agent keeps current); None for a peer that
    does not answer within ``timeout`` (asked in parallel). Used only when this node is about to
    fence itself for etcd's silence (``fencing.peers_cut_off``)."""
    import datetime

    import torch.distributed as dist

    answers: list[float | None] = [None] * len(peers)

    def ask(i: int, addr: str, port: int) -> None:
        try:
            store = dist.TCPStore(addr, port, None, False, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
            if store.check([ETCD_CONTACT]):
                answers[i] = float(store.get(ETCD_CONTACT))
        except Exception:  # refused, timed out, a value not a number: no answer
            pass

    threads = [threading.Thread(target=ask, args=(i, a, p), daemon=True) for i, (a, p) in enumerate(peers)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 2 * timeout
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0))
    return list(answers)
