"""Ports for several "nodes" on one machine: a block of consecutive free ones on loopback.

The embedded etcd on loopback (``--etcd-loopback``) gives the i-th node ``--etcd-port + 3i`` and
the two ports after it, so a job of N nodes needs 3N consecutive ports that nobody holds.
"""

from __future__ import annotations

import random
import socket


def free_port_block(count: int, host: str = "127.0.0.1", low: int = 20000, high: int = 60000) -> int:
    """The first of ``count`` consecutive ports that were all free on ``host`` just now."""
    for _ in range(200):
        base = random.randrange(low, high - count)
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                s.bind((host, port))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports on {host}")
