"""Ports for several "nodes" on one machine: a block of consecutive free ones on loopback.

The embedded etcd on loopback (``--etcd-loopback``) gives the i-th node ``--etcd-port + 3i`` and
the two ports after it, so a job of N nodes needs 3N consecutive ports that nobody holds.
"""

from __future__ import annotations

import random
import socket


def _ephemeral_low(default: int = 32768) -> int:
    """The first port the kernel hands out for port 0 and outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def free_port_block(count: int, host: str = "127.0.0.1", low: int = 20000, high: int | None = None) -> int:
    """The first of ``count`` consecutive ports that were all free on ``host`` just now, below the
    kernel's ephemeral range (``high`` by default): a member that starts minutes later (one that
    replaces a dead one) must still find its ports free, and the job's own connections, stores
    and gloo pairs take ephemeral ports all the time."""
    high = min(high or 65535, _ephemeral_low())
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
