"""ZeRO-style optimizers under the live runtime: each rank's own partition as its state.

``torch.distributed.optim.ZeroRedundancyOptimizer`` keeps each parameter's optimizer state on
one rank only (its partition) and steps an inner, ordinary optimizer (``.optim``) over that
partition. Its ``state_dict()`` gathers every partition to one rank, a collective no live
transfer can make while a rank is missing; what a rank holds, and what a joiner needs, is its
own partition: the inner optimizer's state. ``ZeroPartition`` registers exactly that, declared
held by this rank alone (no replica: snapshots keep it), and names the ZeRO optimizer and its
inner one as the objects it carries, so that both may step inside ``job.steps()``.
"""

from __future__ import annotations


def is_zero(obj) -> bool:
    try:
        from torch.distributed.optim import ZeroRedundancyOptimizer
    except ImportError:  # a torch without distributed optimizers
        return False
    return isinstance(obj, ZeroRedundancyOptimizer)


class ZeroPartition:
    """This rank's partition of a ``ZeroRedundancyOptimizer`` as a registrable object."""

    def __init__(self, zero):
        self.zero = zero

    @property
    def param_groups(self) -> list:
        """The partition's parameters: its state is laid out like them (``Generations._replicas``)."""
        return self.zero.optim.param_groups

    def parts(self) -> list:
        """The optimizers whose steps this object's state carries (``TrainingState.carried``)."""
        return [self.zero, self.zero.optim]

    def state_dict(self) -> dict:
        """The inner optimizer's state over this partition, and the outer optimizer's
        hyperparameters: an LR scheduler moves the outer ones, and ZeRO copies them to the inner
        optimizer only when it steps, so between steps the inner ones are a step behind."""
        return {"partition": self.zero.optim.state_dict(),
                "groups": [{k: v for k, v in g.items() if k != "params"} for g in self.zero.param_groups]}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.zero.optim.load_state_dict(state["partition"])
        for outer, saved in zip(self.zero.param_groups, state["groups"]):
            outer.update(saved)
