"""The KV layer against a real etcd, through both the v2 (python-etcd) and v3 (etcd3gw) APIs."""

import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rendezvous.etcd_server import EtcdServer, find_etcd_binary
from rendezvous.kv import EtcdOptions, KVError, LeaseExpired, connect


def _after(delay, fn, *args):
    """Run fn(*args) on a thread after delay; returns the thread and a list holding when it finished."""
    done = []

    def run():
        time.sleep(delay)
        fn(*args)
        done.append(time.monotonic())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, done


def _one_line(exc):
    text = str(exc)
    assert text and "\n" not in text, repr(text)
    return text


# ---------------------------------------------------------------- basic operations


def test_put_get_unicode(kv_factory):
    kv = kv_factory("basic")
    assert kv.get("nodes/a") is None
    rev = kv.put("nodes/a", '{"host": "héllo ☃ 🚀"}')
    e = kv.get("nodes/a")
    assert e.key == "nodes/a" and e.value == '{"host": "héllo ☃ 🚀"}' and e.revision == rev
    rev2 = kv.put("nodes/a", "")
    assert rev2 > rev and kv.get("nodes/a").value == ""
    assert kv.get("/nodes/a") == kv.get("nodes/a")  # a leading slash means the same key
    kv.put("spa ce/ü%20", "x")
    assert kv.get("spa ce/ü%20").value == "x"
    assert kv.current_revision() >= rev2


def test_create_only_if_absent(kv_factory):
    kv = kv_factory("create")
    assert kv.create("gen", "1") is True
    assert kv.create("gen", "2") is False
    assert kv.get("gen").value == "1"


def test_replace_is_compare_and_swap(kv_factory):
    kv = kv_factory("cas")
    kv.put("plan", "p1")
    seen = kv.get("plan")
    assert kv.replace("plan", "p2", seen.revision) is True
    assert kv.replace("plan", "p3", seen.revision) is False  # stale revision
    assert kv.get("plan").value == "p2"
    assert kv.replace("absent", "x", seen.revision) is False
    assert kv.replace("absent", "x", 0) is False
    assert kv.get("absent") is None


def test_create_and_replace_write_other_keys_in_the_same_transaction(kv_factory):
    """v3: the extra keys land with the swap, and not at all when it fails; v2 cannot (says so)."""
    kv = kv_factory("txn")
    if not kv.transactions:
        with pytest.raises(ValueError, match="no multi-key transaction"):
            kv.create("plan", "p1", also={"feed/delta": "d1"})
        with pytest.raises(ValueError, match="no multi-key transaction"):
            kv.replace("plan", "p1", 1, also={"feed/delta": "d1"})
        assert kv.get("plan") is None and kv.get("feed/delta") is None
        return
    assert kv.create("plan", "p1", also={"feed/delta": "d1", "feed/other": "o1"})
    first = kv.get("plan")
    assert kv.get("feed/delta").revision == first.revision and kv.get("feed/other").value == "o1"
    assert not kv.create("plan", "p0", also={"feed/delta": "d0"})
    assert kv.replace("plan", "p2", first.revision, also={"feed/delta": "d2"})
    assert kv.get("feed/delta").value == "d2" and kv.get("feed/delta").revision == kv.get("plan").revision
    assert not kv.replace("plan", "p3", first.revision, also={"feed/delta": "d3"})  # stale: nothing written
    assert (kv.get("plan").value, kv.get("feed/delta").value) == ("p2", "d2")
    with pytest.raises(ValueError):
        kv.replace("plan", "p4", kv.get("plan").revision, also={"bad//key": "x"})
    assert kv.received > 0  # every answer's bytes are counted


def test_get_prefix_says_the_revision_it_read_at(kv_factory):
    """Watching from a listing's revision misses nothing written after it, with no extra request."""
    kv = kv_factory("listing")
    kv.put("feed/a", "1")
    listing = kv.get_prefix("feed/")
    assert [e.key for e in listing] == ["feed/a"] and listing.revision == kv.current_revision()
    assert kv.get_prefix("absent/").revision == listing.revision
    assert kv.wait("feed/", listing.revision, 0.2) is False
    kv.put("feed/b", "2")
    assert kv.wait("feed/", listing.revision, 5) is True


def test_delete_and_prefixes(kv_factory):
    kv = kv_factory("del")
    for k in ["nodes/b", "nodes/a", "nodes/c/x", "nodesX", "other"]:
        kv.put(k, k)
    assert [e.key for e in kv.get_prefix("nodes/")] == ["nodes/a", "nodes/b", "nodes/c/x"]
    assert [e.key for e in kv.get_prefix("nodes")] == ["nodes/a", "nodes/b", "nodes/c/x", "nodesX"]
    assert [e.key for e in kv.get_prefix("")] == ["nodes/a", "nodes/b", "nodes/c/x", "nodesX", "other"]
    assert kv.get_prefix("missing/") == []
    assert (kv.count("nodes/"), kv.count("nodes"), kv.count("missing/")) == (3, 4, 0)
    many = kv.get_many(["nodes/a", "absent", "other", "nodes/a"])
    assert {k: e.value for k, e in many.items()} == {"nodes/a": "nodes/a", "other": "other"}
    kv.put("k3", "3")
    kv.put("k150", "150")
    assert kv.get_many([]) == {} and set(kv.get_many(f"k{i}" for i in range(200))) == {"k3", "k150"}  # two transactions
    kv.delete("k3")
    kv.delete("k150")
    kv.delete("nodes/b")
    kv.delete("nodes/b")  # deleting an absent key is fine
    assert kv.get("nodes/b") is None
    kv.delete_prefix("nodes/")
    assert [e.key for e in kv.get_prefix("")] == ["nodesX", "other"]
    kv.delete_prefix("node")  # a partial name, not a directory
    assert [e.key for e in kv.get_prefix("")] == ["other"]


def test_prefix_isolation_and_bad_keys(kv_factory):
    a, b = kv_factory("a"), kv_factory("b")
    a.put("k", "from a")
    b.put("k", "from b")
    assert a.get("k").value == "from a"
    assert [e.value for e in b.get_prefix("")] == ["from b"]
    b.delete_prefix("")
    assert a.get("k").value == "from a"
    for bad in ["../b/k", "x/../../b/k", "a..b", "x//y", "x/", "", "_hidden"]:
        with pytest.raises(ValueError):
            a.put(bad, "v")
    with pytest.raises(ValueError):
        a.get_prefix("../")
    with pytest.raises(ValueError):
        kv_factory("x/../b")


# ---------------------------------------------------------------- leases


def test_lease_expiry_and_refresh(kv_factory):
    kv = kv_factory("lease")
    kept, dropped = kv.grant(1), kv.grant(1)
    assert kept.ttl >= 1
    kv.put("kept", "1", lease=kept)
    kv.create("dropped", "1", lease=dropped)
    end = time.monotonic() + dropped.ttl + 1.5
    while time.monotonic() < end:
        assert kept.refresh() is True
        time.sleep(0.3)
    assert kv.get("dropped") is None
    assert kv.get("kept").value == "1"
    assert dropped.refresh() is False
    with pytest.raises(LeaseExpired):
        kv.put("again", "1", lease=dropped)


def test_lease_revoke(kv_factory):
    kv = kv_factory("revoke")
    lease = kv.grant(30)
    kv.put("a", "1", lease=lease)
    kv.put("b", "1", lease=lease)
    kv.put("permanent", "1")
    lease.revoke()
    assert kv.get("a") is None and kv.get("b") is None
    assert kv.get("permanent").value == "1"
    assert lease.refresh() is False
    lease.revoke()  # twice is harmless


def test_replace_keeps_lease_and_refresh_keeps_revision_usable(kv_factory):
    """A leased record updated by CAS must stay leased; and in v2, where a TTL refresh moves
    modifiedIndex, the owner can still CAS with the revision its own write returned."""
    kv = kv_factory("leasecas")
    lease = kv.grant(1)
    rev = kv.put("me", "v1", lease=lease)
    assert lease.refresh() is True
    assert kv.replace("me", "v2", rev) is True
    rev = kv.get("me").revision
    assert lease.refresh() is True
    assert kv.replace("me", "v3", rev) is True
    other = kv_factory("leasecas")  # a second client sees the same keys, any CAS loop still works
    assert other.replace("me", "v4", other.get("me").revision) is True
    kv.put("detached", "leased", lease=lease)
    kv.put("detached", "permanent")  # a put without a lease makes the key permanent
    time.sleep(lease.ttl + 1.5)
    assert kv.get("me") is None  # still leased after all those updates
    assert kv.get("detached").value == "permanent"


# ---------------------------------------------------------------- wait


@pytest.mark.parametrize("change", ["put", "delete", "create"])
def test_wait_wakes_promptly(kv_factory, change):
    kv = kv_factory("wait")
    kv.put("nodes/a", "1")
    rev = kv.current_revision()
    action = {"put": lambda: kv.put("nodes/a", "2"), "delete": lambda: kv.delete("nodes/a"), "create": lambda: kv.create("nodes/new", "1")}[
        change
    ]
    t, done = _after(0.3, action)
    assert kv.wait("nodes/", rev, timeout=5) is True
    woke = time.monotonic()
    t.join()
    assert woke - done[0] < 0.1


def test_wait_wakes_on_lease_expiry(kv_factory):
    kv = kv_factory("waitlease")
    lease = kv.grant(1)
    kv.put("nodes/a", "1", lease=lease)
    rev = kv.current_revision()
    start = time.monotonic()
    assert kv.wait("nodes/", rev, timeout=lease.ttl + 3) is True
    assert time.monotonic() - start < lease.ttl + 1.5
    assert kv.get("nodes/a") is None


def test_wait_times_out_and_ignores_other_prefixes(kv_factory):
    kv = kv_factory("waitto")
    rev = kv.current_revision()
    t, _ = _after(0.1, lambda: (kv.put("nodesX", "1"), kv.put("other/a", "1"), kv_factory("elsewhere").put("nodes/a", "1")))
    start = time.monotonic()
    assert kv.wait("nodes/", rev, timeout=0.8) is False
    assert 0.75 < time.monotonic() - start < 1.5
    t.join()


def test_wait_sees_changes_made_before_it_started(kv_factory):
    """No gap between reading and watching: a change after ``rev`` but before wait() counts."""
    kv = kv_factory("waitpast")
    rev = kv.current_revision()
    kv.put("nodes/a", "1")
    start = time.monotonic()
    assert kv.wait("nodes/", rev, timeout=5) is True
    assert time.monotonic() - start < 0.5
    assert kv.wait("nodes/", kv.current_revision(), timeout=0.2) is False


def test_wait_sees_delete_prefix(kv_factory):
    kv = kv_factory("waitdp")
    kv.put("gen/1/a", "1")
    rev = kv.current_revision()
    kv.delete_prefix("gen/")
    assert kv.wait("gen/1/", rev, timeout=2) is True


# ---------------------------------------------------------------- failure handling


@pytest.mark.parametrize("api", ["v2", "v3"])
def test_unreachable_fails_fast_with_one_line(api, refusing_port):
    port = refusing_port
    start = time.monotonic()
    with pytest.raises(KVError) as err:
        connect(api, EtcdOptions(endpoints=(f"127.0.0.1:{port}",), timeout=1.0))
    assert time.monotonic() - start < 2.0
    msg = _one_line(err.value)
    assert "connection refused" in msg and f"127.0.0.1:{port}" in msg and "--rdzv-endpoint" in msg


@pytest.mark.parametrize("api", ["v2", "v3"])
def test_a_reset_on_plain_http_suggests_https(api):
    """A TLS listener asked in plain HTTP answers 400 and closes, or resets the connection when
    its close comes before the client read the answer: either way the line says to try https."""
    server = socket.create_server(("127.0.0.1", 0))

    def reset_each():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.recv(4096)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
            conn.close()

    threading.Thread(target=reset_each, daemon=True).start()
    try:
        with pytest.raises(KVError) as err:
            connect(api, EtcdOptions(endpoints=(f"http://127.0.0.1:{server.getsockname()[1]}",), timeout=2.0))
    finally:
        server.close()
    msg = _one_line(err.value)
    assert ("connection reset" in msg or "closed by the server" in msg) and "https://" in msg and "cacert=" in msg, msg


@pytest.mark.parametrize("api", ["v2", "v3"])
def test_silent_server_times_out(api):
    """A peer that accepts TCP but never answers (a hung etcd) must not hang us."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        start = time.monotonic()
        with pytest.raises(KVError) as err:
            connect(api, EtcdOptions(endpoints=(f"127.0.0.1:{s.getsockname()[1]}",), timeout=1.0))
        assert time.monotonic() - start < 2.0
        assert "no answer" in _one_line(err.value)


@pytest.mark.parametrize("api", ["v2", "v3"])
def test_endpoint_failover(api, etcd_endpoint, refusing_port):
    dead = f"127.0.0.1:{refusing_port}"
    kv = connect(api, EtcdOptions(endpoints=(dead, etcd_endpoint), prefix="/tests/failover", timeout=1.0))
    try:
        kv.put("k", api)
        assert kv.get("k").value == api
        rev = kv.current_revision()
        kv.put("k", "again")
        assert kv.wait("", rev, timeout=2) is True
    finally:
        kv.delete_prefix("")
        kv.close()


def test_v2_api_disabled_is_explained():
    with EtcdServer(extra_args=["--enable-v2=false"]) as server:
        with pytest.raises(KVError) as err:
            connect("v2", EtcdOptions(endpoints=(server.endpoint,)))
        assert "--enable-v2" in _one_line(err.value)
        connect("v3", EtcdOptions(endpoints=(server.endpoint,))).close()


def test_bad_arguments():
    with pytest.raises(ValueError):
        connect("v4", EtcdOptions(endpoints=("127.0.0.1:2379",)))
    with pytest.raises(ValueError):
        connect("v3", EtcdOptions(endpoints=()))
    with pytest.raises(ValueError):
        connect("v3", EtcdOptions(endpoints=("ftp://x:1",)))


@pytest.mark.parametrize("module", ["rendezvous.kv.api", "rendezvous.kv"])
def test_the_interface_imports_no_etcd_client_library(module):
    """Only v2.py/v3.py import the clients; connect loads the one it needs."""
    code = (
        f"import sys, {module} as m; print(m.__file__); "
        "print(' '.join(n for n in ('etcd', 'etcd3gw', 'requests', 'urllib3') if n in sys.modules))"
    )
    repo = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, check=True, capture_output=True, text=True, timeout=60).stdout.splitlines()
    assert Path(out[0]).resolve().is_relative_to(repo / "rendezvous" / "kv")
    assert out[1:] == [""], f"importing {module} loaded {out[1:]}"


# ---------------------------------------------------------------- auth and TLS (dedicated servers)


def _etcdctl(endpoint, *args, **extra):
    ctl = find_etcd_binary() + "ctl"
    cmd = [ctl, f"--endpoints={endpoint}", *[f"--{k.replace('_', '-')}={v}" for k, v in extra.items()], *args]
    subprocess.run(cmd, check=True, capture_output=True, timeout=20)


def test_v3_user_password_auth():
    with EtcdServer() as server:
        _etcdctl(server.endpoint, "user", "add", "root:pw")
        _etcdctl(server.endpoint, "auth", "enable")
        opts = dict(endpoints=(server.endpoint,), prefix="/job", timeout=2.0)
        with pytest.raises(KVError) as err:
            connect("v3", EtcdOptions(**opts, user="root", password="wrong"))
        msg = _one_line(err.value)
        assert "rejected user 'root'" in msg and "password" in msg
        with pytest.raises(KVError) as err:
            connect("v3", EtcdOptions(**opts))
        assert "requires authentication" in _one_line(err.value)
        with connect("v3", EtcdOptions(**opts, user="root", password="pw")) as kv:
            rev = kv.put("k", "v")
            assert kv.get("k").revision == rev
            lease = kv.grant(5)
            assert kv.create("leased", "x", lease=lease) and lease.refresh()
            rev = kv.current_revision()
            t, _ = _after(0.2, kv.delete, "k")
            assert kv.wait("", rev, timeout=3) is True
            t.join()
            # A lost token (e.g. it expired after idling) is renewed transparently.
            kv._clients[0].session.headers["Authorization"] = "stale.token"
            assert kv.get("leased").value == "x"


def _make_certs(d):
    def ssl(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d, timeout=30)

    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca", "-keyout", "ca.key", "-out", "ca.crt")
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        (d / f"{name}.ext").write_text(ext + "\n")
        ssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.csr")
        ssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            f"{name}.ext",
            "-out",
            f"{name}.crt",
        )
    return {n: str(d / n) for n in ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")}


@pytest.mark.parametrize("api", ["v2", "v3"])
def test_tls_with_client_certificates(api, tmp_path):
    c = _make_certs(tmp_path)
    args = ["--cert-file", c["server.crt"], "--key-file", c["server.key"], "--trusted-ca-file", c["ca.crt"], "--client-cert-auth"]
    with EtcdServer(extra_args=args) as server:
        assert server.endpoint.startswith("https://")
        opts = EtcdOptions(
            endpoints=(server.endpoint,), prefix="/tls", cacert=c["ca.crt"], cert=c["client.crt"], key=c["client.key"], timeout=2.0
        )
        with connect(api, opts) as kv:
            rev = kv.put("k", "secure")
            assert kv.get("k").value == "secure"
            t, _ = _after(0.2, kv.put, "k", "again")
            assert kv.wait("", rev, timeout=3) is True
            t.join()
        no_client_cert = EtcdOptions(endpoints=(server.endpoint,), cacert=c["ca.crt"], timeout=2.0)
        with pytest.raises(KVError) as err:
            connect(api, no_client_cert)
        _one_line(err.value)
        no_ca = EtcdOptions(endpoints=(f"127.0.0.1:{server.port}",), cert=c["client.crt"], key=c["client.key"], timeout=2.0)
        with pytest.raises(KVError) as err:
            connect(api, no_ca)
        assert "TLS" in _one_line(err.value)
