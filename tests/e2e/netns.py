"""Network namespaces for partition tests: one namespace per node, a bridge, veth pairs.

Addresses are link-local 169.254.213.0/24 (the bridge is .1), so nothing ever leaves this
machine. Names are unique per lab and everything is removed on exit, even when the test fails:
processes still inside a namespace are SIGKILLed first. Needs root (CAP_NET_ADMIN).
"""

from __future__ import annotations

import os
import signal
import subprocess
import uuid

SUBNET = "169.254.213"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unusable_reason() -> str | None:
    """Why `ip netns` cannot be used here (None when it can): for a clear skip."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    name = f"tmprobe{uuid.uuid4().hex[:6]}"
    try:
        r = _ip("netns", "add", name, check=False)
        if r.returncode != 0:
            return f"`ip netns add` failed: {r.stderr.strip()}"
    except FileNotFoundError:
        return "the `ip` command (iproute2) is not installed"
    _ip("netns", "del", name, check=False)
    return None


class NetLab:
    """``with NetLab() as lab: ns_addr = lab.add("b"); lab.cut("b"); lab.heal("b")``."""

    def __init__(self):
        self.tag = uuid.uuid4().hex[:6]
        self.bridge = f"tmbr{self.tag}"
        self.host_addr = f"{SUBNET}.1"
        self.nodes: dict[str, tuple[str, str, str]] = {}  # node -> (namespace, inner veth, address)

    def __enter__(self) -> NetLab:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.host_addr}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        except BaseException:
            self.close()
            raise
        return self

    def add(self, node: str) -> str:
        """A namespace for ``node`` joined to the bridge; returns its address."""
        i = len(self.nodes) + 10
        ns, outer, inner, addr = f"tm{self.tag}-{node}", f"vh{self.tag}{i}", f"vn{self.tag}{i}", f"{SUBNET}.{i}"
        self.nodes[node] = (ns, inner, addr)
        _ip("netns", "add", ns)
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", ns)
        _ip("link", "set", outer, "master", self.bridge, "up")
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", inner)
        _ip("-n", ns, "link", "set", inner, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        return addr

    def wrap(self, node: str) -> list[str]:
        """The command prefix that runs a process inside ``node``'s namespace."""
        return ["ip", "netns", "exec", self.nodes[node][0]]

    def cut(self, node: str) -> None:
        """Take the node's only link down: it reaches neither etcd nor its peers."""
        ns, inner, _ = self.nodes[node]
        _ip("-n", ns, "link", "set", inner, "down")

    def heal(self, node: str) -> None:
        ns, inner, _ = self.nodes[node]
        _ip("-n", ns, "link", "set", inner, "up")

    def pids(self, node: str) -> list[int]:
        """Every process still running inside the node's namespace."""
        out = _ip("netns", "pids", self.nodes[node][0], check=False).stdout.split()
        return [int(p) for p in out]

    def close(self) -> None:
        for node, (ns, _, _) in self.nodes.items():
            for pid in self.pids(node):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _ip("netns", "del", ns, check=False)  # takes its veth (and the bridge side) with it
        _ip("link", "del", self.bridge, check=False)

    def __exit__(self, *exc) -> None:
        self.close()
