"""Where each rank's snapshot lives: a ring of buddies across nodes (pure, table-tested).

Rank ``r`` sends its snapshot to ``holder_of(r)``, the rank with the same local rank on the next
node (``(r + local_world) mod world``): its node is never ``r``'s own, so one node's loss never
removes both copies of anything (the local one dies with ``r``'s node, the remote one lives on
the next). Every rank sends one snapshot and holds one, whatever the job's size: O(1) bytes
and connections per rank and per node. Two neighbouring nodes lost at once take a rank's both
copies with them: that is the one case the ring cannot recover live (the planner says which
ranks and step, and the job restarts from its checkpoint).

A job on one node has no other node: the holder is then the next rank on the same node, which
survives a worker's death but not the node's. A job of one rank has no holder at all.
"""

from __future__ import annotations


def holder_of(rank: int, world: int, local_world: int) -> int | None:
    """The rank that keeps ``rank``'s snapshot; None when there is no other rank."""
    if world <= 1:
        return None
    step = local_world if 0 < local_world < world else 1
    return (rank + step) % world


def source_of(rank: int, world: int, local_world: int) -> int | None:
    """The rank whose snapshot ``rank`` keeps (the inverse of ``holder_of``)."""
    if world <= 1:
        return None
    step = local_world if 0 < local_world < world else 1
    return (rank - step) % world


# -- parity (``--snapshot-parity K``) ------------------------------------------------------------
#
# Instead of a whole copy on the next node, a rank's snapshot may go into the parity of its
# group: the ranks with its local rank on K neighbouring nodes. The group's parity (the XOR of
# its members' snapshots) is cut in stripes, each kept by one rank on a node outside the group
# (the nodes after it, up to K of them), so that one node's loss takes at most one member of a
# group (rebuilt from the parity and the other members' own snapshots) or one stripe of a
# group's parity (its members are all alive; the stripe is rebuilt by their sending again), never
# both. Each node then keeps about 1/K of a snapshot for others instead of a whole one.


def _nodes(world: int, local_world: int) -> tuple[int, int]:
    """(ranks per node, nodes) as the ring sees them: one node's ranks are contiguous."""
    per_node = local_world if 0 < local_world < world and world % local_world == 0 else 1
    return per_node, world // per_node


def parity_group(rank: int, world: int, local_world: int, k: int) -> list[int]:
    """The ranks whose snapshots share ``rank``'s parity: its local rank on the nodes of its
    block of ``k`` (the last block may be smaller); fewer than every node, so that a stripe
    holder exists outside it."""
    per_node, nodes = _nodes(world, local_world)
    k = max(1, min(k, nodes - 1))
    first = (rank // per_node) // k * k
    return [n * per_node + rank % per_node for n in range(first, min(first + k, nodes))]


def parity_holders(rank: int, world: int, local_world: int, k: int) -> list[int]:
    """The ranks keeping the stripes of ``rank``'s group's parity, stripe ``j`` on the ``j``-th:
    same local rank, on the nodes after the group (up to ``k``; never a node of the group).
    Empty for a job of one rank."""
    if world <= 1:
        return []
    per_node, nodes = _nodes(world, local_world)
    group = parity_group(rank, world, local_world, k)
    end = group[-1] // per_node + 1
    count = min(max(1, min(k, nodes - 1)), nodes - len(group))
    return [((end + i) % nodes) * per_node + rank % per_node for i in range(count)]


def stripes_held(rank: int, world: int, local_world: int, k: int) -> list[tuple[int, int, int]]:
    """(group's first rank, stripe, stripes) for each stripe ``rank`` keeps (the inverse of
    ``parity_holders``)."""
    per_node, nodes = _nodes(world, local_world)
    out = []
    for first_node in range(0, nodes, max(1, min(k, nodes - 1))):
        member = first_node * per_node + rank % per_node
        holders = parity_holders(member, world, local_world, k)
        if rank in holders:
            out.append((parity_group(member, world, local_world, k)[0], holders.index(rank), len(holders)))
    return out
