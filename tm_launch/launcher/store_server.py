"""TCPStore servers that take a whole job's connections at once.

Every worker of a generation connects to its generation's store at the same moment (the
communicators' bootstrap, the commit vote and its abort path). Measured here (torch 2.13), 32
clients connecting at once to torch's own ``TCPStore`` server made 17-18 of them wait 5 s; at 8
and 16 ranks every live generation change paid those 5 s, and at 16 the survivors gave up.

The wait is the resolver's, not the listen backlog's (both servers listen with 4096, ``ss
-ltn``): torch's client socket asks for the name of the address it connects to (a reverse DNS
lookup, twice per connection) and this machine's resolver drops queries once about a hundred
arrive together; the client then sits out the resolver's 5 s timeout (with
``RES_OPTIONS=timeout:1`` the same waits last 1 s). ``serve`` listens on an IPv4 socket of its
own and hands it to torch's server (``master_listen_fd``): 32 clients at once then connect in
milliseconds (the same clients; which lookups torch's dual-stack listener adds, we did not pin
down), and a live change at 8 and 16 ranks takes 0.5-0.8 s instead of 5.7 s and a hang.
64 clients at once still make some wait 5 s: their own lookups are the client's, which is
why workers open their connections before a change needs them (``tm_launch.worker.comms.store_clients``).
torch's classic server (``use_libuv=False``) answers waits late (every commit vote then took
its 200 ms patience: steps of 60 ms took 264 ms), so the libuv server stays.
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
