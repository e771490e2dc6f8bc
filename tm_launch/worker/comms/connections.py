"""This process's TCP connections (Linux ``/proc``): how many it opened across a span of its
life, which ones it opened (``Mark.new_sockets``: how a gloo communicator learns its own,
``communicators``), and shutting one down (``shut_down``: how it is given up).

How a worker counts what it actually opened while entering a generation (its world group's
full mesh, ``tm_launch.worker.comms.communicators``, and whatever else the change needed), so that
the count is reported per change (``EnteredRecord.tcp_opened``) and tested, not only inferred
from timings. It counts every TCP connection the process opened in the span
(gloo pairs, plus any store or snapshot connection a change had to open): sockets that are new
since ``Mark`` and connected now. Listening sockets (one gloo device per group) are not
connections and are not counted, nor are connections accepted by a listener that was already
open at ``Mark``: those belong to an older group another process is still using (a dying
worker's last collective of the old generation connecting to a survivor's old world group
counted one more, now and then). Elsewhere than Linux the count is None.
"""

from __future__ import annotations

import ctypes
import os
import socket
import sys

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
        return _unmapped(socket.inet_ntop(socket.AF_INET6, buf.raw[8:24])), port
    return None


def _unmapped(host: str) -> str:
    """An IPv4 address mapped into IPv6 (a dual-stack socket's) written as IPv4, as the other
    side sees it."""
    return host[7:] if host.startswith("::ffff:") and "." in host else host


def _is_tcp(fd: int) -> bool:
    kind, size = ctypes.c_int(0), ctypes.c_uint32(ctypes.sizeof(ctypes.c_int))
    return (
        _libc.getsockopt(fd, socket.SOL_SOCKET, socket.SO_TYPE, ctypes.byref(kind), ctypes.byref(size)) == 0
        and kind.value == socket.SOCK_STREAM
    )


def tcp_endpoint(fd: int) -> tuple[int, bool] | None:
    """(local port, connected) of ``fd`` when it is a TCP socket (IPv4 or IPv6; not UDP or a
    Unix socket), else None."""
    ends = tcp_ends(fd)
    return None if ends is None else (ends[0][1], ends[1] is not None)


def tcp_ends(fd: int) -> tuple[tuple[str, int], tuple[str, int] | None] | None:
    """((host, port) here, (host, port) there or None when not connected) of ``fd`` when it is
    a TCP socket (IPv4 or IPv6; not UDP or a Unix socket), else None.

    Asked of the descriptor itself through libc, not through a Python socket object: building
    one sets the descriptor non-blocking when a script set ``socket.setdefaulttimeout``, and the
    flag is shared with gloo's and the stores' own use of the socket. (Reading the kernel's TCP
    table, ``/proc/net/tcp``, took 8 ms with a few hundred sockets: too long for a recovery.)"""
    local = _endpoint(_libc.getsockname, fd)
    if local is None or not _is_tcp(fd):
        return None
    return local, _endpoint(_libc.getpeername, fd)


def shut_down(fd: int, inode: int) -> bool:
    """Shut down both directions of the socket ``inode`` open as ``fd``, if ``fd`` is still
    that socket (a descriptor number is reused once its owner closed it): a thread blocked on
    it (a gloo collective) gets the error a closed peer gives, and so does the other end. The
    descriptor stays open for its owner to close."""
    try:
        if os.readlink(f"{_FD_DIR}/{fd}") != f"socket:[{inode}]":
            return False
    except OSError:  # closed since
        return False
    return _libc.shutdown(fd, socket.SHUT_RDWR) == 0


class Mark:
    """The sockets open at one moment; ``opened()``: TCP connections opened since then and
    still open, not counting those accepted by a listener open at the mark (None where it
    cannot be known); ``new_sockets()``: every TCP socket opened since then."""

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

    def new_sockets(self) -> list[tuple[int, int, tuple[str, int], tuple[str, int] | None]]:
        """(inode, fd, here, there) of every TCP socket opened since the mark and open now
        (``there`` None for a listener); empty where it cannot be known."""
        now = open_sockets()
        if self.before is None or now is None:
            return []
        found = []
        for inode, fd in now.items():
            if inode not in self.before:
                ends = tcp_ends(fd)
                if ends is not None:
                    found.append((inode, fd, *ends))
        return found
