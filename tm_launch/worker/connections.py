"""This process's TCP connections (Linux ``/proc``): how many it opened across a span of its
life, which ones it holds, and closing those whose other end belongs to a process that is gone.

**Counted.**
A substitution should connect only what changed (``tm_launch.worker.communicators``: gloo
pairs on first use); this is how a worker counts what it actually opened while entering a
generation, so that the count is reported per change (``EnteredRecord.tcp_opened``) and tested,
not only inferred from timings. It counts every TCP connection the process opened in the span
(gloo pairs, plus any store or snapshot connection a change had to open): sockets that are new
since ``Mark`` and connected now. Listening sockets (one gloo device per group) are not
connections and are not counted, nor are connections accepted by a listener that was already
open at ``Mark``: those belong to an older group another process is still using (a dying
worker's last collective of the old generation connecting to a survivor's old world group
counted one more, now and then). Elsewhere than Linux the count is None.

**Named, and closed when their peer is gone.** A worker's connections are named by their two
endpoints (``"local>remote"``, ``tcp_connections``). A lost worker's agent passes on those its
worker last reported (``ConnectionsRecord``), and each survivor shuts down its own end of each
one (``shut_mirrored``): its end is the same connection seen from the other side. Why: a gloo
collective waiting on a dead peer ends only when that peer's sockets close, and they close at
the very end of the peer's exit, once the kernel has freed its memory (tens of milliseconds for
a small process, seconds for one holding tens of GiB; never while a child process it forked
still holds them). gloo offers no way to end the wait; a shut-down socket ends it at once, with
the error a closed peer gives. Only connections that match exactly are touched.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterable

_FD_DIR = "/proc/self/fd"


def open_sockets() -> dict[int, int] | None:
    """inode -> file descriptor of this process's open sockets, or None where ``/proc`` is not
    there (an inode identifies a socket across the span: a descriptor number is reused)."""
    try:
        fds = os.listdir(_FD_DIR)
    except OSError:
        return None
    found = {}
    for fd in fds:
        try:
            target = os.readlink(f"{_FD_DIR}/{fd}")
        except OSError:  # closed since the listing
            continue
        if target.startswith("socket:["):
            found[int(target[8:-1])] = int(fd)
    return found


def _address(sockaddr) -> str:
    """``host:port`` of a socket address; an IPv4 address mapped into IPv6 (a dual-stack
    listener's peer) is written as IPv4, as the other side sees it."""
    host, port = sockaddr[0], sockaddr[1]
    if host.startswith("::ffff:") and "." in host:
        host = host[7:]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def mirrored(connection: str) -> str:
    """The same connection named from its other end: ``"a>b"`` is ``"b>a"``."""
    local, _, remote = connection.partition(">")
    return f"{remote}>{local}"


@contextlib.contextmanager
def _tcp_socket(fd: int):
    """``fd`` as a socket object (a duplicate, closed on exit) when it is a TCP socket (IPv4 or
    IPv6; not UDP or a Unix socket), else None. Asked of the socket itself: reading the kernel's
    TCP table (``/proc/net/tcp``) took 8 ms with a few hundred sockets on the machine, too long
    for a recovery's path."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:  # closed since it was listed, or not a socket
        yield None
        return
    try:
        yield sock if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM else None
    finally:
        sock.close()


def _name(sock: socket.socket) -> str | None:
    """``"local>remote"`` of a TCP socket; None when it is not connected (a listener) or closed."""
    try:
        return f"{_address(sock.getsockname())}>{_address(sock.getpeername())}"
    except OSError:
        return None


def tcp_connections(sockets: dict[int, int] | None = None) -> tuple[str, ...]:
    """This process's connected TCP sockets, each as ``"local>remote"`` (sorted); ``sockets``:
    ``open_sockets()``'s answer, when the caller has it already. Empty where ``/proc`` is not there."""
    names = []
    for fd in (open_sockets() if sockets is None else sockets or {}).values():
        with _tcp_socket(fd) as sock:
            name = _name(sock) if sock is not None else None
        if name is not None:
            names.append(name)
    return tuple(sorted(names))


def shut_mirrored(lost: Iterable[str]) -> int:
    """Shut down this process's end of every connection in ``lost`` (named from the other end,
    a process that is gone): a thread blocked on one (a gloo collective) gets the error a
    closed peer gives, now. The descriptors stay open for their owner to close. Returns how
    many were shut down."""
    wanted = {mirrored(c) for c in lost}
    shut = 0
    for fd in (open_sockets() or {}).values() if wanted else ():
        with _tcp_socket(fd) as sock:
            if sock is None or _name(sock) not in wanted:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)  # the socket itself, whichever descriptor names it
                shut += 1
            except OSError:  # closed meanwhile
                pass
    return shut


class ConnectionList:
    """``tcp_connections`` listed again only when the set of open sockets changed (a directory
    listing per call otherwise: the heartbeat thread asks every half second)."""

    def __init__(self):
        self._sockets: frozenset | None = None

    def changed(self) -> tuple[str, ...] | None:
        """The connections now, if the sockets changed since the last call; else None."""
        sockets = open_sockets()
        if sockets is None or frozenset(sockets) == self._sockets:
            return None
        self._sockets = frozenset(sockets)
        return tcp_connections(sockets)


def tcp_endpoint(fd: int) -> tuple[int, bool] | None:
    """(local port, connected) of ``fd`` when it is a TCP socket, else None."""
    with _tcp_socket(fd) as sock:
        if sock is None:
            return None
        try:
            port = sock.getsockname()[1]
        except OSError:  # no longer open
            return None
        return port, _name(sock) is not None


class Mark:
    """The sockets open at one moment; ``opened()``: TCP connections opened since then and
    still open, not counting those accepted by a listener open at the mark (None where it
    cannot be known)."""

    def __init__(self):
        before = open_sockets()
        self.before = None if before is None else set(before)
        self.listening = set()
        for fd in (before or {}).values():
            endpoint = tcp_endpoint(fd)
            if endpoint is not None and not endpoint[1]:
                self.listening.add(endpoint[0])

    def opened(self) -> int | None:
        now = open_sockets()
        if self.before is None or now is None:
            return None
        endpoints = (tcp_endpoint(fd) for inode, fd in now.items() if inode not in self.before)
        return sum(1 for e in endpoints if e is not None and e[1] and e[0] not in self.listening)
