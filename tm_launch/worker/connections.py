"""How many TCP connections this process opened across a span of its life (Linux ``/proc``).

How a worker counts what it actually opened while entering a generation (its world group's
full mesh, ``tm_launch.worker.communicators``, and whatever else the change needed), so that
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


def tcp_endpoint(fd: int) -> tuple[int, bool] | None:
    """(local port, connected) of ``fd`` when it is a TCP socket (IPv4 or IPv6; not UDP or a
    Unix socket), else None. Asked of the socket itself, through a duplicate: reading the
    kernel's TCP table (``/proc/net/tcp``) took 8 ms with a few hundred sockets on the machine,
    too long for a recovery's path."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:  # closed since it was listed
        return None
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            return None
        port = sock.getsockname()[1]
        try:
            sock.getpeername()
        except OSError:  # not connected: a listener, or a socket not yet connected
            return port, False
        return port, True
    except OSError:  # no longer open
        return None
    finally:
        sock.close()


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
