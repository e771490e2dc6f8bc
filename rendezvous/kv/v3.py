"""The KV over etcd's v3 API, through its HTTP/JSON gateway with etcd3gw's client (see ``EtcdV3``)."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import requests
import urllib3
from etcd3gw.client import Etcd3Client

from .api import (
    AccessDenied,
    Change,
    Entry,
    EtcdOptions,
    KVError,
    Lease,
    LeaseExpired,
    Listing,
    WatchNews,
    _EtcdClient,
    _one_line,
    _reason,
    _unreachable,
    _whole_seconds,
)

TXN_OPS = 64  # reads per transaction in get_many (etcd's --max-txn-ops defaults to 128)


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
    def __init__(self, kv: EtcdV3, lease_id: int, ttl: float):
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


class EtcdV3(_EtcdClient):
    """etcd's v3 API through its HTTP/JSON gateway, using etcd3gw's client for the session,
    TLS and URLs. Requests are built here because etcd3gw encodes str as latin-1 (no
    unicode), drops revisions from put's answer, cannot fail over, and has no login.

    ``received`` counts the bytes of every answer body, watch streams included: what this
    client costs etcd and the network, the figure the rendezvous benchmark reports."""

    transactions = True

    def __init__(self, options: EtcdOptions):
        super().__init__(options)
        # Per request, because requests lets $REQUESTS_CA_BUNDLE override session.verify.
        self._verify = {"verify": options.cacert} if options.cacert else {}
        self._auth = bool(options.user)
        self.received = 0
        self._received_lock = threading.Lock()  # the lease keeper thread shares this client

    def _client(self, scheme: str, host: str, port: int) -> Etcd3Client:
        return Etcd3Client(
            host=host,
            port=port,
            protocol=scheme,
            ca_cert=self.options.cacert,
            cert_cert=self.options.cert,
            cert_key=self.options.key,
            timeout=self.options.timeout,
            api_path="/v3/",
        )

    # -- transport

    def _count(self, nbytes: int) -> None:
        with self._received_lock:
            self.received += nbytes

    def _authenticate(self, client: Etcd3Client, timeout: float) -> None:
        """Log in once per endpoint; the token goes into that session's Authorization header."""
        url = client.base_url
        resp = client.session.post(
            client.get_url("auth/authenticate"),
            timeout=timeout,
            **self._verify,
            json={"name": self.options.user, "password": self.options.password or ""},
        )
        if resp.status_code == 200:
            client.session.headers["Authorization"] = resp.json()["token"]
            return
        msg = _gateway_message(resp)
        if "not enabled" in msg:
            self._auth = False  # credentials given but not needed: carry on without them
            return
        if "authentication failed" in msg:
            raise KVError(f"etcd at {url} rejected user {self.options.user!r} ({msg}): check the etcd user name and password")
        raise KVError(f"etcd at {url} refused to log in user {self.options.user!r}: {msg}")

    def _call(self, path: str, payload: dict, *, idempotent: bool = True, timeout: float | None = None, _relogin: bool = True) -> dict:
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
                resp = client.session.post(client.get_url(path), json=payload, timeout=timeout, **self._verify)
            except requests.exceptions.ReadTimeout as e:
                self._cur = (idx + 1) % n  # a hung member: start elsewhere next time
                if not idempotent:
                    raise KVError(
                        f"etcd at {url} did not answer {path} within {timeout} s, so its "
                        f"outcome is unknown: check etcd's health or raise the timeout"
                    ) from e
                errors.append((url, f"no answer within {timeout} s"))
                continue
            except requests.exceptions.RequestException as e:
                errors.append((url, _reason(e)))
                continue
            self._cur = idx
            self._count(len(resp.content))
            if resp.status_code == 200:
                try:
                    return resp.json()
                except ValueError as e:  # a member going down mid-answer: not etcd's JSON
                    if not idempotent:
                        raise KVError(f"etcd at {url} answered {path} with something that is not JSON, so its outcome is unknown") from e
                    errors.append((url, f"an answer that is not JSON ({_reason(e)})"))
                    continue
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
            return AccessDenied(
                f"etcd at {url} denied user {self.options.user!r} access ({msg}): grant it read/write on {self._keys.root!r}"
            )
        if status == 404 and not msg.startswith("etcdserver"):
            return KVError(f"etcd at {url} has no v3 gateway at /v3/{path} (HTTP 404): use etcd >= 3.4, or the v2 API")
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
        for at in range(0, len(keys), TXN_OPS):  # etcd allows 128 operations per transaction
            ranges = [{"request_range": {"key": _b64(self._keys.full(k))}} for k in keys[at : at + TXN_OPS]]
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
        txn = {
            "compare": [{"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": 0}],
            "success": [{"request_put": put}, *self._puts(also)],
        }
        return bool(self._call("kv/txn", txn, idempotent=False).get("succeeded", False))

    def replace(self, key: str, value: str, revision: int, also: dict[str, str] | None = None) -> bool:
        k = _b64(self._keys.full(key))
        puts = self._puts(also)  # bad keys fail here, whatever the revision
        if revision <= 0:  # mod_revision 0 means "absent", which can't be replaced
            return False
        txn = {
            "compare": [{"key": k, "target": "MOD", "result": "EQUAL", "mod_revision": revision}],
            "success": [{"request_put": {"key": k, "value": _b64(value), "ignore_lease": True}}, *puts],
        }
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
            time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))  # stream dropped: re-watch

    def watch_stream(self, prefix: str, idle_timeout: float = 300.0) -> Iterator[WatchNews]:
        """One v3 watch stream, created *from now* (no start revision) and kept open.

        Why not ``wait`` from the caller's last revision, once per wait: etcd serves a watcher
        that starts at an older revision than the store's ("unsynced") from a loop that runs
        every 100 ms, so any write anywhere between the caller's read and its watch (its own
        report, another node's heartbeat) delayed the next event by up to 100 ms, measured
        here at 84 ms median. A watcher created at the current revision is synced at once and
        sees every later event within milliseconds; the caller covers the gap before it by
        comparing the created revision with its own read's (``tm_launch.launcher.wakeup.StateWatch``)."""
        resp = self._open_watch(self._prefix_range(prefix), min(self.options.timeout, idle_timeout), idle_timeout)
        if resp is None:
            return
        try:
            yield from _stream_events(resp, self._count, self._keys.rel)
        finally:
            resp.close()

    def _watch_once(self, create: dict, remaining: float, deadline: float) -> bool | None:
        """True on an event, False on timeout, None if the stream ended early."""
        resp = self._open_watch(create, min(self.options.timeout, remaining), remaining)
        if resp is None:
            return False
        try:
            return _first_event(resp, deadline, self._count)
        finally:
            resp.close()

    def _open_watch(self, create: dict, connect_t: float, read_t: float) -> requests.Response | None:
        """A watch stream (``create``) opened on the first member that answers, for ``wait``
        and ``watch_stream`` alike; None when the member took longer than ``read_t`` to answer
        (a wait's whole budget: nothing changed), KVError when none does or etcd refuses."""
        errors = []
        n = len(self._clients)
        for i in range(n):
            client = self._clients[(self._cur + i) % n]
            try:
                if self._auth and "Authorization" not in client.session.headers:
                    self._authenticate(client, connect_t)
                resp = client.session.post(
                    client.get_url("watch"), json={"create_request": create}, stream=True, timeout=(connect_t, read_t), **self._verify
                )
            except requests.exceptions.ReadTimeout:
                return None
            except requests.exceptions.RequestException as e:
                errors.append((client.base_url, _reason(e)))
                continue
            if resp.status_code != 200:
                try:
                    raise self._rejected(client.base_url, "watch", resp.status_code, _gateway_message(resp))
                finally:
                    resp.close()
            return resp
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
                return True  # a change, or history we asked for is gone: re-read either way
            if res.get("canceled"):
                raise _canceled(res)
    except requests.exceptions.ChunkedEncodingError:
        return None  # the member died mid-stream (SIGKILL, restart): re-watch, maybe elsewhere
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
                    Change(
                        rel(_unb64(ev["kv"]["key"])),
                        None if ev.get("type") == "DELETE" else _unb64(ev["kv"].get("value")),
                        int(ev["kv"].get("mod_revision", 0)),
                    )
                    for ev in res["events"]
                )
                yield WatchNews("event", max(c.revision for c in changes), changes)
    except (requests.exceptions.ChunkedEncodingError, requests.exceptions.ConnectionError):
        return
