"""Where the embedded etcd's members run and how everyone reaches them: computed, not shared.

Every agent of the job is given the same node list (Slurm's ``SLURM_JOB_NODELIST``, or
``--etcd-nodes``) and computes the same answers from it, so no shared file system and no
coordinator are needed: the first ``MEMBERS`` nodes of the list start the cluster, each node's
member would listen on ``NODE:--etcd-port`` (peers on the next port), and the client endpoint
list is every node's client URL in list order, the first members first. A node that later takes
a dead member's place (``decisions.replacement``) is in that list already, so clients that were
given it at start reach the new member without being told. With ``--etcd-loopback`` (several
"nodes" on one machine: the tests) every member is on 127.0.0.1 with three ports of its own.
Pure.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

MEMBERS = 3  # a quorum of two survives the loss of any one node
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Address:
    """One node's member: where clients, peers and the health probe reach it."""

    host: str
    client_port: int
    peer_port: int
    metrics_port: int

    @property
    def client_url(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"


@dataclass(frozen=True)
class Layout:
    """The job's nodes in the one order every agent sees, and the member addresses they imply."""

    nodes: tuple[str, ...]
    port: int = 2379
    loopback: bool = False

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ValueError("the embedded etcd needs the job's node list (--etcd-nodes, or SLURM_JOB_NODELIST under srun)")
        if len(set(self.nodes)) != len(self.nodes):
            raise ValueError(f"the node list names a node twice: {','.join(self.nodes)}")

    def address(self, node: str) -> Address:
        if self.loopback:
            base = self.port + 3 * self.nodes.index(node)
            return Address(LOOPBACK, base, base + 1, base + 2)
        if node not in self.nodes:
            raise ValueError(f"{node!r} is not in the node list")
        return Address(node, self.port, self.port + 1, self.port + 2)

    @property
    def first_members(self) -> tuple[str, ...]:
        """The nodes that start the cluster: the first three (the one node, or two, of a smaller job)."""
        return self.nodes[:MEMBERS]

    @property
    def size(self) -> int:
        """How many members the cluster keeps: three, or every node of a smaller job."""
        return len(self.first_members)

    @property
    def initial_cluster(self) -> str:
        """etcd's ``--initial-cluster`` for the first start: name=peer URL of each first member."""
        return ",".join(f"{n}={self.address(n).peer_url}" for n in self.first_members)

    @property
    def client_urls(self) -> tuple[str, ...]:
        """What every agent (and ``ctl``) is given as its etcd endpoints: each node's client URL."""
        return tuple(self.address(n).client_url for n in self.nodes)

    def node_of(self, peer_urls: Iterable[str]) -> str | None:
        """The node a member listens on for its peers (None: not one of this job's addresses)."""
        by_peer = {self.address(n).peer_url: n for n in self.nodes}
        return next((by_peer[u] for u in peer_urls if u in by_peer), None)

    def own_node(self, names: Iterable[str]) -> str | None:
        """This agent's entry in the list: the first of its names (Slurm's node name, --node-id, the
        host name) that the list holds, also as a host name's first label (``train-0`` for the
        list's ``train-0.train``, a Kubernetes pod behind a headless Service). None: the agent is
        not one of the list's nodes (a spare from another allocation), so it is a client only."""
        names = [n for n in names if n]
        for name in names:
            if name in self.nodes:
                return name
        for name in names:
            short = [n for n in self.nodes if n.split(".")[0] == name.split(".")[0]]
            if len(short) == 1:
                return short[0]
        return None
