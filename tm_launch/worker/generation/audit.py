"""The guard behind live recovery: state that ranks must hold in common is compared across them.

Live recovery is exact only for the state tm-launch can see. A script may keep state it never
registered (a counter in a Python variable, a cache on an object) that a joiner then starts
from scratch; the damage shows as replicas that no longer agree. Silent divergence is the one
thing live mode must never do, so after every generation change the ranks compare, tensor by
tensor, every registered object with the ranks that should hold the same copy
(``state.replicas``; per-rank buffers excluded: they differ by design), at the first
``AFTER_CHANGE`` step boundaries (the first catches a wrong transfer, the second what a step
with wrong hidden state did to the replicated state), and every ``every`` steps if asked for
(``--audit-every``). A difference ends live mode loudly: the objects, tensors and ranks are
named, and every worker restarts from the script's checkpoint (``StateLost``).

The comparison is an exact digest of each tensor's bytes (its local shard for a DTensor), all
gathered in one all-gather over the world. It runs at the top of a step, armed like the step's
own collectives: a peer lost during it interrupts the step as any failed collective does, and
the audit is taken again at the next boundary.
"""

from __future__ import annotations

import hashlib
import time

import torch

from ..log import log
from ..state.transfer import allgather_objects
from .state_exchange import StateExchange, StateLost

AFTER_CHANGE = 2  # boundaries audited after each generation change


def tensor_digest(t: torch.Tensor) -> str:
    """An exact digest of a tensor's bytes (a DTensor's local shard), whatever its dtype or device."""
    local = t.to_local() if hasattr(t, "to_local") else t
    data = local.detach().contiguous().reshape(-1)
    if data.dtype == torch.bool:
        data = data.to(torch.uint8)
    raw = data.view(torch.uint8).cpu().numpy()
    return f"{local.dtype}:{tuple(local.shape)}:" + hashlib.blake2b(raw, digest_size=8).hexdigest()


def digests(state_dict, prefix: str = "") -> dict:
    """path -> digest of every tensor in a (nested) state dict."""
    out = {}
    if isinstance(state_dict, torch.Tensor):
        out[prefix] = tensor_digest(state_dict)
    elif isinstance(state_dict, dict):
        for k in sorted(state_dict, key=str):
            out.update(digests(state_dict[k], f"{prefix}/{k}" if prefix else str(k)))
    elif isinstance(state_dict, (list, tuple)):
        for i, v in enumerate(state_dict):
            out.update(digests(v, f"{prefix}/{i}"))
    return out


def disagreements(records: list) -> list:
    """Pure: from every rank's ``(rank, {object: (replica ranks, {tensor: digest})})``, the
    ``(object, tensor, rank a, rank b)`` where two ranks that both say they replicate an object
    hold different bytes (a tensor one of them lacks counts too). Sorted, each pair once."""
    by_rank = {rank: objects for rank, objects in records}
    found = set()
    for rank, objects in records:
        for name, (replicas, tensors) in objects.items():
            for other in replicas:
                if other <= rank or other not in by_rank or name not in by_rank[other]:
                    continue
                other_replicas, theirs = by_rank[other][name]
                if rank not in other_replicas:
                    continue
                for path in sorted(set(tensors) | set(theirs)):
                    if tensors.get(path) != theirs.get(path):
                        found.add((name, path, rank, other))
    return sorted(found)


class Audit:
    def __init__(self, state, exchange: StateExchange, every: int = 0):
        self.state = state  # the worker's TrainingState
        self.exchange = exchange
        self.every = every  # also every N steps (0: only after a change)
        self._generation = None  # the generation the pending audits belong to
        self._left = 0  # audits still due after that generation's change
        self.last_ms: float | None = None  # what the last audit took (ms)

    def due(self, step: int) -> bool:
        generation = self.state.world.generation
        if generation != self._generation:
            # A generation every worker started in from the script (generation 0, or a restart
            # from its checkpoint) received nothing: there is no recovery to check, and ranks
            # the script set up differently are not replicas that diverged.
            live_change = generation > 0 and generation != self.state.fresh_generation
            self._generation, self._left = generation, (AFTER_CHANGE if live_change else 0)
        return self._left > 0 or (self.every > 0 and step > 0 and step % self.every == 0)

    def run(self, step: int) -> None:
        """Compare at the top of ``step`` (inside its armed window); raise ``StateLost`` on a
        difference. A collective that fails poisons the step and leaves the audit due."""
        state = self.state
        world = state.world.size()
        if world < 2 or state.in_sandbox or not self.due(step):
            return
        t0 = time.perf_counter()
        rank = state.world.rank()
        mine = {}
        for name, obj in state.objects.items():
            sd = obj.state_dict()
            sd = state.per_rank.without_buffers(name, sd)  # per-rank by design
            replicas = self.exchange._replicas(name, obj, sd, rank, world) - {rank}
            if replicas:
                mine[name] = (frozenset(replicas), digests(sd))
        try:
            records = allgather_objects(state.world.inner, world, (rank, mine))
        except RuntimeError as e:  # a peer lost: the step is interrupted, the audit stays due
            state.poison.set(e)
            return
        if state.poison.active:
            return
        self._left = max(0, self._left - 1)
        self.last_ms = (time.perf_counter() - t0) * 1000
        found = disagreements(records)
        if found:
            name, path, a, b = found[0]
            more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
            raise StateLost(
                f"tm-launch: replicas diverged at step {step}: ranks {a} and {b} hold different values of "
                f"{name}:{path}{more} after a live recovery. The script keeps state tm-launch cannot see "
                f"(a variable or object it never registered; run `tm-launch rehearse` on it to find out which): "
                f"register it (job.register(per_rank=True, name=obj) for state each rank advances by itself)",
                step,
                sorted({a, b}),
            )
        if self._generation and self._left == 0 and rank == 0:
            log.info(f"audit after generation {self._generation}: every replica agrees ({self.last_ms:.0f} ms)")
