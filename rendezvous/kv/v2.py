"""The KV over etcd's v2 API via python-etcd (etcd >= 3.6 removed v2; older ones serve it
with --enable-v2). v2 has no leases and no multi-key transactions: see ``_V2Lease`` and
``EtcdV2``."""

from __future__ import annotations

import logging
import threading
import time
from urllib.parse import quote

import etcd
import urllib3

from .api import (
    AccessDenied,
    Entry,
    EtcdOptions,
    KVError,
    Lease,
    LeaseExpired,
    Listing,
    _EtcdClient,
    _one_line,
    _reason,
    _unreachable,
    _url,
    _whole_seconds,
)

# python-etcd logs an ERROR line for every request to an endpoint that does not answer; this
# client fails over, retries and says what matters in one line of its own (a KVError, the
# agent's "lost contact with etcd"), so an outage is not a screenful per second.
logging.getLogger("etcd.client").setLevel(logging.CRITICAL)


class _V2Lease(Lease):
    """v2 has no leases: a TTL on each key, re-applied together by refresh().

    A v2 TTL refresh bumps the key's modifiedIndex (without waking watchers). So that the owner
    can still compare-and-swap with the revision its own put returned, the lease remembers the
    revisions its refreshes produced per key (``chain``) and ``replace`` accepts any of them.
    """

    def __init__(self, kv: EtcdV2, ttl: int):
        self._kv, self.ttl = kv, float(ttl)
        self._seconds = ttl
        self._chains: dict[str, list[int]] = {}  # full key -> [written rev, refreshed revs...]
        self._dead = False
        self._expires = time.monotonic() + ttl

    def _attach(self, full: str, revision: int) -> None:
        self._chains[full] = [revision]

    def refresh(self) -> bool:
        if self._dead:
            return False
        with self._kv._lock:
            keys = {k: list(v) for k, v in self._chains.items()}
        if not keys and time.monotonic() > self._expires:
            self._dead = True
            return False
        for full, chain in keys.items():
            try:
                r = self._kv._call("write", full, None, ttl=self._seconds, refresh=True, prevExist=True, prevIndex=chain[-1])
            except etcd.EtcdKeyNotFound:
                self._expire()
                return False
            except etcd.EtcdCompareFailed:
                self._kv._detach(full)  # someone else rewrote it: no longer ours to keep alive
                continue
            with self._kv._lock:
                if self._chains.get(full) is not None and self._chains[full][-1] == chain[-1]:
                    self._chains[full] = (chain + [r.modifiedIndex])[-64:]
        self._expires = time.monotonic() + self._seconds
        return True

    def _expire(self) -> None:
        """Once one key is gone the lease is over: drop the rest too, as v3 would."""
        self._dead = True
        with self._kv._lock:
            keys = list(self._chains)
        for full in keys:
            self._kv._detach(full)
            try:
                self._kv._call("delete", full)
            except (etcd.EtcdKeyNotFound, etcd.EtcdNotFile):
                pass

    def revoke(self) -> None:
        self._expire()

    def __repr__(self) -> str:
        return f"Lease(v2 ttl={self.ttl}, keys={len(self._chains)})"


def _no_v2(url: str) -> KVError:
    return KVError(f"etcd at {url} does not serve the v2 API: start it with --enable-v2 (etcd >= 3.6 removed v2) or use the v3 API")


def _no_transactions(also: dict[str, str] | None) -> None:
    if also:
        raise ValueError("etcd's v2 API has no multi-key transaction: check KV.transactions before passing also=")


class EtcdV2(_EtcdClient):
    """etcd's v2 API via python-etcd, one ``etcd.Client`` per endpoint with our own failover
    (python-etcd's own reconnect asks the cluster for member URLs, which may differ from the
    ones the user gave, and retries connects several times past the timeout)."""

    def __init__(self, options: EtcdOptions):
        super().__init__(options)
        self._lock = threading.Lock()
        self._leased: dict[str, _V2Lease] = {}  # full key -> the lease keeping it alive

    def _client(self, scheme: str, host: str, port: int) -> tuple[str, etcd.Client]:
        options = self.options
        c = etcd.Client(
            host=host,
            port=port,
            protocol=scheme,
            cert=(options.cert, options.key) if options.cert and options.key else options.cert,
            ca_cert=options.cacert,
            username=options.user,
            password=options.password,
            read_timeout=options.timeout,
            allow_reconnect=False,
        )
        # One attempt per request: urllib3's default 3 retries would multiply the timeout.
        c.http.connection_pool_kw["retries"] = urllib3.util.Retry(total=None, connect=0, read=0, status=0, other=0, redirect=3)
        c.http.clear()
        return _url(scheme, host, port), c

    # -- transport

    def _call(self, method: str, full_key: str, *args, idempotent: bool = True, **kw):
        """Call ``etcd.Client.<method>`` on the first endpoint that answers.

        python-etcd's own errors for keys (not found, exists, compare failed) pass through for
        the caller to interpret; transport failures fail over or become one-line KVErrors.
        """
        path = quote(full_key, safe="/")
        errors: list[tuple[str, str]] = []
        n = len(self._clients)
        start = self._cur
        for i in range(n):
            idx = (start + i) % n
            url, client = self._clients[idx]
            try:
                result = getattr(client, method)(path, *args, **kw)
            except etcd.EtcdWatchTimedOut:
                raise
            except etcd.EtcdConnectionFailed as e:
                why = _reason(e)
                if "timeout" in why:
                    self._cur = (idx + 1) % n
                    if not idempotent and "read" in str(e.cause).lower():
                        raise KVError(
                            f"etcd at {url} did not answer within {self.options.timeout} s, so "
                            f"the outcome is unknown: check etcd's health or raise the timeout"
                        ) from e
                errors.append((url, why))
                continue
            except etcd.EtcdInsufficientPermissions as e:
                raise AccessDenied(
                    f"etcd at {url} denied access to {full_key!r} ({_one_line(e)}): check the etcd user/password and its role's permissions"
                ) from e
            except (etcd.EtcdNotDir, etcd.EtcdNotFile, etcd.EtcdDirNotEmpty) as e:
                if method != "write":  # reads/deletes: a file where a dir would be = key absent
                    raise
                raise KVError(
                    f"etcd v2 key {full_key!r} clashes with an existing key or directory "
                    f"({_one_line(e)}): in v2 a key cannot also be a prefix of other keys"
                ) from e
            except (etcd.EtcdKeyError, etcd.EtcdCompareFailed, etcd.EtcdEventIndexCleared):
                self._cur = idx
                raise
            except etcd.EtcdException as e:
                if "404 page not found" in str(e):
                    raise _no_v2(url) from e
                raise KVError(f"etcd at {url} failed a v2 {method} of {full_key!r}: {_one_line(e)}") from e
            self._cur = idx
            return result
        raise _unreachable(errors)

    # -- lease bookkeeping

    def _detach(self, full: str) -> None:
        with self._lock:
            lease = self._leased.pop(full, None)
            if lease is not None:
                lease._chains.pop(full, None)

    def _attach(self, full: str, lease: _V2Lease | None, revision: int) -> None:
        self._detach(full)
        if lease is not None:
            with self._lock:
                self._leased[full] = lease
                lease._attach(full, revision)

    def _ttl_of(self, lease: Lease | None) -> int | None:
        if lease is None:
            return None
        if not isinstance(lease, _V2Lease) or lease._kv is not self:
            raise TypeError("lease must come from this KV's grant()")
        if lease._dead:
            raise LeaseExpired("etcd lease expired or was revoked: re-register with a new lease")
        return lease._seconds

    # -- KV

    def get(self, key: str) -> Entry | None:
        full = self._keys.full(key)
        try:
            r = self._call("read", full)
        except (etcd.EtcdKeyNotFound, etcd.EtcdNotDir):
            return None
        return None if r.dir else Entry(key.lstrip("/"), r.value or "", r.modifiedIndex)

    def _listing(self, full_prefix: str):
        """The v2 nodes under the directory that holds every key starting with full_prefix, and
        the etcd index read at (None and that index when there is no such directory)."""
        parent = full_prefix[: full_prefix.rfind("/") + 1].rstrip("/") or "/"
        try:
            r = self._call("read", parent, recursive=True)
        except etcd.EtcdKeyNotFound as e:
            return None, int((e.payload or {}).get("index", 0)) or self.current_revision()
        except etcd.EtcdNotDir:
            return None, self.current_revision()
        return r, r.etcd_index

    def get_prefix(self, prefix: str) -> Listing:
        fp = self._keys.full_prefix(prefix)
        r, index = self._listing(fp)
        if r is None:
            return Listing([], index)
        out = [Entry(self._keys.rel(n.key), n.value or "", n.modifiedIndex) for n in r.leaves if not n.dir and n.key.startswith(fp)]
        return Listing(sorted(out, key=lambda e: e.key), index)

    def put(self, key: str, value: str, lease: Lease | None = None) -> int:
        full = self._keys.full(key)
        ttl = self._ttl_of(lease)
        r = self._call("write", full, value, ttl=ttl)
        self._attach(full, lease, r.modifiedIndex)
        return r.modifiedIndex

    def create(self, key: str, value: str, lease: Lease | None = None, also: dict[str, str] | None = None) -> bool:
        _no_transactions(also)
        full = self._keys.full(key)
        ttl = self._ttl_of(lease)
        try:
            r = self._call("write", full, value, ttl=ttl, prevExist=False, idempotent=False)
        except etcd.EtcdAlreadyExist:
            return False
        self._attach(full, lease, r.modifiedIndex)
        return True

    def replace(self, key: str, value: str, revision: int, also: dict[str, str] | None = None) -> bool:
        """Read, then write with prevIndex. The read supplies the TTL to keep (so a leased key
        stays leased) and the index a refresh of our own lease may have moved it to."""
        _no_transactions(also)
        full = self._keys.full(key)
        try:
            node = self._call("read", full)
        except (etcd.EtcdKeyNotFound, etcd.EtcdNotDir):
            return False
        with self._lock:
            lease = self._leased.get(full)
            chain = list(lease._chains.get(full, ())) if lease is not None else []
        ours = bool(chain) and revision in chain and chain[-1] == node.modifiedIndex
        if node.dir or (node.modifiedIndex != revision and not ours):
            return False
        ttl = lease._seconds if lease is not None and chain else (max(1, node.ttl) if node.ttl else None)
        try:
            r = self._call("write", full, value, ttl=ttl, prevIndex=node.modifiedIndex, idempotent=False)
        except (etcd.EtcdCompareFailed, etcd.EtcdKeyNotFound):
            return False
        if lease is not None and chain:
            self._attach(full, lease, r.modifiedIndex)
        return True

    def delete(self, key: str) -> None:
        full = self._keys.full(key)
        self._detach(full)
        try:
            self._call("delete", full)
        except (etcd.EtcdKeyNotFound, etcd.EtcdNotFile):
            pass

    def delete_prefix(self, prefix: str) -> None:
        """A whole directory goes in one recursive delete; a partial name deletes each match."""
        fp = self._keys.full_prefix(prefix)
        with self._lock:
            mine = [k for k in self._leased if k.startswith(fp)]
        for k in mine:
            self._detach(k)
        if fp.endswith("/") and fp != "/":
            targets = [fp.rstrip("/")]
        else:
            r, _ = self._listing(fp)
            kids = r._children if r is not None and r.dir else []
            targets = [c["key"] for c in kids if c["key"].startswith(fp)]
        for t in targets:
            try:
                self._call("delete", t, recursive=True)
            except (etcd.EtcdKeyNotFound, etcd.EtcdNotFile):
                pass

    def grant(self, ttl: float) -> Lease:
        return _V2Lease(self, _whole_seconds(ttl))

    def current_revision(self, *, timeout: float | None = None) -> int:
        try:
            return self._call("read", self._keys.root.rstrip("/") or "/", timeout=timeout).etcd_index
        except etcd.EtcdKeyNotFound as e:
            payload = e.payload or {}
            if "index" not in payload:  # a 404 page, not etcd's JSON: the v2 API is off
                raise _no_v2(self._clients[self._cur][0]) from e
            return int(payload["index"])

    def wait(self, prefix: str, after_revision: int, timeout: float) -> bool:
        """A v2 recursive watch with waitIndex on the prefix's directory. etcd replays events
        since waitIndex (expiry included), so nothing between the caller's read and the watch is
        lost; events elsewhere in that directory only move the index on."""
        fp = self._keys.full_prefix(prefix)
        watch_dir = fp[: fp.rfind("/") + 1].rstrip("/") or "/"
        index = max(after_revision, 0) + 1
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                ev = self._call("read", watch_dir, wait=True, waitIndex=index, recursive=True, timeout=remaining)
            except etcd.EtcdWatchTimedOut:
                return False
            except etcd.EtcdEventIndexCleared:
                return True  # more than 1000 events behind: unknown, so say "changed"
            key = ev.key or ""
            if key.startswith(fp) or (ev.dir and fp.startswith(key.rstrip("/") + "/")):
                return True
            index = ev.modifiedIndex + 1

    def close(self) -> None:
        for _, c in self._clients:
            c.http.clear()
