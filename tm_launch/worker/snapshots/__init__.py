"""In-memory snapshots of the state no live rank replicates, so that every layout recovers live.

Live substitution gets a lost rank's state from a live replica. Pure FSDP2, FSDP2 x TP, a
pipeline stage or TP shard without data-parallel peers, and ZeRO-style optimizers have none:
each rank holds a shard nobody else holds. For those, every rank snapshots its registered state
after each committed step (``--snapshot-every``):

* **a local copy** in its own host memory of everything it holds (the replicated parts too:
  when the job must return one step, every rank returns, and a replica that moved on holds the
  old step nowhere else), from the oldest step the job may return to on (two images, the one
  being taken among them; three with ``--snapshot-send overlap`` and a snapshot every step);
* **a remote copy** of what no live rank replicates (its shards of parameters and optimizer
  state, the scheduler, its per-rank RNG and data position) on the rank that holds its
  snapshots, on the next node of a ring (``placement``): one node's loss never takes both.

The copy overlaps the step (``image.Capture``: buffers at the boundary, parameters and
optimizer state on the snapshot thread, a CUDA side stream into pinned host memory) and the
step's commit waits for it; the send follows on a thread of its own (``ready_to_commit``): by
default the step's commit waits for it too, so once a step commits the holders have the
snapshot of its start (a fault returns the job at most one step before the interrupted one);
with ``--snapshot-send overlap`` the next step's commit does, so a send overlaps a whole step
and a fault while it is on its way returns the job one step further.
Per-rank state travels with every commit vote as well (``publish_mirror``), as it always
did, now to the holder instead of the generation's store: the store's node may die with the
victim, the ring keeps it elsewhere.

What the job returns to is decided by ``tm_launch.worker.generation.recovery`` from what every rank holds.
"""

from .service import Snapshots

__all__ = ["Snapshots"]
