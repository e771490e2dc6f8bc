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

import ctypes
import os
import socket
import sys
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


_libc = ctypes.CDLL(None, use_errno=True)


def _endpoint(call, fd: int) -> tuple[str, int] | None:
    """(host, port) that ``getsockname``/``getpeername`` (``call``) gives for ``fd`` when it is an
    IPv4 or IPv6 socket; None otherwise (not connected, closed, another family)."""
    buf, size = ctypes.create_string_buffer(128), ctypes.c_uint32(128)
    if call(fd, buf, ctypes.byref(size)) != 0:
        return None
    family = int.from_bytes(buf.raw[:2], sys.byteorder)
    port = int.from_bytes(buf.raw[2:4], "big")
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, buf.raw[4:8]), port
    if family == socket.AF_INET6:
        return socket.inet_ntop(socket.AF_INET6, buf.raw[8:24]), port
    return None


def _is_tcp(fd: int) -> bool:
    kind, size = ctypes.c_int(0), ctypes.c_uint32(ctypes.sizeof(ctypes.c_int))
    return (
        _libc.getsockopt(fd, socket.SOL_SOCKET, socket.SO_TYPE, ctypes.byref(kind), ctypes.byref(size)) == 0
        and kind.value == socket.SOCK_STREAM
    )


def _name(fd: int) -> str | None:
    """``"local>remote"`` of ``fd`` when it is a connected TCP socket (IPv4 or IPv6), else None.

    Asked of the descriptor itself through libc, not through a Python socket object: building
    one sets the descriptor non-blocking when a script set ``socket.setdefaulttimeout``, and the
    flag is shared with gloo's and the stores' own use of the socket. (Reading the kernel's TCP
    table, ``/proc/net/tcp``, took 8 ms with a few hundred sockets: too long for a recovery.)"""
    local = _endpoint(_libc.getsockname, fd)
    if local is None or not _is_tcp(fd):
        return None
    remote = _endpoint(_libc.getpeername, fd)
    return None if remote is None else f"{_address(local)}>{_address(remote)}"


def tcp_connections(sockets: dict[int, int] | None = None) -> tuple[str, ...]:
    """This process's connected TCP sockets, each as ``"local>remote"`` (sorted); ``sockets``:
    ``open_sockets()``'s answer, when the caller has it already. Empty where ``/proc`` is not there."""
    names = (_name(fd) for fd in (open_sockets() if sockets is None else sockets or {}).values())
    return tuple(sorted(n for n in names if n is not None))


def shut_mirrored(lost: Iterable[str]) -> int:
    """Shut down this process's end of every connection in ``lost`` (named from the other end,
    a process that is gone): a thread blocked on one (a gloo collective) gets the error a
    closed peer gives, now. The descriptors stay open for their owner to close. Returns how
    many were shut down."""
    wanted = {mirrored(c) for c in lost}
    shut = 0
    for fd in (open_sockets() or {}).values() if wanted else ():
        if _name(fd) in wanted and _libc.shutdown(fd, socket.SHUT_RDWR) == 0:
            shut += 1
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
    local = _endpoint(_libc.getsockname, fd)
    if local is None or not _is_tcp(fd):
        return None
    return local[1], _endpoint(_libc.getpeername, fd) is not None


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
