"""The agent's thread that keeps the embedded etcd at full size while the job runs.

Every agent of an embedded-etcd job holds a leased key ``etcd/agents/<node>`` (under the run's
prefix): it says "this node's agent lives", which is what ``decisions.replacement`` needs to tell
a dead member from one that is merely slow. Each round (``interval``) the keeper reads the member
list, applies the rule, and when the rule names this node it takes the lock ``etcd/replacing``
(a create-if-absent on the agent's lease: one replacer at a time, and a replacer that dies drops
it), reads the list again under the lock, removes the dead member, adds itself and starts its
member as ``existing``. Only nodes the rule can name look, the first of the list each round, those
further back less often (``decisions.rounds_apart``): a job of a thousand nodes does not ask etcd
a thousand times a second. A node listed as a member while it runs none (its previous agent's
member, a restarted pod; or its own start that failed) replaces that entry the same way. The thread lives as long as the agent, so a member it started dies with
the agent (PDEATHSIG fires on the thread's end).
"""

from __future__ import annotations

import threading
import time
import uuid

from rendezvous.kv import KV, KVError, Lease

from ...logs import logger
from .cluster_api import ClusterAPI, ClusterError
from .decisions import Replacement, replacement, rounds_apart
from .layout import Layout
from .member import MemberProcess

log = logger("tm_launch.launcher.embedded_etcd")

AGENTS = "etcd/agents/"
LOCK = "etcd/replacing"


def initial_cluster(layout: Layout, peers: list[tuple[str, ...]]) -> str:
    """``--initial-cluster`` of a joining member: each member named by its node (members are
    always named after their node), from the peer URLs ``member add`` answered with."""
    return ",".join(f"{layout.node_of(urls)}={urls[0]}" for urls in peers if urls and layout.node_of(urls))


class Keeper:
    """Lease, liveness key and member replacement for one agent (``me`` None: a client only)."""

    def __init__(self, layout: Layout, me: str | None, member: MemberProcess | None, *, ttl: float, timeout: float, interval: float = 1.0):
        self.layout, self.me, self.member = layout, me, member
        self.ttl, self.timeout, self.interval = ttl, timeout, interval
        self.api = ClusterAPI(layout.client_urls)
        self._stop = threading.Event()
        self._closed = threading.Event()  # the thread outlives the rounds until its member is stopped
        self._kv: KV | None = None
        self._lease: Lease | None = None
        self._thread: threading.Thread | None = None

    def start(self, kv: KV) -> None:
        """Hold the liveness key, then run the rounds on a thread of their own (``kv``: a
        connection of the keeper's own, not the agent's)."""
        self._kv = kv
        self._hold()
        self._thread = threading.Thread(target=self._run, name="embedded-etcd", daemon=True)
        self._thread.start()

    def _hold(self) -> None:
        self._lease = self._kv.grant(self.ttl)
        self._kv.put(AGENTS + (self.me or f"client-{uuid.uuid4().hex[:12]}"), self.me or "", self._lease)

    def _run(self) -> None:
        spacing = rounds_apart(self.layout, self.me)
        renewed, tick = time.monotonic(), 0
        while not self._stop.wait(self.interval):
            tick += 1
            try:
                if time.monotonic() - renewed >= self.ttl / 3:
                    renewed = time.monotonic()
                    if not self._lease.refresh():
                        self._hold()
                if spacing and tick % spacing == 0 and not (self.member and self.member.running):
                    self._round()
            except (KVError, ClusterError, RuntimeError) as e:  # etcd away for a moment: the next round asks again
                log.warning("embedded etcd: %s", e)
        self._closed.wait()  # a member this thread started would die with it (PDEATHSIG)

    def alive(self) -> set[str]:
        return {e.key[len(AGENTS) :] for e in self._kv.get_prefix(AGENTS)}

    def plan(self) -> Replacement | None:
        """This round's replacement, when it is this node's to make."""
        members = self.api.members()
        if members is None:
            return None
        mine = [m for m in members if self.layout.node_of(m.peer_urls) == self.me]
        if mine:  # this node is listed but runs no member: its previous agent's, or a start that failed
            return Replacement(dead=mine[0], dead_node=self.me, by=self.me)
        chosen = replacement(self.layout, members, self.alive())
        return chosen if chosen is not None and chosen.by == self.me else None

    def _round(self) -> None:
        if self.plan() is None:
            return
        if not self._kv.create(LOCK, self.me, lease=self._lease):
            return  # another agent is replacing a member: the next round reads what it did
        try:
            plan = self.plan()  # again, under the lock: the list may have changed meanwhile
            if plan is not None:
                self._replace(plan)
        finally:
            self._kv.delete(LOCK)

    def _replace(self, plan: Replacement) -> None:
        if plan.dead is not None:
            log.info("embedded etcd: member %s (%s) is gone with its agent; %s takes its place", plan.dead_node, plan.dead.id, self.me)
            self.api.remove(plan.dead.id)
        else:
            log.info("embedded etcd: the cluster is a member short; %s joins it", self.me)
        peers = self.api.add(self.member.address.peer_url)
        self.member.start(initial_cluster(self.layout, peers), "existing", self.timeout)
        log.info("embedded etcd: %s serves as a member (%s)", self.me, self.member.address.client_url)

    def close(self) -> None:
        """After ``stop`` and the member's own stop: the thread may end."""
        self._closed.set()

    def stop(self) -> None:
        """No more rounds; the liveness key goes (the lease revoked)."""
        self._stop.set()
        if self._lease is not None:
            try:
                self._lease.revoke()
            except KVError:
                pass
