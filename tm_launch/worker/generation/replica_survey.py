"""The replica survey: which ranks hold the same copy of each registered object, measured.

A registered object without ``replicas=`` used to be taken for replicated across the world. A
script written before that rule, whose tensor-parallel-style positions hold different plain
tensors, then had its healthy ranks called diverged replicas (``StateLost``) and a joiner could
have received another position's state. Instead, at the first ``SURVEY_ROUNDS`` step boundaries
after a fresh start (generation 0, or every worker restarted from the script's checkpoint), the
ranks all-gather one exact digest per object (of its plain tensors; an optimizer's with its
parameters') and keep the classes of ranks that agreed every time (``replicas.refine``). What
differs is this rank's own: carried from its snapshot, like other unreplicated state. DTensor
placements and ``replicas=`` stay authoritative: their tensors are not surveyed.

The survey runs before the step's snapshot is taken (an object found unreplicated is in that
snapshot already), armed like the step's collectives: a peer lost during it interrupts the
step, and the round is taken again at the next boundary. A rank that joins takes the survey the
survivors hold (``StateExchange.recover``), so every rank runs the same rounds.

Cost: once per fresh start, ``SURVEY_ROUNDS`` digests of the registered plain tensors and one
small all-gather each; nothing on any later step, nothing on a recovery.
"""

from __future__ import annotations

import time

import torch

from ..log import log
from ..state.replicas import FoundReplicas, plain_digest, refine
from ..state.transfer import allgather_objects
from .audit import tensor_digest


class ReplicaSurvey:
    def __init__(self, state):
        self.state = state  # the worker's TrainingState (``found_replicas``: the survey so far)

    def due(self) -> bool:
        state = self.state
        return not state.in_sandbox and state.world.size() > 1 and not state.found_replicas.done

    def run(self) -> bool:
        """One round at the top of a step (armed); True when the classes changed (what this
        rank snapshots must be decided again)."""
        state = self.state
        if not self.due():
            return False
        t0 = time.perf_counter()
        rank, world = state.world.rank(), state.world.size()
        mine = {name: self._digest(name, obj) for name, obj in state.objects.items() if state.declared.get(name) is None}
        try:
            records = allgather_objects(state.world.inner, world, (rank, mine))
        except RuntimeError as e:  # a peer lost: the step is interrupted, the round stays due
            state.poison.set(e)
            return False
        if state.poison.active:
            return False
        before = state.found_replicas
        state.found_replicas = refine(before, records)
        if state.found_replicas.done and rank == 0:
            unmeasured = {name for name, digest in mine.items() if digest == NOTHING_PLAIN}
            log.info(f"replicas found: {describe(state.found_replicas, unmeasured)} ({(time.perf_counter() - t0) * 1000:.0f} ms)")
        return state.found_replicas.classes != before.classes

    def _digest(self, name: str, obj) -> str:
        sd = self.state.per_rank.without_buffers(name, obj.state_dict())  # per-rank by design
        parts = [sd]
        if isinstance(getattr(obj, "param_groups", None), list):  # an optimizer's state follows its parameters
            parts.append([p.detach() for group in obj.param_groups for p in group["params"]])
        with torch.no_grad():
            return plain_digest(parts, tensor_digest)


NOTHING_PLAIN = plain_digest({}, tensor_digest)  # the digest of an object with no plain tensor and no number


def describe(found: FoundReplicas, unmeasured=frozenset()) -> str:
    """One phrase per distinct partition, for the log: 'model+optimizer: [0, 2] [1, 3]'.
    ``unmeasured``: objects this rank holds nothing plain of (a torchtitan stage: DTensors only),
    whose agreement across the world says nothing: their replicas are their placements'
    (``state.replicas``), so they are not called the world's (a pipeline's stages differ on every
    rank, and torchtitan's log said "model_0+model_1: the world")."""
    by_classes: dict = {}
    for name, classes in sorted(found.classes.items()):
        by_classes.setdefault("unmeasured" if name in unmeasured and len(classes) == 1 else classes, []).append(name)
    out = []
    for classes, names in by_classes.items():
        if classes == "unmeasured":
            shape = "nothing plain to compare (their DTensor placements decide)"
        else:
            shape = "the world" if len(classes) == 1 else " ".join(str(list(c)) for c in classes)
        out.append(f"{'+'.join(names)}: {shape}")
    return "; ".join(out) or "nothing surveyed"
