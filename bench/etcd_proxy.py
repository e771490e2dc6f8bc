"""A user-space TCP proxy in front of each etcd member, for the control-plane soak: it can slow
etcd down (netem is not in every kernel) and it sees the agents' requests go by, so that a fault
can be fired the instant a lease renewal, a registration or a plan write passes.

    proxies = EtcdProxies([("127.0.0.1", 2379), ...]).start()
    proxies.endpoints                      # give these to the agents (--rdzv-endpoint)
    proxies.set_delay(0.8)                 # every byte, each way, 0.8 s late; 0: pass-through
    proxies.arm("renewal", fault)          # fault(request) once, before the renewal goes on
    proxies.arm("plan", drop=True, after=True)  # reset the connection once the plan write went on
    proxies.stop()

    peers = EtcdProxies(cluster.peer_addresses, parse=False).start()   # between the members
    cluster.advertise_peers_at(peers.ports).start()

Bytes keep their order in each direction whatever the delay does (each direction is one FIFO
queue, written by one task). The delay applies to a chunk from the moment it was read, so a
long-poll watch (v2 ``?wait=true``, v3's ``/v3/watch`` stream) is held back like any answer.
A second set of proxies (``parse=False``: raft's streams are not requests to name) can sit
between the members, so that their traffic can be slowed too.

An armed request can also ``drop`` its connection: the client's side is reset (RST) before the
request reaches etcd, or (``after``) once it has been handed to etcd, which then still answers
into the void: the client cannot know whether its request went in.

``classify`` (pure, table-tested) names a request from its method, target and body: ``renewal``
(v3 ``lease/keepalive``; v2 a TTL refresh), ``grant`` (v3 ``lease/grant``), ``register`` (a
write of ``state/nodes/<node>`` other than a refresh) and ``plan`` (a write of ``state/plan``:
v3's compare-and-swap transaction, v2's PUT).
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

CHUNK = 65536


@dataclass
class Request:
    member: int
    method: str
    target: str
    body: bytes
    tags: frozenset = frozenset()
    at: float = field(default_factory=time.time)


def _v3_keys(obj) -> list[str]:
    """Every base64 ``key`` anywhere in a v3 gateway request body, decoded."""
    out: list[str] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == "key" and isinstance(v, str):
                try:
                    out.append(base64.b64decode(v).decode("utf-8", errors="replace"))
                except ValueError:
                    pass
            else:
                out.extend(_v3_keys(v))
    elif isinstance(obj, list):
        for v in obj:
            out.extend(_v3_keys(v))
    return out


def _is_plan(key: str) -> bool:
    return key.endswith("/state/plan")


def _is_node(key: str) -> bool:
    return "/state/nodes/" in key


def classify(method: str, target: str, body: bytes) -> frozenset:
    """The names of an etcd client request (pure): a subset of renewal, grant, register, plan."""
    path = urlsplit(target).path
    tags: set[str] = set()
    if path.startswith("/v3/"):
        if path == "/v3/lease/keepalive":
            tags.add("renewal")
        elif path == "/v3/lease/grant":
            tags.add("grant")
        elif path in ("/v3/kv/put", "/v3/kv/txn"):
            try:
                req = json.loads(body or b"{}")
            except ValueError:
                return frozenset()
            # A txn's writes are its request_puts (its compares and request_ranges read).
            if path == "/v3/kv/txn":
                ops = [op for branch in ("success", "failure") for op in req.get(branch) or [] if isinstance(op, dict)]
                writes = _v3_keys([op.get("request_put") for op in ops])
            else:
                writes = _v3_keys(req)
            if any(_is_plan(k) for k in writes):
                tags.add("plan")
            if any(_is_node(k) for k in writes):
                tags.add("register")
    elif path.startswith("/v2/keys/") and method in ("PUT", "POST"):
        key = unquote(path[len("/v2/keys") :])
        fields = parse_qs(urlsplit(target).query)
        fields.update(parse_qs(body.decode("latin-1")))
        refresh = fields.get("refresh", [""])[0].lower() == "true"
        if _is_node(key):
            tags.add("renewal" if refresh else "register")
        elif _is_plan(key) and not refresh:
            tags.add("plan")
    return frozenset(tags)


class HttpRequests:
    """Cuts a client's byte stream into HTTP/1.1 requests (head and Content-Length body); a
    stream it cannot read (chunked bodies, garbage) is passed over from then on (pure)."""

    def __init__(self):
        self.buf = b""
        self.broken = False

    def feed(self, data: bytes) -> list[tuple[str, str, bytes]]:
        if self.broken:
            return []
        self.buf += data
        out = []
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > 1 << 20:
                    self.broken, self.buf = True, b""
                return out
            lines = self.buf[:end].decode("latin-1").split("\r\n")
            parts = lines[0].split(" ")
            headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
            if len(parts) != 3 or "chunked" in headers.get("transfer-encoding", "").lower():
                self.broken, self.buf = True, b""
                return out
            try:
                size = int(headers.get("content-length", "0"))
            except ValueError:
                self.broken, self.buf = True, b""
                return out
            if len(self.buf) < end + 4 + size:
                return out
            out.append((parts[0], parts[1], self.buf[end + 4 : end + 4 + size]))
            self.buf = self.buf[end + 4 + size :]


class _Drop(Exception):
    """Raised in a connection's task: reset the client's side of this connection now."""

    def __init__(self, after: bool):
        super().__init__("dropped")
        self.after = after


@dataclass
class _Trigger:
    tag: str
    fault: Callable[[Request], None] | None
    after: bool  # fire once the request has been handed to etcd, not before
    drop: bool = False  # reset the client's connection as it fires
    fired: threading.Event = field(default_factory=threading.Event)
    request: Request | None = None
    error: BaseException | None = None


class EtcdProxies:
    """One delaying, listening proxy per etcd member, on an asyncio loop of their own thread."""

    def __init__(self, upstreams: list[tuple[str, int]], host: str = "127.0.0.1", parse: bool = True):
        self.upstreams, self.host, self.parse = upstreams, host, parse
        self.delays = [0.0] * len(upstreams)
        self.ports: list[int] = []
        self.seen: list[Request] = []  # every classified request (tags non-empty), in order
        self.requests = [0] * len(upstreams)  # per member, every request seen
        self._trigger: _Trigger | None = None
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._servers: list[asyncio.AbstractServer] = []
        self._thread = threading.Thread(target=self._loop.run_forever, name="etcd-proxies", daemon=True)

    @property
    def endpoints(self) -> list[str]:
        return [f"http://{self.host}:{p}" for p in self.ports]

    def start(self) -> EtcdProxies:
        self._thread.start()
        for i in range(len(self.upstreams)):
            server = asyncio.run_coroutine_threadsafe(self._listen(i), self._loop).result(10)
            self._servers.append(server)
            self.ports.append(server.sockets[0].getsockname()[1])
        return self

    async def _listen(self, i: int) -> asyncio.AbstractServer:
        return await asyncio.start_server(lambda r, w: self._serve(i, r, w), self.host, 0)

    def stop(self) -> None:
        async def close():
            for s in self._servers:
                s.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def set_delay(self, seconds: float, members: list[int] | None = None) -> None:
        """Delay every byte by ``seconds`` each way from now on (0: pass-through)."""
        for i in range(len(self.delays)) if members is None else members:
            self.delays[i] = seconds

    def arm(self, tag: str, fault: Callable[[Request], None] | None = None, after: bool = False, drop: bool = False) -> _Trigger:
        """Call ``fault`` once, on the proxy's thread, when the next request tagged ``tag`` passes:
        before it goes on to etcd, or (``after``) just after it has been written to etcd. With
        ``drop``, the client's connection is reset there too (before: the request never reaches
        etcd; after: its answer never reaches the client)."""
        trigger = _Trigger(tag, fault, after, drop)
        with self._lock:
            self._trigger = trigger
        return trigger

    def disarm(self) -> None:
        with self._lock:
            self._trigger = None

    def _take(self, req: Request) -> _Trigger | None:
        with self._lock:
            t = self._trigger
            if t is None or t.tag not in req.tags:
                return None
            self._trigger, t.request = None, req
            return t

    @staticmethod
    def _fire(t: _Trigger) -> None:
        try:
            if t.fault is not None:
                t.fault(t.request)
        except BaseException as e:  # the driver reads it from the trigger
            t.error = e
        finally:
            t.fired.set()

    async def _serve(self, i: int, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        try:
            ureader, uwriter = await asyncio.open_connection(*self.upstreams[i])
        except OSError:
            _reset(cwriter)  # the member is down: as close to a refusal as a proxy gets
            return
        up: asyncio.Queue = asyncio.Queue()
        down: asyncio.Queue = asyncio.Queue()
        tasks = [
            asyncio.ensure_future(self._read(i, creader, up, HttpRequests() if self.parse else None)),
            asyncio.ensure_future(self._write(up, uwriter)),
            asyncio.ensure_future(self._read(i, ureader, down, None)),
            asyncio.ensure_future(self._write(down, cwriter)),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            drop = next((t.exception() for t in done if isinstance(t.exception(), _Drop)), None)
            if drop is not None:
                _reset(cwriter)
                if drop.after:
                    # etcd has the request: let it answer (into the void) instead of cancelling it
                    # with a closed connection, as a client whose network failed would leave it.
                    tasks[1].cancel()
                    await asyncio.wait([tasks[2]], timeout=5.0)
        except asyncio.CancelledError:
            pass  # stop(): asyncio would print a cancelled connection callback's traceback
        finally:
            for t in tasks:
                t.cancel()
            for w in (cwriter, uwriter):
                w.close()

    async def _read(self, i: int, reader: asyncio.StreamReader, queue: asyncio.Queue, parser: HttpRequests | None) -> None:
        """Read chunks as they come and queue each with the time it is due to go on."""
        while True:
            data = await reader.read(CHUNK)
            due = time.monotonic() + self.delays[i]
            after = []
            if parser is not None and data:
                for method, target, body in parser.feed(data):
                    self.requests[i] += 1
                    req = Request(i, method, target, body, classify(method, target, body))
                    if req.tags:
                        self.seen.append(req)
                    t = self._take(req)
                    if t is not None and not t.after:
                        self._fire(t)
                        if t.drop:
                            raise _Drop(after=False)  # this chunk (the request) never goes on
                    elif t is not None:
                        after.append(t)
            await queue.put((due, data, after))
            if not data:
                return

    async def _write(self, queue: asyncio.Queue, writer: asyncio.StreamWriter) -> None:
        while True:
            due, data, after = await queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                raise ConnectionResetError  # one side is done: end the connection
            writer.write(data)
            await writer.drain()
            for t in after:
                self._fire(t)
            if any(t.drop for t in after):
                raise _Drop(after=True)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close a connection with a reset (RST), not an orderly end: the peer's next read or write
    fails at once, as when a network path or a middlebox drops the connection."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()
