"""DDP's one collective of its second step, done in the sandbox so a warm-up can stop after one.

``DistributedDataParallel`` lays its gradient buckets out in parameter order until the start of
its second forward, which rebuilds them in the order the first backward made gradients ready,
and broadcasts rank 0's order over its process group to do so (``Reducer::rebuild_buckets``).
A process that met the job after a single step would send that broadcast in its first step with
peers that are long past theirs: a hang, or buckets laid out differently from its peers' (wrong
gradients, no error). So a spare's warm-up runs real steps in its communication-free sandbox,
where the broadcast goes to the local backend.

A spare promoted to ranks it did not warm up as runs the script again for them on the
failover's critical path, where each warm-up step is a step of downtime for the whole job. It
runs one step, the least that does the framework's lazy set-up (the optimizer's state, DDP's
first backward), and then makes the call DDP's second forward would make first
(``reducer._rebuild_buckets()``): the same state a second step would leave, one step sooner.
"""

from __future__ import annotations

import gc

from torch.nn.parallel import DistributedDataParallel


def _instances() -> list[DistributedDataParallel]:
    """Every DDP alive in this process that gc tracks and has not frozen. A spare's ``init()``
    freezes what existed before the script built its model (``gc.freeze``), so this scans only
    what the script built; the script may wrap a module it never hands to ``register``."""
    found = []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, DistributedDataParallel):
                found.append(obj)
        except Exception:  # noqa: BLE001 -- an object whose __class__ lookup raises is no DDP
            continue
    return found


def rebuild_buckets_now() -> list[DistributedDataParallel]:
    """Do every DDP's pending bucket rebuild now, as its next forward would (it then finds
    nothing to do). A DDP whose forward skips the rebuild (the Python reducer, or a static
    graph delaying all reductions) and one with nothing to rebuild (no backward yet, already
    rebuilt, ``find_unused_parameters`` without a static graph) are left alone: the C++ call
    returns False for the latter. Returns the DDPs rebuilt."""
    rebuilt = []
    for ddp in _instances():
        if getattr(ddp, "_use_python_reducer", False) or getattr(ddp, "_delay_all_reduce_all_params", False):
            continue
        reducer = getattr(ddp, "reducer", None)
        if reducer is not None and reducer._rebuild_buckets():
            ddp._has_rebuilt_buckets = True
            rebuilt.append(ddp)
    return rebuilt
