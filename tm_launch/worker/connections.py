"""How many TCP connections this process opened across a span of its life (Linux ``/proc``).

A substitution should connect only what changed (``tm_launch.worker.communicators``: gloo
pairs on first use); this is how a worker counts what it actually opened while entering a
generation, so that the count is reported per change (``EnteredRecord.tcp_opened``) and tested,
not only inferred from timings. It counts every TCP connection the process opened in the span
(gloo pairs, plus any store or snapshot connection a change had to open): sockets that are new
since ``Mark`` and connected now. Listening sockets (one gloo device per group) are not
connections and are not counted. Elsewhere than Linux the count is None.
"""

from __future__ import annotations

import os
import socket

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


def is_tcp_connection(fd: int) -> bool:
    """Whether ``fd`` is a connected TCP socket (IPv4 or IPv6; not a listener, not UDP or a
    Unix socket). Asked of the socket itself, through a duplicate: reading the kernel's TCP
    table (``/proc/net/tcp``) took 8 ms with a few hundred sockets on the machine, too long for
    a recovery's path."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:  # closed since it was listed
        return False
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            return False
        sock.getpeername()
        return True
    except OSError:  # not connected (a listener) or no longer open
        return False
    finally:
        sock.close()


class Mark:
    """The sockets open at one moment; ``opened()``: TCP connections opened since then and
    still open (None where it cannot be known)."""

    def __init__(self):
        before = open_sockets()
        self.before = None if before is None else set(before)

    def opened(self) -> int | None:
        now = open_sockets()
        if self.before is None or now is None:
            return None
        return sum(1 for inode, fd in now.items() if inode not in self.before and is_tcp_connection(fd))
