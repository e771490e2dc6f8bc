"""What a live worker trains and carries from one generation to the next, in one object.

The script's API (``job.live.LiveJob``) fills it (``register``, ``new_group``, the step loop) and
the generation protocol (``generations.Generations``) acts on it when the job changes (swaps the
groups' communicators, agrees on the step, sends or receives the registered state). Both hold
this object rather than each other's insides.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..comms.groups import LiveGroup, StepPoison
from ..generation.commit import StepCommit
from ..state.per_rank import PerRankState
from ..state.replicas import FoundReplicas
from ..step_report import StepStats


@dataclass
class TrainingState:
    world: LiveGroup  # the world group: the object DDP, FSDP and the script hold for the whole run
    poison: StepPoison  # a failed collective poisons the current step (``groups``)
    commit: StepCommit  # the current step's job-wide vote
    stats: StepStats  # step and compute times (hang watchdog, straggler statistic, switch margin)
    objects: dict = field(default_factory=dict)  # registered name -> object with state_dict()
    declared: dict = field(default_factory=dict)  # name -> ranks replicating its plain tensors (None: the world)
    per_rank: PerRankState = field(default_factory=PerRankState)  # RNG, data position: this rank's alone
    subgroups: list[LiveGroup] = field(default_factory=list)  # in the order the script created them
    step: int | None = None  # committed steps (= the next step to run); None: no state yet
    step_done_at: float | None = None  # wall clock of the last step that completed cleanly
    in_sandbox: bool = True  # no peers yet: every collective is served locally
    found_replicas: FoundReplicas = field(default_factory=FoundReplicas)  # who holds what this rank holds, measured
    pipeline_groups: set = field(default_factory=set)  # global ranks of each pipeline stage's group seen (spare.pipeline_stages)
    fresh_generation: int = -1  # the generation every worker started in from the script (nothing received)

    @property
    def groups(self) -> list[LiveGroup]:
        """The world and every subgroup."""
        return [self.world, *self.subgroups]

    @property
    def rank(self) -> int:
        return self.world.rank()

    @property
    def generation(self) -> int:
        return self.world.generation

    def carried(self) -> list:
        """The registered objects and those whose state they carry: an object holding a whole
        framework checkpoint (``tm_launch.lightning``) names its modules and optimizers in ``parts()``."""
        objects = list(self.objects.values())
        objects += [part for obj in objects if hasattr(obj, "parts") for part in obj.parts()]
        # A wrapper's optimizer (accelerate's AcceleratedOptimizer) is the one that steps.
        inners = [getattr(obj, "optimizer", None) for obj in objects]
        return objects + [inner for inner in inners if isinstance(inner, torch.optim.Optimizer)]

    def clear_step_effects(self) -> None:
        """Discard what an interrupted (or sandbox) step left: gradients and DDP's reduction state."""
        for obj in self.carried():
            if isinstance(obj, torch.nn.Module):
                for p in obj.parameters():
                    p.grad = None
                reducer = getattr(obj, "reducer", None)
                if reducer is not None:
                    reducer._reset_state()
            elif isinstance(obj, torch.optim.Optimizer):
                obj.zero_grad(set_to_none=True)

    def forget_script(self) -> None:
        """The script runs again from the top (a spare promoted to other ranks): what it built
        for the old ranks is no longer registered."""
        self.subgroups.clear()
        self.objects.clear()
        self.declared.clear()
        self.per_rank = self.per_rank.fresh()
        self.found_replicas = FoundReplicas()
        self.pipeline_groups = set()
