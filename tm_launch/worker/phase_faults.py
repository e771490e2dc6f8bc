"""Kill points at the phases of the user's own step, for ``tm-launch rehearse``.

The runtime's failpoints (``failpoints``: ``vote``, ``snapshot``) sit inside tm-launch's own code;
a rehearsal must also kill a worker in the middle of the *script's* step, whatever the script
is, without changing it. ``TM_FAILPOINT="<point>:<rank>:<step>[:<marker>]"`` with one of these
points SIGKILLs the worker of ``<rank>`` there, at the first step >= ``<step>`` (once per job with
a marker file, whichever process holds the rank by then):

* ``forward``: the forward pre-hook of a registered module (its forward is about to run);
* ``backward``: the gradient of the output of a registered model's first module with
  parameters is being computed: the backward pass is almost done, the later layers' gradient
  communication (DDP buckets, FSDP reduce-scatters) under way;
* ``optimizer``: inside the optimizer step, after the step's job-wide commit (the runtime's own
  pre-hook takes the vote and runs first), before the update;
* ``after-step``: the first collective after the optimizer step (loss logging, a ZeRO
  broadcast), or, in a step without one, the next step's forward;
* ``between-effects``: right after the first optimizer step of a step that has several (a GAN's,
  an actor-critic's): the step committed and its first update applied, what comes before the
  second (its backward and gradient communication) not yet run. The rehearsal runs it only
  where the fault-free run registered more than one optimizer.

The commit itself is the runtime's ``vote`` point. Hooks are global torch hooks (module forward
hooks, optimizer step hooks), installed only when one of these points is armed: a normal job
runs none of this. ``at_collective`` is the one call the live group makes (a no-op unless
``after-step`` is armed and an optimizer step has run).
"""

from __future__ import annotations

import os

import torch

from . import failpoints

POINTS = ("forward", "backward", "optimizer", "after-step", "between-effects")

_ACTIVE: _Phases | None = None


def armed_point() -> str | None:
    """The phase point ``TM_FAILPOINT`` names, if it names one of ``POINTS``."""
    spec = os.environ.get("TM_FAILPOINT", "")
    point = spec.split(":", 1)[0]
    return point if point in POINTS else None


def install(job, registry, point: str) -> None:
    """Arm ``point`` for this process (``registry``: ``rehearsal_dump.Registry``)."""
    global _ACTIVE
    if _ACTIVE is not None:
        return
    _ACTIVE = _Phases(job, registry, point)
    _ACTIVE.install()


def uninstall() -> None:
    """Remove the hooks (tests; a worker keeps them for its life)."""
    global _ACTIVE
    if _ACTIVE is not None:
        for handle in _ACTIVE.handles:
            handle.remove()
    _ACTIVE = None


def at_collective() -> None:
    """A live group is about to run a collective (``groups.LiveGroup._call``)."""
    if _ACTIVE is not None and _ACTIVE.after_pending:
        _ACTIVE.after_pending = False  # fires once (its marker may say it already did, in another process)
        _ACTIVE.fire("after-step")


class _Phases:
    def __init__(self, job, registry, point: str):
        self.job, self.registry, self.point = job, registry, point
        spec = os.environ["TM_FAILPOINT"].split(":")
        self.rank, self.step = int(spec[1]), int(spec[2])
        self.after_pending = False
        self.stepped = -1  # the last step whose first optimizer step ran (between-effects)
        self.handles: list = []

    def where(self) -> tuple[int, int] | None:
        """(rank, step) while this process runs a step of the job as a rank of it; None in a
        spare's sandbox or outside a step."""
        job = self.job
        if getattr(job, "in_sandbox", False):
            return None
        state = getattr(job, "state", None)
        if state is not None:
            if state.step is None or not getattr(job, "_in_step", True):
                return None
            return job.rank, state.step
        return job.rank, self.registry.steps  # torchrun: the step the loop is in

    def targeted(self) -> tuple[int, int] | None:
        here = self.where()
        if here is None or here[0] != self.rank or here[1] < self.step:
            return None
        return here

    def fire(self, name: str) -> None:
        here = self.targeted()
        if here is not None:
            failpoints.reached(name, *here)

    def _registered(self, module) -> bool:
        return any(module is m for m in self.registry.modules())

    def install(self) -> None:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        hooks = {
            "forward": [(register_module_forward_pre_hook, self._forward_pre)],
            "backward": [(register_module_forward_hook, self._forward_post)],
            # registered after the runtime's own pre-hook (LiveJob's constructor), which takes the vote
            "optimizer": [(register_optimizer_step_pre_hook, lambda opt, args, kwargs: self.fire("optimizer"))],
            "after-step": [
                (register_module_forward_pre_hook, self._forward_pre),
                (register_optimizer_step_post_hook, self._optimizer_done),
            ],
            "between-effects": [(register_optimizer_step_post_hook, self._first_update_done)],
        }[self.point]
        self.handles = [register(hook) for register, hook in hooks]

    def _forward_pre(self, module, args):
        if not self._registered(module):
            return None
        if self.point == "forward":
            self.fire("forward")
        elif self.after_pending:  # a step without a collective after its optimizer step
            self.after_pending = False
            self.fire("after-step")
        return None

    def _first_update_done(self, optimizer, args, kwargs) -> None:
        """The first optimizer step of a step has applied its update (a re-run of the step is
        its first again)."""
        here = self.targeted()
        if here is None or self.stepped == here[1]:
            return
        self.stepped = here[1]
        self.fire("between-effects")

    def _optimizer_done(self, optimizer, args, kwargs) -> None:
        if self.targeted() is not None:
            self.after_pending = True

    def _first_layers(self) -> list:
        out = []
        for model in self.registry.modules():
            first = next((m for m in model.modules() if any(True for _ in m.parameters(recurse=False))), None)
            if first is not None:
                out.append(first)
        return out

    def _forward_post(self, module, args, output):
        if not torch.is_grad_enabled() or self.targeted() is None:
            return None
        if not any(module is m for m in self._first_layers()):
            return None
        tensors = [output] if isinstance(output, torch.Tensor) else [t for t in _leaves(output) if isinstance(t, torch.Tensor)]
        for t in tensors:
            if t.requires_grad:
                t.register_hook(self._in_backward)
                break
        return None

    def _in_backward(self, grad):
        self.fire("backward")
        return grad


def _leaves(value):
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    else:
        yield value
