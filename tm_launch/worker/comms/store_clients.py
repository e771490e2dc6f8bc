"""Connections to the generation stores, opened before a generation change needs them.

Opening a TCPStore client costs more than its connect: torch's client socket writes the server's
address into its descriptions, and asks the resolver for that address's name to do so (a reverse
DNS lookup, twice per connection; the client connects to an IPv4 address as IPv4-mapped IPv6,
which /etc/hosts does not answer). A lookup takes ~0.4 ms when the resolver answers; this
machine's resolver drops a query once about a hundred arrive together, and the client then sits
out the resolver's 5 s timeout. A live generation change had every worker open two to four
connections at the same moment (the world communicator, each subgroup rebuilt, the commit vote
and its abort path): from ~16 ranks on 2 cores, 64 connections at once, some change waited 5 s,
and the whole job with it. A production resolver rate-limits too; thousands of workers opening
connections in the same millisecond is exactly what it limits.

``StoreClients`` keeps ready connections to the store that hosts the current generation and to
the one that would host the next if that node were lost (the plan names both: the planner keeps
the store where it was and moves it to the standby when its node is lost,
``rendezvous.planner._store_for``), and opens them on a thread of its own after each change,
when nothing waits for them. A survivor then opens no connection on the failover's path, and
neither does a parked spare's worker, which keeps connections ready to the stores of the plan it
waits beside.
"""

from __future__ import annotations

import datetime
import socket
import threading

import torch.distributed as dist

from ...protocol import StoreAddress

_READY_MAX = 8  # per store: the world, a few subgroups, the commit vote and its abort path
# A background connect gives up sooner than a take(): a store whose node is gone must not keep
# its opener (and the connections it holds ready) for the whole set-up timeout.
_BACKGROUND_CONNECT = datetime.timedelta(seconds=30)


# Long enough for two of the resolver's 5 s timeouts: each connection makes torch's client ask
# for the server address's name, and a dropped query costs its connect 5 s.
RESOLVER_PROOF = datetime.timedelta(seconds=15)


def open_client(
    addr: str, port: int, timeout: datetime.timedelta, connect_timeout: datetime.timedelta = RESOLVER_PROOF, probe: bool = True
) -> dist.TCPStore:
    """A TCPStore client of ``addr:port`` whose waits default to ``timeout``. With ``probe``, a
    store whose node is gone is known at once (a plain connect, refused: ``OSError``), where
    torch's client would retry the refusal for all of ``connect_timeout``."""
    if probe:
        socket.create_connection((addr, port), timeout=1.0).close()
    client = dist.TCPStore(addr, port, is_master=False, timeout=connect_timeout, wait_for_workers=False)
    client.set_timeout(timeout)
    return client


def store_key(where: StoreAddress | None) -> tuple[str, int] | None:
    """(addr, port) of a directive's ``store`` (or ``standby``); None when it names none."""
    if where is None or not where.addr or not where.port:
        return None
    return where.addr, int(where.port)


class StoreClients:
    """Client connections per store address, each handed out once (``take``): a connection is
    used by one communicator or one voter, so a blocking ``wait`` on one never holds up another."""

    def __init__(self, timeout_s: float):
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._lock = threading.Lock()
        self._ready: dict[tuple, list] = {}
        self._stores: set[tuple] = set()  # the stores to keep ``_want`` connections ready to
        self._filling: dict[tuple, threading.Thread] = {}  # one opener per store: a dead one holds up no other
        self._taken_since_prepare = 0
        self._want = 1
        self._closed = False
        self.opened_on_demand = 0  # connections a caller waited for (none was ready)

    def take(self, where: StoreAddress | None) -> dist.TCPStore:
        """A connection to ``where``'s store that nobody else uses: a ready one, else opened now."""
        key = store_key(where)
        if key is None:
            raise ValueError(f"no store address in {where!r}")
        with self._lock:
            self._taken_since_prepare += 1
            ready = self._ready.get(key)
            if ready:
                return ready.pop()
            self.opened_on_demand += 1
        return open_client(*key, self._timeout, connect_timeout=self._timeout, probe=False)  # errors as torch raises them

    def prepare(self, stores: list[StoreAddress | None], at_least: int = 1) -> None:
        """After a generation change: keep as many connections ready to each of ``stores`` as a
        change took at most (``at_least``: for a parked spare, which took none yet), opened in
        the background; ready connections to any other store are dropped (the plan moved away)."""
        keys = [k for k in map(store_key, stores) if k is not None]
        with self._lock:
            # The most any change took so far: generation 0 builds every group; a later change
            # rebuilds only the groups whose members changed, and the next may change them all.
            self._want = min(max(self._want, at_least, self._taken_since_prepare), _READY_MAX)
            self._taken_since_prepare = 0
            for stale in [k for k in self._ready if k not in keys]:
                del self._ready[stale]  # torch closes a client when it is collected
            self._stores = set(keys)
            for key in keys:
                filling = self._filling.get(key)
                if filling is None or not filling.is_alive():
                    self._filling[key] = threading.Thread(target=self._fill, args=(key,), name="tm-store-clients", daemon=True)
                    self._filling[key].start()

    def ready(self, where: StoreAddress | None) -> int:
        """How many connections to ``where``'s store are ready now."""
        with self._lock:
            return len(self._ready.get(store_key(where), ()))

    def _fill(self, key: tuple) -> None:
        while True:
            with self._lock:
                if self._closed or key not in self._stores or len(self._ready.get(key, ())) >= self._want:
                    return
            try:
                client = open_client(*key, self._timeout, connect_timeout=_BACKGROUND_CONNECT)
            except (RuntimeError, dist.DistError, OSError):
                return  # unreachable now: a take() opens its own and reports what is wrong
            with self._lock:
                if self._closed or key not in self._stores:
                    return
                self._ready.setdefault(key, []).append(client)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._ready.clear()
            self._stores.clear()
