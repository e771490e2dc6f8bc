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
