"""The small key-value interface the rendezvous uses, and what both etcd implementations share.

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

This module imports no etcd client library (python-etcd, etcd3gw, requests, urllib3): those
load with the implementation ``rendezvous.kv.connect`` picks (``v2.py``, ``v3.py``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple
from urllib.parse import urlsplit


class KVError(Exception):
    """etcd unreachable / auth failed / bad response; str(e) is one line: what is wrong, how to fix it."""


class AccessDenied(KVError):
    """etcd's auth refused this user the job's keys (its role lacks the run's prefix)."""


class LeaseExpired(KVError):
    """A write named a lease that has expired or was revoked (the caller lost its membership)."""


@dataclass(frozen=True)
class Entry:
    key: str  # relative to the KV's prefix
    value: str
    revision: int  # mod revision (v3 mod_revision, v2 modifiedIndex)


@dataclass(frozen=True)
class EtcdOptions:
    endpoints: tuple[str, ...]  # "host:port" or "http(s)://host:port"; later ones are failovers
    prefix: str = ""  # every key is stored under this prefix
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)  # a secret: never in a repr or a log
    timeout: float = 5.0  # per-request timeout, seconds


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

    def __enter__(self) -> KV:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _EtcdClient(KV):
    """What both implementations build the same way: the options, the job's key prefix and one
    client per endpoint (``_client``, the implementation's own), tried in order starting from
    the last one that answered (``_cur``), and the first request that checks etcd answers."""

    def __init__(self, options: EtcdOptions):
        self.options = options
        self._keys = _Keys(options.prefix)
        self._clients = [self._client(scheme, host, port) for scheme, host, port in _endpoints(options)]
        self._cur = 0

    @abstractmethod
    def _client(self, scheme: str, host: str, port: int):
        """The client library's connection to one endpoint."""

    def _check(self) -> None:
        """``connect``'s check that etcd answers, within one timeout across every endpoint."""
        self.current_revision(timeout=self.options.timeout / len(self._clients))


# ---------------------------------------------------------------- shared helpers

_FIX = "start etcd or fix --rdzv-endpoint"


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
    for needle, words in (
        ("refused", "connection refused"),
        ("certificate", "TLS certificate rejected: check cacert/cert/key"),
        ("ssl", "TLS handshake failed: check https and cacert/cert/key"),
        ("timed out", "no answer within the timeout"),
        ("timeout", "no answer within the timeout"),
        ("name or service not known", "unknown host name"),
        ("failed to resolve", "unknown host name"),
        ("no route", "no route to host"),
        ("unreachable", "network unreachable"),
        ("reset by peer", "connection reset"),
        ("remote end closed", "connection closed by the server"),
    ):
        if needle in blob:
            return words
    return " ".join(str(exc).split())[:160]


def _unreachable(errors: list[tuple[str, str]]) -> KVError:
    what = "; ".join(f"{url} ({why})" for url, why in errors)
    whys = " ".join(why for _, why in errors)
    if "TLS" in whys:  # etcd is there; the certificates do not match
        fix = (
            "check --rdzv-conf cacert= (the CA that signed etcd's certificate) and cert=/key= "
            "(a client certificate signed by a CA etcd trusts)"
        )
    elif ("closed by the server" in whys or "connection reset" in whys) and all(url.startswith("http:") for url, _ in errors):
        # what a TLS listener does to a plain request: answer 400 and close, or reset when the
        # close comes before the client read the answer (several clients at once, a busy host)
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
        return full[len(self.root) :]


def _whole_seconds(ttl: float) -> int:
    if not ttl > 0:
        raise ValueError(f"lease ttl must be > 0, got {ttl}")
    return max(1, math.ceil(ttl))


def _one_line(obj) -> str:
    if isinstance(obj, dict):
        obj = obj.get("message") or obj
    return " ".join(str(obj).split())[:200]
