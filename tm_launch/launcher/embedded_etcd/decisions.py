"""What an agent does about the embedded etcd: at its start, and when a member's node is gone.

Both rules are pure and every agent computes them alike from the same facts (the layout, etcd's
member list with who answers, and which agents hold their lease), so the agents agree without
talking; the one that acts still takes a lock first (``keeper``), because two agents reading at
different moments may each see themselves chosen.

*At start* (``on_start``): with no cluster answering yet, the first members bootstrap it (etcd's
``--initial-cluster-state new``) and the others wait for it as clients. With a cluster answering,
a node whose peer URL is listed but never started (no client URLs published) is a first member
that came late: it bootstraps too, and joins. A node listed as started is its previous agent's (a
restarted pod, an agent started again on the same node): that member's data went with it, so the
node takes its own place (``replace-self``: member remove, member add, start as ``existing``).

*Later* (``replacement``): a member is dead when it does not answer and no agent of its node holds
a lease (``etcd/agents/<node>``): a member that merely paused while its agent lives is not
removed, and a member whose agent is gone is never waited for. Its place goes to the first node
of the list that holds an agent and no member; with no such node the cluster keeps going on the
others (two of three still have a quorum) until one comes. A cluster with fewer members than the
layout's size (a replacer removed the dead one and etcd refused the add: "unhealthy cluster"
right after a change) gets the missing one the same way.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from .layout import MEMBERS, Layout

BOOTSTRAP = "bootstrap"
REPLACE_SELF = "replace-self"
CLIENT = "client"


@dataclass(frozen=True)
class Member:
    """One entry of etcd's member list, and whether its client URL answered just now."""

    id: str
    name: str
    peer_urls: tuple[str, ...]
    answering: bool
    client_urls: tuple[str, ...] = ()  # published by the member when it starts: none yet, never started

    @property
    def started(self) -> bool:
        return bool(self.client_urls)


@dataclass(frozen=True)
class Replacement:
    """Remove ``dead`` from the cluster (None: a place is empty already); ``by`` adds itself and
    starts a member."""

    dead: Member | None
    dead_node: str | None
    by: str


def on_start(layout: Layout, me: str | None, cluster: Sequence[Member] | None) -> str:
    """BOOTSTRAP, REPLACE_SELF or CLIENT for an agent starting on node ``me`` (None: not in the
    list); ``cluster``: the member list, None when no endpoint answered."""
    if me is None:
        return CLIENT
    if cluster is None:
        return BOOTSTRAP if me in layout.first_members else CLIENT
    mine = [m for m in cluster if layout.node_of(m.peer_urls) == me]
    if not mine:
        return CLIENT
    return BOOTSTRAP if not any(m.started for m in mine) else REPLACE_SELF


def replacement(layout: Layout, members: Sequence[Member], alive: Collection[str]) -> Replacement | None:
    """The next member to replace and the node that replaces it, or None. ``alive``: the nodes
    whose agents hold their lease now."""
    held = {layout.node_of(m.peer_urls): m for m in members}
    dead = [(node, m) for node, m in held.items() if node is not None and not m.answering and node not in alive]
    by = next((n for n in layout.nodes if n in alive and n not in held), None)
    if by is None:
        return None
    if dead:
        node, member = min(dead, key=lambda nm: layout.nodes.index(nm[0]))
        return Replacement(dead=member, dead_node=node, by=by)
    if len(members) < layout.size:  # a place left empty (a replacer that removed and could not add)
        return Replacement(dead=None, dead_node=None, by=by)
    return None


def rounds_apart(layout: Layout, me: str | None) -> int:
    """How many keeper rounds apart this node looks at the member list (0: never, a client only).
    The rule names the first free node of the list, so the first nodes look every round and each
    further group of three one round less often: a node far back is named only once every node
    before it holds a member or is gone, which takes rounds of its own anyway."""
    if me is None or me not in layout.nodes:
        return 0
    return 1 + layout.nodes.index(me) // MEMBERS
