"""One small key-value interface over etcd's v2 API (python-etcd) and v3 API (etcd3gw).

The rendezvous needs only: read, write, create-if-absent, compare-and-swap on a revision,
prefix reads and deletes, TTL leases, and "wake me when something under this prefix
changes". Everything else etcd offers stays out so that both API versions behave the same,
and every failure is a ``KVError`` whose text is one line that says what to do. One thing only
v3 can do is offered where it exists (``KV.transactions``): a create or compare-and-swap that
writes other keys in the same transaction.

Keys are relative to ``EtcdOptions.prefix`` (one job cannot see another's keys). To keep the
two API versions interchangeable, keys are portable ``a/b/c`` paths: no ``..``, no empty
segment, no trailing ``/``, no segment starting with ``_`` (etcd v2 hides those from listings).
In v2, keys form a directory tree, so one key cannot also be the parent of another
(``a`` and ``a/b``); that write raises ``KVError``.
"""
from __future__ import annotations

import base64
import json
import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Callable, NamedTuple
from urllib.parse import quote, urlsplit

import etcd
import requests
import urllib3
from etcd3gw.client import Etcd3Client


class KVError(Exception):
    """etcd unreachable / auth failed / bad response; str(e) is one line: what is wrong, how to fix it."""


class AccessDenied(KVError):
    """etcd's auth refused this user the job's keys (its role lacks the run's prefix)."""


class LeaseExpired(KVError):
    """A write named a lease that has expired or was revoked (the caller lost its membership)."""


@dataclass(frozen=True)
class Entry:
    key: str        # relative to the KV's prefix
    value: str
    revision: int   # mod revision (v3 mod_revision, v2 modifiedIndex)


@dataclass(frozen=True)
class EtcdOptions:
    endpoints: tuple[str, ...]          # "host:port" or "http(s)://host:port"; later ones are failovers
    prefix: str = ""                    # every key is stored under this prefix
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)   # a secret: never in a repr or a log
    timeout: float = 5.0                # per-request timeout, seconds


class Change(NamedTuple):
    """One key's change in a watch: its new value, or None when it was deleted (or expired)."""

    key: str
    value: str | None
    revision: int


class WatchNews(NamedTuple):
    """What a watch stream reports: ``created`` (changes after ``revision`` follow), or an
    ``event``: the newest revision it carries, and what changed (None where the API cannot
    say: v2's waits only know that something did)."""

    kind: str
    revision: int
    changes: tuple[Change, ...] | None = None


class Listing(list):
    """``get_prefix``'s answer: the entries, sorted by key, and ``revision``, the store-wide
    revision they were read at. Watching from there misses nothing that happened after the read,
    with no separate ``current_revision`` request."""

    def __init__(self, entries, revision: int):
        super().__init__(entries)
        self.revision = revision


class Lease(ABC):
    """A TTL that keys written with it share: they vanish together unless refreshed in time."""

    ttl: float

    @abstractmethod
    def refresh(self) -> bool:
        """True if still alive; False once it expired or was revoked. KVError if etcd is unreachable."""

    @abstractmethod
    def revoke(self) -> None:
        """End it now: the keys attached to it disappear."""


class KV(ABC):
    """Keys and prefixes are relative to the options' prefix; values are str."""

    # create and replace can write other keys in the same transaction (``also``): v3 yes, v2 no
    transactions: bool = False

    @abstractmethod
    def get(self, key: str) -> Entry | None: ...

    @abstractmethod
    def get_prefix(self, prefix: str) -> Listing:
        """All entries whose key starts with ``prefix``, sorted by key, and the revision read at."""

    def count(self, prefix: str) -> int:
        """How many keys start with ``prefix``; v3 counts without sending them."""
        return len(self.get_prefix(prefix))

    def get_many(self, keys: Iterable[str]) -> dict[str, Entry]:
        """The entries of those ``keys`` that exist; v3 reads them in one request (a transaction
        of reads), where a request per key costs each its own round trip."""
        return {k: e for k in keys if (e := self.get(k)) is not None}

    @abstractmethod
    def put(self, key: str, value: str, lease: Lease | None = None) -> int:
        """Write unconditionally; returns the new revision. Without a lease the key is permanent."""

    @abstractmethod
    def create(self, key: str, value: str, lease: Lease | None = None, also: dict[str, str] | None = None) -> bool:
        """Write only if the key is absent (atomically); False if it exists. ``also``: other
        keys (no lease) written in the same transaction, all or none (only where ``transactions``)."""

    @abstractmethod
    def replace(self, key: str, value: str, revision: int, also: dict[str, str] | None = None) -> bool:
        """Compare-and-swap on the key's mod revision; False if it changed or is absent.

        The key keeps the lease it had: updating a leased record does not make it permanent.
        ``also`` as in ``create``.
        """

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def delete_prefix(self, prefix: str) -> None: ...

    @abstractmethod
    def grant(self, ttl: float) -> Lease:
        """A new lease; the TTL is rounded up to whole seconds (etcd v3 raises it to >= 2 s)."""

    @abstractmethod
    def wait(self, prefix: str, after_revision: int, timeout: float) -> bool:
        """Block until a key under ``prefix`` is created/changed/deleted/expired at a revision
        > ``after_revision``; False on timeout. May return True spuriously (history compacted),
        so re-read and pass the new ``current_revision()`` next time."""

    def watch_stream(self, prefix: str, idle_timeout: float = 300.0) -> Iterator[WatchNews]:
        """A long-lived watch of ``prefix`` from now: yields ``created`` once (changes after
        its revision R will be reported; anything up to R is what a read sees), then an
        ``event`` for each change. It ends when the stream does (a member died,
        ``idle_timeout`` passed without news): the caller opens a new one. Built on ``wait``
        here, which cannot say what changed; v3 keeps one stream open and does (see
        ``EtcdV3.watch_stream``)."""
        revision = self.current_revision()
        yield WatchNews("created", revision)
        while self.wait(prefix, revision, idle_timeout):
            revision = self.current_revision()
            yield WatchNews("event", revision)

    @abstractmethod
    def current_revision(self) -> int:
        """The store-wide revision now (v3 header revision, v2 X-Etcd-Index)."""

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> "KV":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect(api: str, options: EtcdOptions) -> KV:
    """A KV for ``api`` "v2" or "v3", after checking once (within ``options.timeout``) that
    etcd answers, so that misconfiguration fails fast with a clear KVError."""
    kinds = {"v2": EtcdV2, "v3": EtcdV3}
    if api not in kinds:
        raise ValueError(f"unknown etcd API {api!r}: use 'v2' or 'v3'")
    kv = kinds[api](options)
    try:
        kv._check()
    except BaseException:
        kv.close()
        raise
    return kv


# ---------------------------------------------------------------- shared helpers

_FIX = "start etcd or fix --rdzv-endpoint"
TXN_OPS = 64  # reads per transaction in get_many (etcd's --max-txn-ops defaults to 128)


def _endpoints(options: EtcdOptions) -> list[tuple[str, str, int]]:
    """(scheme, host, port) per endpoint; no scheme means https when TLS files are given."""
    if not options.endpoints:
        raise ValueError("EtcdOptions.endpoints is empty: give at least one host:port")
    tls = bool(options.cacert or options.cert)
    out = []
    for ep in options.endpoints:
        text = ep.strip()
        parts = urlsplit(text if "://" in text else ("https://" if tls else "http://") + text)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"bad etcd endpoint {ep!r}: expected host:port or http(s)://host:port")
        out.append((parts.scheme, parts.hostname, parts.port or 2379))
    return out


def _url(scheme: str, host: str, port: int) -> str:
    return f"{scheme}://{'[' + host + ']' if ':' in host else host}:{port}"


def _reason(exc: BaseException) -> str:
    """A few words for why a request failed, found anywhere in the exception's chain."""
    text, seen, e = [], set(), exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text.append(f"{type(e).__name__} {e}")
        nxt = [getattr(e, "reason", None), getattr(e, "cause", None), e.__cause__, e.__context__]
        e = next((x for x in nxt if isinstance(x, BaseException)), None)
    blob = " ".join(text).lower()
    for needle, words in (("refused", "connection refused"),
                          ("certificate", "TLS certificate rejected: check cacert/cert/key"),
                          ("ssl", "TLS handshake failed: check https and cacert/cert/key"),
                          ("timed out", "no answer within the timeout"),
                          ("timeout", "no answer within the timeout"),
                          ("name or service not known", "unknown host name"),
                          ("failed to resolve", "unknown host name"),
                          ("no route", "no route to host"),
                          ("unreachable", "network unreachable"),
                          ("reset by peer", "connection reset"),
                          ("remote end closed", "connection closed by the server")):
        if needle in blob:
            return words
    return " ".join(str(exc).split())[:160]


def _unreachable(errors: list[tuple[str, str]]) -> KVError:
    what = "; ".join(f"{url} ({why})" for url, why in errors)
    whys = " ".join(why for _, why in errors)
    if "TLS" in whys:   # etcd is there; the certificates do not match
        fix = ("check --rdzv-conf cacert= (the CA that signed etcd's certificate) and cert=/key= "
               "(a client certificate signed by a CA etcd trusts)")
    elif "closed by the server" in whys and all(url.startswith("http:") for url, _ in errors):
        fix = f"{_FIX} (if etcd serves https, use https:// and --rdzv-conf cacert=)"
    else:
        fix = _FIX
    return KVError(f"cannot reach etcd at {what}: {fix}")


class _Keys:
    """Maps relative keys to absolute ones under the job's root and back, refusing escapes."""

    def __init__(self, prefix: str):
        p = prefix.strip("/")
        self._validate(p, what="prefix", allow_empty=True)
        self.root = f"/{p}/" if p else "/"

    @staticmethod
    def _validate(text: str, *, what: str, allow_empty: bool) -> None:
        if not isinstance(text, str):
            raise TypeError(f"etcd {what} must be str, got {type(text).__name__}")
        if not text and not allow_empty:
            raise ValueError(f"empty etcd {what}")
        if ".." in text or "\0" in text or "//" in text:
            raise ValueError(f"etcd {what} {text!r} may not contain '..', '//' or NUL")
        if any(seg.startswith("_") for seg in text.split("/")):
            raise ValueError(f"etcd {what} {text!r}: no segment may start with '_' (etcd v2 hides them)")

    def full(self, key: str) -> str:
        rel = key.lstrip("/") if isinstance(key, str) else key
        self._validate(rel, what="key", allow_empty=False)
        if rel.endswith("/"):
            raise ValueError(f"etcd key {key!r} may not end with '/'")
        return self.root + rel

    def full_prefix(self, prefix: str) -> str:
        rel = prefix.lstrip("/") if isinstance(prefix, str) else prefix
        self._validate(rel, what="prefix", allow_empty=True)
        return self.root + rel

    def rel(self, full: str) -> str:
        return full[len(self.root):]


def _whole_seconds(ttl: float) -> int:
    if not ttl > 0:
        raise ValueError(f"lease ttl must be > 0, got {ttl}")
    return max(1, math.ceil(ttl))


# ---------------------------------------------------------------- v3 (etcd3gw)

def _b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


def _unb64(text: str | None) -> str:
    return base64.b64decode(text or "").decode("utf-8", errors="replace")


def _range_end(prefix: bytes) -> bytes:
    """etcd's prefix range end: the prefix with its last byte below 0xff incremented."""
    b = bytearray(prefix)
    while b and b[-1] == 0xFF:
        b.pop()
    if not b:
        return b"\0"
    b[-1] += 1
    return bytes(b)


class _V3Lease(Lease):
    def __init__(self, kv: "EtcdV3", lease_id: int, ttl: float):
        self._kv, self.id, self.ttl = kv, lease_id, ttl

    def refresh(self) -> bool:
        try:
            reply = self._kv._call("lease/keepalive", {"ID": self.id})
        except LeaseExpired:
            return False
        # An expired or revoked lease answers without a TTL.
        return int(reply.get("result", {}).get("TTL", -1)) > 0

    def revoke(self) -> None:
        try:
            self._kv._call("lease/revoke", {"ID": self.id})
        except LeaseExpired:
            pass

    def __repr__(self) -> str:
        return f"Lease(v3 id={self.id:x}, ttl={self.ttl})"


class EtcdV3(KV):
    """etcd's v3 API through its HTTP/JSON gateway, using etcd3gw's client for the session,
    TLS and URLs. Requests are built here because etcd3gw encodes str as latin-1 (no
    unicode), drops revisions from put's answer, cannot fail over, and has no login.

    ``received`` counts the bytes of every answer body, watch streams included: what this
    client costs etcd and the network, the figure the rendezvous benchmark reports."""

    transactions = True

    def __init__(self, options: EtcdOptions):
        self.options = options
        self._keys = _Keys(options.prefix)
        self._clients = [
            Etcd3Client(host=host, port=port, protocol=scheme, ca_cert=options.cacert,
                        cert_cert=options.cert, cert_key=options.key, timeout=options.timeout,
                        api_path="/v3/")
            for scheme, host, port in _endpoints(options)
        ]
        # Per request, because requests lets $REQUESTS_CA_BUNDLE override session.verify.
        self._verify = {"verify": options.cacert} if options.cacert else {}
        self._cur = 0
        self._auth = bool(options.user)
        self.received = 0
        self._received_lock = threading.Lock()   # the lease keeper thread shares this client

    # -- transport

    def _count(self, nbytes: int) -> None:
        with self._received_lock:
            self.received += nbytes

    def _authenticate(self, client: Etcd3Client, timeout: float) -> None:
        """Log in once per endpoint; the token goes into that session's Authorization header."""
        url = client.base_url
        resp = client.session.post(client.get_url("auth/authenticate"), timeout=timeout, **self._verify,
                                   json={"name": self.options.user, "password": self.options.password or ""})
        if resp.status_code == 200:
            client.session.headers["Authorization"] = resp.json()["token"]
            return
        msg = _gateway_message(resp)
        if "not enabled" in msg:
            self._auth = False   # credentials given but not needed: carry on without them
            return
        if "authentication failed" in msg:
            raise KVError(f"etcd at {url} rejected user {self.options.user!r} ({msg}): "
                          "check the etcd user name and password")
        raise KVError(f"etcd at {url} refused to log in user {self.options.user!r}: {msg}")

    def _call(self, path: str, payload: dict, *, idempotent: bool = True,
              timeout: float | None = None, _relogin: bool = True) -> dict:
        """POST to the first endpoint that answers; KVError (one line) if none does.

        A connection that never opened is retried on the next endpoint. A request that was sent
        but not answered is retried only if repeating it is harmless (``idempotent``).
        """
        timeout = self.options.timeout if timeout is None else timeout
        errors: list[tuple[str, str]] = []
        n = len(self._clients)
        start = self._cur
        for i in range(n):
            idx = (start + i) % n
            client = self._clients[idx]
            url = client.base_url
            try:
                if self._auth and "Authorization" not in client.session.headers:
                    self._authenticate(client, timeout)
                resp = client.session.post(client.get_url(path), json=payload, timeout=timeout,
                                           **self._verify)
            except requests.exceptions.ReadTimeout as e:
                self._cur = (idx + 1) % n      # a hung member: start elsewhere next time
                if not idempotent:
                    raise KVError(f"etcd at {url} did not answer {path} within {timeout} s, so its "
                                  f"outcome is unknown: check etcd's health or raise the timeout") from e
                errors.append((url, f"no answer within {timeout} s"))
                continue
            except requests.exceptions.RequestException as e:
                errors.append((url, _reason(e)))
                continue
            self._cur = idx
            self._count(len(resp.content))
            if resp.status_code == 200:
                return resp.json()
            msg = _gateway_message(resp)
            if "invalid auth token" in msg and _relogin:
                client.session.headers.pop("Authorization", None)
                return self._call(path, payload, idempotent=idempotent, timeout=timeout, _relogin=False)
            raise self._rejected(url, path, resp.status_code, msg)
        raise _unreachable(errors)

    def _rejected(self, url: str, path: str, status: int, msg: str) -> KVError:
        if "lease not found" in msg:
            return LeaseExpired(f"etcd lease expired or was revoked ({msg}): re-register with a new lease")
        if "user name is empty" in msg or status == 401:
            return KVError(f"etcd at {url} requires authentication ({msg}): give an etcd user and password")
        if "permission denied" in msg:
            return AccessDenied(f"etcd at {url} denied user {self.options.user!r} access ({msg}): "
                           f"grant it read/write on {self._keys.root!r}")
        if status == 404 and not msg.startswith("etcdserver"):
            return KVError(f"etcd at {url} has no v3 gateway at /v3/{path} (HTTP 404): "
                           "use etcd >= 3.4, or the v2 API")
        return KVError(f"etcd at {url} rejected {path} (HTTP {status}: {msg})")

    # -- helpers

    def _entry(self, kv: dict) -> Entry:
        return Entry(self._keys.rel(_unb64(kv["key"])), _unb64(kv.get("value")), int(kv["mod_revision"]))

    def _prefix_range(self, prefix: str) -> dict:
        full = self._keys.full_prefix(prefix).encode()
        return {"key": _b64(full), "range_end": _b64(_range_end(full))}

    def _lease_id(self, lease: Lease | None) -> int | None:
        if lease is None:
            return None
        if not isinstance(lease, _V3Lease):
            raise TypeError("lease must come from this KV's grant()")
        return lease.id

    def _check(self) -> None:
        self.current_revision(timeout=self.options.timeout / len(self._clients))

    # -- KV

    def get(self, key: str) -> Entry | None:
        kvs = self._call("kv/range", {"key": _b64(self._keys.full(key))}).get("kvs", [])
        return self._entry(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str) -> Listing:
        reply = self._call("kv/range", self._prefix_range(prefix))
        entries = sorted((self._entry(kv) for kv in reply.get("kvs", [])), key=lambda e: e.key)
        return Listing(entries, int(reply["header"]["revision"]))

    def count(self, prefix: str) -> int:
        return int(self._call("kv/range", {**self._prefix_range(prefix), "count_only": True}).get("count", 0))

    def get_many(self, keys: Iterable[str]) -> dict[str, Entry]:
        keys, out = list(keys), {}
        for at in range(0, len(keys), TXN_OPS):   # etcd allows 128 operations per transaction
            ranges = [{"request_range": {"key": _b64(self._keys.full(k))}} for k in keys[at:at + TXN_OPS]]
            for res in self._call("kv/txn", {"success": ranges}).get("responses", []):
                for kv in res.get("response_range", {}).get("kvs", []):
                    entry = self._entry(kv)
                    out[entry.key] = entry
        return out

    def put(self, key: str, value: str, lease: Lease | None = None) -> int:
        req = {"key": _b64(self._keys.full(key)), "value": _b64(value)}
        lease_id = self._lease_id(lease)
        if lease_id is not None:
            req["lease"] = lease_id
        return int(self._call("kv/put", req)["header"]["revision"])

    def create(self, key: str, value: str, lease: Lease | None = None, also: dict[str, str] | None = None) -> bool:
        k = _b64(self._keys.full(key))
        put = {"key": k, "value": _b64(value)}
        lease_id = self._lease_id(lease)
        if lease_id is not None:
            put["lease"] = lease_id
        txn = {"compare": [{"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": 0}],
               "success": [{"request_put": put}, *self._puts(also)]}
        return bool(self._call("kv/txn", txn, idempotent=False).get("succeeded", False))

    def replace(self, key: str, value: str, revision: int, also: dict[str, str] | None = None) -> bool:
        k = _b64(self._keys.full(key))
        puts = self._puts(also)   # bad keys fail here, whatever the revision
        if revision <= 0:      # mod_revision 0 means "absent", which can't be replaced
            return False
        txn = {"compare": [{"key": k, "target": "MOD", "result": "EQUAL", "mod_revision": revision}],
               "success": [{"request_put": {"key": k, "value": _b64(value), "ignore_lease": True}}, *puts]}
        return bool(self._call("kv/txn", txn, idempotent=False).get("succeeded", False))

    def _puts(self, also: dict[str, str] | None) -> list[dict]:
        """The transaction operations that write ``also`` (permanent keys)."""
        return [{"request_put": {"key": _b64(self._keys.full(k)), "value": _b64(v)}} for k, v in (also or {}).items()]

    def delete(self, key: str) -> None:
        self._call("kv/deleterange", {"key": _b64(self._keys.full(key))})

    def delete_prefix(self, prefix: str) -> None:
        self._call("kv/deleterange", self._prefix_range(prefix))

    def grant(self, ttl: float) -> Lease:
        reply = self._call("lease/grant", {"TTL": _whole_seconds(ttl), "ID": 0}, idempotent=False)
        if reply.get("error"):
            raise KVError(f"etcd refused a lease of {ttl} s: {reply['error']}")
        return _V3Lease(self, int(reply["ID"]), float(reply["TTL"]))

    def current_revision(self, *, timeout: float | None = None) -> int:
        reply = self._call("kv/range", {"key": _b64(self._keys.root), "count_only": True}, timeout=timeout)
        return int(reply["header"]["revision"])

    def wait(self, prefix: str, after_revision: int, timeout: float) -> bool:
        """A v3 watch from ``after_revision + 1``: etcd replays anything already missed, so
        there is no gap between the caller's read and the watch; deletes and lease expiry are
        events too. The HTTP read timeout is the wait's timeout."""
        create = {**self._prefix_range(prefix), "start_revision": max(after_revision, 0) + 1}
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            seen = self._watch_once(create, remaining, deadline)
            if seen is not None:
                return seen
            time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))   # stream dropped: re-watch

    def watch_stream(self, prefix: str, idle_timeout: float = 300.0) -> Iterator[WatchNews]:
        """One v3 watch stream, created *from now* (no start revision) and kept open.

        Why not ``wait`` from the caller's last revision, once per wait: etcd serves a watcher
        that starts at an older revision than the store's ("unsynced") from a loop that runs
        every 100 ms, so any write anywhere between the caller's read and its watch (its own
        report, another node's heartbeat) delayed the next event by up to 100 ms, measured
        here at 84 ms median. A watcher created at the current revision is synced at once and
        sees every later event within milliseconds; the caller covers the gap before it by
        comparing the created revision with its own read's (``tm_launch.wakeup.StateWatch``)."""
        create = self._prefix_range(prefix)
        connect_t = min(self.options.timeout, idle_timeout)
        errors = []
        n = len(self._clients)
        for i in range(n):
            client = self._clients[(self._cur + i) % n]
            try:
                if self._auth and "Authorization" not in client.session.headers:
                    self._authenticate(client, connect_t)
                resp = client.session.post(client.get_url("watch"), json={"create_request": create},
                                           stream=True, timeout=(connect_t, idle_timeout), **self._verify)
            except requests.exceptions.ReadTimeout:
                return
            except requests.exceptions.RequestException as e:
                errors.append((client.base_url, _reason(e)))
                continue
            try:
                if resp.status_code != 200:
                    raise self._rejected(client.base_url, "watch", resp.status_code, _gateway_message(resp))
                yield from _stream_events(resp, self._count, self._keys.rel)
                return
            finally:
                resp.close()
        raise _unreachable(errors)

    def _watch_once(self, create: dict, remaining: float, deadline: float) -> bool | None:
        """True on an event, False on timeout, None if the stream ended early."""
        connect_t = min(self.options.timeout, remaining)
        errors = []
        n = len(self._clients)
        for i in range(n):
            client = self._clients[(self._cur + i) % n]
            try:
                if self._auth and "Authorization" not in client.session.headers:
                    self._authenticate(client, connect_t)
                resp = client.session.post(client.get_url("watch"), json={"create_request": create},
                                           stream=True, timeout=(connect_t, remaining), **self._verify)
            except requests.exceptions.ReadTimeout:
                return False
            except requests.exceptions.RequestException as e:
                errors.append((client.base_url, _reason(e)))
                continue
            try:
                if resp.status_code != 200:
                    raise self._rejected(client.base_url, "watch", resp.status_code, _gateway_message(resp))
                return _first_event(resp, deadline, self._count)
            finally:
                resp.close()
        raise _unreachable(errors)

    def close(self) -> None:
        for c in self._clients:
            c.session.close()


def _gateway_message(resp: requests.Response) -> str:
    try:
        body = resp.json()
        msg = body.get("message") or body.get("error") or ""
        if isinstance(msg, dict):
            msg = msg.get("message", "")
    except ValueError:
        msg = resp.text
    return " ".join(str(msg).split())[:200] or f"HTTP {resp.status_code}"


def _watch_results(resp: requests.Response, count: Callable[[int], None]) -> Iterator[dict]:
    """The ``result`` of every message of a v3 watch stream (one JSON message per line);
    ``count`` is told the size of every chunk read. An ``error`` message raises; a dropped
    connection raises requests' own error, which each reader treats its own way."""
    buf = b""
    for chunk in resp.iter_content(chunk_size=None):
        count(len(chunk))
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if not line.strip():
                continue
            msg = json.loads(line)
            if "error" in msg:
                raise KVError(f"etcd ended the watch: {_one_line(msg['error'])}")
            yield msg.get("result", {})


def _canceled(res: dict) -> KVError:
    return KVError(f"etcd canceled the watch: {res.get('cancel_reason', 'no reason given')}")


def _first_event(resp: requests.Response, deadline: float, count: Callable[[int], None]) -> bool | None:
    """Read the watch stream until it reports a change."""
    try:
        for res in _watch_results(resp, count):
            if res.get("events") or res.get("compact_revision"):
                return True    # a change, or history we asked for is gone: re-read either way
            if res.get("canceled"):
                raise _canceled(res)
    except requests.exceptions.ChunkedEncodingError:
        return None    # the member died mid-stream (SIGKILL, restart): re-watch, maybe elsewhere
    except requests.exceptions.ConnectionError as e:
        timed_out = isinstance(e.args[0] if e.args else None, urllib3.exceptions.ReadTimeoutError)
        if timed_out or time.monotonic() >= deadline:
            return False
        return None
    return None


def _stream_events(resp: requests.Response, count: Callable[[int], None], rel: Callable[[str], str]) -> Iterator[WatchNews]:
    """``created`` with the header revision, then an ``event`` per message with events (the
    newest mod revision, each key's change, keys made relative by ``rel``), until the stream ends
    (a dead member or the idle timeout: the caller re-watches)."""
    try:
        for res in _watch_results(resp, count):
            if res.get("canceled"):
                raise _canceled(res)
            if res.get("created"):
                yield WatchNews("created", int(res.get("header", {}).get("revision", 0)))
            elif res.get("events"):
                changes = tuple(
                    Change(rel(_unb64(ev["kv"]["key"])), None if ev.get("type") == "DELETE" else _unb64(ev["kv"].get("value")),
                           int(ev["kv"].get("mod_revision", 0)))
                    for ev in res["events"])
                yield WatchNews("event", max(c.revision for c in changes), changes)
    except (requests.exceptions.ChunkedEncodingError, requests.exceptions.ConnectionError):
        return


def _one_line(obj) -> str:
    if isinstance(obj, dict):
        obj = obj.get("message") or obj
    return " ".join(str(obj).split())[:200]


# ---------------------------------------------------------------- v2 (python-etcd)

class _V2Lease(Lease):
    """v2 has no leases: a TTL on each key, re-applied together by refresh().

    A v2 TTL refresh bumps the key's modifiedIndex (without waking watchers). So that the owner
    can still compare-and-swap with the revision its own put returned, the lease remembers the
    revisions its refreshes produced per key (``chain``) and ``replace`` accepts any of them.
    """

    def __init__(self, kv: "EtcdV2", ttl: int):
        self._kv, self.ttl = kv, float(ttl)
        self._seconds = ttl
        self._chains: dict[str, list[int]] = {}   # full key -> [written rev, refreshed revs...]
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
                r = self._kv._call("write", full, None, ttl=self._seconds, refresh=True,
                                   prevExist=True, prevIndex=chain[-1])
            except etcd.EtcdKeyNotFound:
                self._expire()
                return False
            except etcd.EtcdCompareFailed:
                self._kv._detach(full)   # someone else rewrote it: no longer ours to keep alive
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
    return KVError(f"etcd at {url} does not serve the v2 API: start it with --enable-v2 "
                   "(etcd >= 3.6 removed v2) or use the v3 API")


def _no_transactions(also: dict[str, str] | None) -> None:
    if also:
        raise ValueError("etcd's v2 API has no multi-key transaction: check KV.transactions before passing also=")


class EtcdV2(KV):
    """etcd's v2 API via python-etcd, one ``etcd.Client`` per endpoint with our own failover
    (python-etcd's own reconnect asks the cluster for member URLs, which may differ from the
    ones the user gave, and retries connects several times past the timeout)."""

    def __init__(self, options: EtcdOptions):
        self.options = options
        self._keys = _Keys(options.prefix)
        cert = (options.cert, options.key) if options.cert and options.key else options.cert
        self._clients = []
        for scheme, host, port in _endpoints(options):
            c = etcd.Client(host=host, port=port, protocol=scheme, cert=cert, ca_cert=options.cacert,
                            username=options.user, password=options.password,
                            read_timeout=options.timeout, allow_reconnect=False)
            # One attempt per request: urllib3's default 3 retries would multiply the timeout.
            c.http.connection_pool_kw["retries"] = urllib3.util.Retry(
                total=None, connect=0, read=0, status=0, other=0, redirect=3)
            c.http.clear()
            self._clients.append((_url(scheme, host, port), c))
        self._cur = 0
        self._lock = threading.Lock()
        self._leased: dict[str, _V2Lease] = {}   # full key -> the lease keeping it alive

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
                        raise KVError(f"etcd at {url} did not answer within {self.options.timeout} s, so "
                                      f"the outcome is unknown: check etcd's health or raise the timeout") from e
                errors.append((url, why))
                continue
            except etcd.EtcdInsufficientPermissions as e:
                raise AccessDenied(f"etcd at {url} denied access to {full_key!r} ({_one_line(e)}): "
                              "check the etcd user/password and its role's permissions") from e
            except (etcd.EtcdNotDir, etcd.EtcdNotFile, etcd.EtcdDirNotEmpty) as e:
                if method != "write":   # reads/deletes: a file where a dir would be = key absent
                    raise
                raise KVError(f"etcd v2 key {full_key!r} clashes with an existing key or directory "
                              f"({_one_line(e)}): in v2 a key cannot also be a prefix of other keys") from e
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

    def _check(self) -> None:
        self.current_revision(timeout=self.options.timeout / len(self._clients))

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
        out = [Entry(self._keys.rel(n.key), n.value or "", n.modifiedIndex)
               for n in r.leaves if not n.dir and n.key.startswith(fp)]
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
            if "index" not in payload:   # a 404 page, not etcd's JSON: the v2 API is off
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
                ev = self._call("read", watch_dir, wait=True, waitIndex=index, recursive=True,
                                timeout=remaining)
            except etcd.EtcdWatchTimedOut:
                return False
            except etcd.EtcdEventIndexCleared:
                return True      # more than 1000 events behind: unknown, so say "changed"
            key = ev.key or ""
            if key.startswith(fp) or (ev.dir and fp.startswith(key.rstrip("/") + "/")):
                return True
            index = ev.modifiedIndex + 1

    def close(self) -> None:
        for _, c in self._clients:
            c.http.clear()
