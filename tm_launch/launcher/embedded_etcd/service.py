"""The embedded etcd as the agent's command line sees it: whether to run one, start, keep, stop.

Used where the user names no etcd: ``--rdzv-backend embedded-etcd``, or a live backend
(``etcd-v3``, ...) with no ``--rdzv-endpoint`` under ``srun`` (or with ``--etcd-nodes``). The agent
then computes the layout from the node list, starts its member when the start-up rule says so,
waits until the cluster serves, and hands the agent the layout's client URLs as its endpoints;
from there the agent is an ordinary etcd-v3 agent, and the keeper runs beside it.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping

from rendezvous.kv import KV
from rendezvous.rdzv_conf import UsageError

from ...logs import logger
from ..slurm import expand_hostlist
from .cluster_api import ClusterAPI
from .decisions import BOOTSTRAP, on_start
from .keeper import Keeper
from .layout import Layout
from .member import MemberProcess

log = logger("tm_launch.launcher.embedded_etcd")

BACKEND = "embedded-etcd"


def node_list_text(etcd_nodes: str | None, under_slurm: bool, env: Mapping[str, str]) -> str | None:
    """``--etcd-nodes``, else Slurm's allocation (``SLURM_JOB_NODELIST``) under ``srun``."""
    if etcd_nodes:
        return etcd_nodes
    return (env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")) if under_slurm else None


def wanted(backend: str, endpoint: str, nodes: str | None) -> bool:
    """Whether this agent runs the embedded etcd (pure). UsageError for a contradiction."""
    if backend == BACKEND:
        if endpoint:
            raise UsageError(f"--rdzv-backend {BACKEND} starts the job's own etcd: give no --rdzv-endpoint ({endpoint})")
        if not nodes:
            raise UsageError(f"--rdzv-backend {BACKEND}: give the job's nodes with --etcd-nodes (under srun, Slurm's allocation is used)")
        return True
    return not endpoint and bool(nodes)


def layout_of(nodes: str, port: int, loopback: bool) -> Layout:
    try:
        return Layout(tuple(expand_hostlist(nodes)), port=port, loopback=loopback)
    except ValueError as e:
        raise UsageError(f"--etcd-nodes {nodes}: {e}") from None


class EmbeddedEtcd:
    """This agent's part of the embedded etcd: its member (if any) and its keeper."""

    def __init__(self, layout: Layout, names: list[str], run_id: str, *, ttl: float, timeout: float):
        self.layout = layout
        self.me = layout.own_node(names + [socket.gethostname(), socket.getfqdn()])
        self.member = MemberProcess(layout, self.me, run_id) if self.me is not None else None
        self.timeout = timeout
        self.keeper = Keeper(layout, self.me, self.member, ttl=ttl, timeout=timeout)

    @property
    def endpoint(self) -> str:
        """What the agent is given as ``--rdzv-endpoint``: every node's client URL."""
        return ",".join(self.layout.client_urls)

    def start(self) -> None:
        """Bootstrap this node's member when the rule says so (waiting for the quorum), else wait
        until the cluster answers. RuntimeError (one line) when it does not in ``timeout``."""
        api = ClusterAPI(self.layout.client_urls)
        role = on_start(self.layout, self.me, api.members(probe=False))
        where = f"node {self.me}" if self.me else "a node outside the list (a client)"
        log.info(
            "embedded etcd: %s of %d node(s), members start on %s: %s",
            where,
            len(self.layout.nodes),
            ",".join(self.layout.first_members),
            role,
        )
        if role == BOOTSTRAP:
            self.member.start(self.layout.initial_cluster, "new", self.timeout)
            return
        deadline = time.monotonic() + self.timeout
        while api.members(probe=False) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the embedded etcd did not answer within {self.timeout:.0f} s on {self.endpoint}")
            time.sleep(0.5)

    def keep(self, kv: KV) -> None:
        self.keeper.start(kv)

    def stop(self, linger: float) -> None:
        """The keeper's lease revoked, then this node's member stopped, but only once every other
        agent has left (up to ``linger`` s): they may still be writing their last records, and
        members that leave early would take the quorum from them."""
        self.keeper.stop()
        try:
            if self.member is not None and self.member.running:
                self._linger(linger)
                self.member.stop()
        finally:
            self.keeper.close()

    def _linger(self, linger: float) -> None:
        deadline = time.monotonic() + linger
        while time.monotonic() < deadline:
            try:
                if not self.keeper.alive():  # every other agent is gone (its key revoked, or lapsed)
                    return
            except Exception:  # noqa: BLE001 (etcd gone already: nothing left to wait for)
                return
            time.sleep(0.5)
