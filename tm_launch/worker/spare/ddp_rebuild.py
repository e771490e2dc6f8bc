"""DDP's one collective of its early steps, done in the sandbox so a warm-up can stop once it is done.

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

A static graph (``static_graph=True``) moves that broadcast one step later: its first backward
only records the graph (every bucket all-reduced at its end, ``_delay_all_reduce``) and notes
no gradient order, so the order is noted in the second backward and the rebuild happens in the
*third* forward. Two sandbox steps (the default) left it pending, and a promoted spare sent the
broadcast in its first live step while its peers all-reduced gradients (gloo: "Received data
size doesn't match expected size", both sides restarted). So a warm-up runs steps until no DDP
has first-step work left (``first_step_work_left``): two for a static graph, one otherwise.
"""

from __future__ import annotations

import gc

from torch.nn.parallel import DistributedDataParallel

MOST_STEPS_TO_SETTLE = 2  # a static graph's: the first backward records the graph, the second the order


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


def first_step_work_left(*, python_reducer: bool, delay_all_params: bool, static_graph: bool, find_unused: bool, rebuilt: bool) -> bool:
    """Whether a DDP's next steps still hold a collective its long-running peers' steps do not:
    the bucket rebuild's broadcast, until it happened. A DDP that never rebuilds (the Python
    reducer, every parameter's reduction delayed, ``find_unused_parameters`` without a static
    graph: torch's ``should_rebuild_buckets``) has none."""
    if python_reducer or delay_all_params or (find_unused and not static_graph):
        return False
    return not rebuilt


def _has_work_left(ddp: DistributedDataParallel) -> bool:
    return first_step_work_left(
        python_reducer=getattr(ddp, "_use_python_reducer", False),
        delay_all_params=getattr(ddp, "_delay_all_reduce_all_params", False),
        static_graph=bool(getattr(ddp, "static_graph", False)),
        find_unused=bool(getattr(ddp, "find_unused_parameters", False)),
        rebuilt=bool(getattr(ddp, "_has_rebuilt_buckets", False)),
    )


def settle_now() -> list[DistributedDataParallel]:
    """Do every DDP's pending bucket rebuild now, as its next forward would (it then finds
    nothing to do), and return the DDPs that still have first-step work left: those that need
    another step first (no backward yet; a static graph before its second backward). A DDP
    that never rebuilds is left alone (the C++ call also returns False for one with nothing to
    rebuild yet). One scan of the collector's objects (a promoted spare pays it while the job
    waits)."""
    left = []
    for ddp in _instances():
        if not _has_work_left(ddp):
            continue
        if ddp.reducer._rebuild_buckets():
            ddp._has_rebuilt_buckets = True
        else:
            left.append(ddp)
    return left
