"""TCPStore servers that take a whole job's connections at once.

Every worker of a generation connects to its generation's store at the same moment (the
communicators' bootstrap, the commit vote and its abort path): a few connections each, dozens at
once from 8 ranks up. torch's server listens with a short backlog: measured here (torch 2.13),
32 clients connecting at once to a ``TCPStore`` waited 5 s and 64 waited 10 s, because the
connections beyond the backlog fail and c10d's client retries them after a back-off (on a
machine whose resolver does not answer, after first trying to resolve the failed socket's name).
At 8 and 16 ranks every live generation change paid those 5 s, and at 16 the survivors gave up.

``serve`` listens on a socket of its own with the system's largest backlog (``SOMAXCONN``) and
hands it to torch's ``TCPStore`` (``master_listen_fd``): 32 clients at once then connect in
milliseconds, and a live change at 8 and 16 ranks takes 0.5-0.8 s instead of 5.7 s and a
hang. Still measured: 64 clients at once wait 5 s (torch's libuv server listens again with a
backlog of its own). torch's classic server (``use_libuv=False``) takes 128 at once, but its
waits answer late (every commit vote then took its 200 ms patience: steps of 60 ms took 264 ms),
so the libuv server stays. Clients are torch's ordinary ``TCPStore`` clients.
"""

from __future__ import annotations

import socket

import torch.distributed as dist


def serve(addr: str) -> dist.TCPStore:
    """A TCPStore server on ``addr`` and a free port (``.port``) that accepts many clients at once."""
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.create_server((sockaddr[0], 0), family=family, backlog=socket.SOMAXCONN)
    port = sock.getsockname()[1]
    return dist.TCPStore(addr, port, None, True, wait_for_workers=False, master_listen_fd=sock.detach())
