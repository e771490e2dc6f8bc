"""bench/etcd_proxy.py, the control-plane soak's delaying proxy: over real loopback sockets it
passes bytes through in order, delays them when told (each way), fires a fault on the request
it was armed for, and names etcd requests (``classify``, a table)."""

import base64
import json
import os
import socket
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

from etcd_proxy import EtcdProxies, HttpRequests, classify  # noqa: E402


def _b64(s):
    return base64.b64encode(s.encode()).decode()


PLAN = "/tm-launch/r1/state/plan"
NODE = "/tm-launch/r1/state/nodes/a"
V3_CAS = {
    "compare": [{"key": _b64(PLAN), "target": "MOD", "mod_revision": 7}],
    "success": [{"request_put": {"key": _b64(PLAN), "value": _b64("{}")}}],
}
V3_REGISTER = {
    "compare": [{"key": _b64(NODE), "target": "CREATE", "create_revision": 0}],
    "success": [{"request_put": {"key": _b64(NODE), "value": _b64("{}"), "lease": 5}}],
}
V3_READ_PLAN_IN_TXN = {"success": [{"request_range": {"key": _b64(PLAN)}}]}


@pytest.mark.parametrize(
    "method, target, body, tags",
    [
        ("POST", "/v3/lease/keepalive", b'{"ID": 5}', {"renewal"}),
        ("POST", "/v3/lease/grant", b'{"TTL": 3, "ID": 0}', {"grant"}),
        ("POST", "/v3/kv/txn", json.dumps(V3_CAS).encode(), {"plan"}),
        ("POST", "/v3/kv/txn", json.dumps(V3_REGISTER).encode(), {"register"}),
        ("POST", "/v3/kv/put", json.dumps({"key": _b64(NODE), "value": _b64("x")}).encode(), {"register"}),
        ("POST", "/v3/kv/txn", json.dumps(V3_READ_PLAN_IN_TXN).encode(), set()),  # get_many: reads in a txn
        ("POST", "/v3/kv/range", json.dumps({"key": _b64(PLAN)}).encode(), set()),
        ("POST", "/v3/kv/txn", b"not json", set()),
        ("POST", "/v3/watch", b'{"create_request": {}}', set()),
        ("PUT", "/v2/keys/tm-launch/r1/state/nodes/a", b"ttl=3&refresh=true&prevExist=true&prevIndex=9", {"renewal"}),
        ("PUT", "/v2/keys/tm-launch/r1/state/nodes/a", b"value=%7B%7D&ttl=3&prevExist=false", {"register"}),
        ("PUT", "/v2/keys/tm-launch/r1/state/plan?prevIndex=4", b"value=%7B%7D", {"plan"}),
        ("PUT", "/v2/keys/tm-launch/r1/state/plan-feed/x", b"value=1", set()),
        ("GET", "/v2/keys/tm-launch/r1/state/plan?wait=true&recursive=true", b"", set()),
        ("PUT", "/v2/keys/tm-launch/r1/log/events/1-a", b"value=x", set()),
    ],
)
def test_classify_names_renewals_grants_registrations_and_plan_writes(method, target, body, tags):
    assert classify(method, target, body) == frozenset(tags)


def test_http_requests_cuts_a_stream_anywhere_and_gives_up_on_chunked():
    raw = b"PUT /v2/keys/a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nv=abcGET /v2/keys/b?wait=true HTTP/1.1\r\n\r\n"
    p, got = HttpRequests(), []
    for i in range(0, len(raw), 7):
        got += p.feed(raw[i : i + 7])
    assert got == [("PUT", "/v2/keys/a", b"v=abc"), ("GET", "/v2/keys/b?wait=true", b"")]
    q = HttpRequests()
    assert q.feed(b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n") == [] and q.broken


class _Upstream:
    """A real TCP server: answers every line with ``ok:<line>`` and records when each came."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.arrived: list[tuple[float, bytes]] = []
        self.raw = b""  # every byte received, in order
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        buf = b""
        while data := conn.recv(4096):
            self.raw += data
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                self.arrived.append((time.monotonic(), line))
                conn.sendall(b"ok:" + line + b"\n")
        conn.close()


def _read_lines(sock, n, timeout=10.0):
    sock.settimeout(timeout)
    buf = b""
    while buf.count(b"\n") < n:
        data = sock.recv(65536)
        if not data:
            break
        buf += data
    return buf.split(b"\n")[:n]


@pytest.fixture
def proxied():
    up = _Upstream()
    proxies = EtcdProxies([("127.0.0.1", up.port)]).start()
    yield up, proxies
    proxies.stop()
    up.sock.close()


def test_pass_through_keeps_order_and_adds_no_delay(proxied):
    up, proxies = proxied
    with socket.create_connection(("127.0.0.1", proxies.ports[0])) as s:
        lines = [f"m{i}".encode() * (1 + i % 50) for i in range(300)]
        t0 = time.monotonic()
        s.sendall(b"".join(line + b"\n" for line in lines))
        got = _read_lines(s, len(lines))
        assert time.monotonic() - t0 < 2.0
    assert got == [b"ok:" + line for line in lines]
    assert [line for _, line in up.arrived] == lines


def test_a_delay_holds_each_direction_back_and_keeps_order_while_it_changes(proxied):
    up, proxies = proxied
    with socket.create_connection(("127.0.0.1", proxies.ports[0])) as s:
        proxies.set_delay(0.4)
        t0 = time.monotonic()
        s.sendall(b"a\n")
        time.sleep(0.1)  # the proxy has read "a" (the delay is taken when a chunk is read)
        proxies.set_delay(0.0)  # the next bytes would be due at once, yet must not overtake "a"
        s.sendall(b"b\n")
        got = _read_lines(s, 2)
        rtt = time.monotonic() - t0
    assert got == [b"ok:a", b"ok:b"]
    assert [line for _, line in up.arrived] == [b"a", b"b"]
    assert up.arrived[0][0] - t0 >= 0.35  # held back on the way in
    assert 0.35 <= rtt < 3.0
    with socket.create_connection(("127.0.0.1", proxies.ports[0])) as s:
        proxies.set_delay(0.3)
        t0 = time.monotonic()
        s.sendall(b"c\n")
        assert _read_lines(s, 1) == [b"ok:c"]
        assert time.monotonic() - t0 >= 0.55  # 0.3 s each way
    proxies.set_delay(0.0)


def test_an_armed_fault_fires_once_on_its_request_before_or_after_it_is_sent(proxied):
    up, proxies = proxied
    renewal = b'POST /v3/lease/keepalive HTTP/1.1\r\nContent-Length: 9\r\n\r\n{"ID": 5}'
    seen_by_etcd = []  # at each firing: had the upstream received the renewal's body yet?
    before = proxies.arm("renewal", lambda req: seen_by_etcd.append(b'{"ID": 5}' in up.raw))
    with socket.create_connection(("127.0.0.1", proxies.ports[0])) as s:
        s.sendall(b"POST /v3/kv/range HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}")
        time.sleep(0.3)
        assert not before.fired.is_set()  # a read is not a renewal
        s.sendall(renewal)
        assert before.fired.wait(5) and before.error is None
        s.sendall(renewal)  # a trigger fires once
        time.sleep(0.3)
    assert seen_by_etcd == [False]
    assert before.request.tags == frozenset({"renewal"}) and before.request.target == "/v3/lease/keepalive"
    up.raw = b""
    after = proxies.arm("renewal", lambda req: seen_by_etcd.append(True), after=True)
    with socket.create_connection(("127.0.0.1", proxies.ports[0])) as s:
        s.sendall(renewal)
        assert after.fired.wait(5)
        deadline = time.monotonic() + 5
        while b'{"ID": 5}' not in up.raw and time.monotonic() < deadline:
            time.sleep(0.01)
    assert b'{"ID": 5}' in up.raw and seen_by_etcd == [False, True]
    assert proxies.requests[0] == 4 and [r.tags for r in proxies.seen] == [frozenset({"renewal"})] * 3


def test_a_dead_member_resets_the_connection(proxied):
    up, proxies = proxied
    up.sock.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread: the port is free again
    up.sock.close()
    time.sleep(0.1)
    with socket.create_connection(("127.0.0.1", proxies.ports[0])) as s:
        s.settimeout(5)
        try:
            assert s.recv(10) == b""
        except ConnectionResetError:
            pass


def _closed_without_answer(s) -> bool:
    """The proxy reset (or ended) the connection and no answer came back."""
    s.settimeout(5)
    try:
        return s.recv(100) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("after", [False, True])
def test_an_armed_drop_resets_the_connection_before_or_after_etcd_got_the_request(proxied, after):
    """``drop``: the client's connection is reset at the armed request; before, etcd never sees
    it; after, etcd has it and answers into the void. Other connections carry on."""
    up, proxies = proxied
    plan = b"PUT /v2/keys/tm-launch/r1/state/plan HTTP/1.1\r\nContent-Length: 7\r\n\r\nvalue=1\n"
    trigger = proxies.arm("plan", drop=True, after=after)
    with socket.create_connection(("127.0.0.1", proxies.ports[0])) as s:
        s.sendall(b"POST /v3/kv/range HTTP/1.1\r\nContent-Length: 3\r\n\r\n{}\n")
        assert _read_lines(s, 4)[3] == b"ok:{}"  # not the armed request: passed through
        s.sendall(plan)
        assert trigger.fired.wait(5) and trigger.error is None
        assert _closed_without_answer(s)
    deadline = time.monotonic() + 5
    while after and b"value=1" not in up.raw and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (b"value=1" in up.raw) == after
    with socket.create_connection(("127.0.0.1", proxies.ports[0])) as s:
        s.sendall(plan)  # the trigger fired once: the next plan write goes through
        assert _read_lines(s, 1)[0].startswith(b"ok:")


def test_a_proxy_that_does_not_parse_passes_anything_through():
    """``parse=False`` (the proxies between etcd members): bytes that are no HTTP request are
    passed through, delayed like any others, and never named."""
    up = _Upstream()
    proxies = EtcdProxies([("127.0.0.1", up.port)], parse=False).start()
    try:
        with socket.create_connection(("127.0.0.1", proxies.ports[0])) as s:
            proxies.set_delay(0.3)
            t0 = time.monotonic()
            s.sendall(b"PUT /v2/keys/tm-launch/r1/state/plan HTTP/1.1\r\nContent-Length: 0\r\n\r\n\n")
            assert len(_read_lines(s, 2)) == 2
            assert time.monotonic() - t0 >= 0.55
        assert proxies.requests == [0] and proxies.seen == []
    finally:
        proxies.stop()
        up.sock.close()


def test_members_can_talk_through_proxies_that_slow_their_raft_traffic(tmp_path):
    """A real 3-member cluster whose members reach each other only through proxies
    (``EtcdCluster.advertise_peers_at``): it elects a leader and commits writes; with the links
    between members slowed, a write waits for the leader's round trip to a follower."""
    from rendezvous.etcd_server import EtcdCluster
    from rendezvous.kv import EtcdOptions, connect

    cluster = EtcdCluster()
    peers = EtcdProxies(cluster.peer_addresses, parse=False).start()
    try:
        cluster.advertise_peers_at(peers.ports).start()
        kv = connect("v3", EtcdOptions(endpoints=tuple(cluster.endpoints), prefix="peers", timeout=10))
        kv.put("k", "1")
        assert kv.get("k").value == "1"
        peers.set_delay(0.3)
        t0 = time.monotonic()
        kv.put("k", "2")
        slowed = time.monotonic() - t0
        peers.set_delay(0.0)
        assert kv.get("k").value == "2"
        assert slowed >= 0.5, slowed  # 0.3 s each way between the leader and a follower
        assert peers.requests == [0, 0, 0]  # raft's traffic was relayed, never parsed
    finally:
        cluster.stop()
        peers.stop()
