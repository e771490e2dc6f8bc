"""Steps of a script that never says them: counted from its optimizers (worker side).

The agent's hang watchdog, ``ctl status`` and ``ctl timeline`` read each worker's step
(``tm_launch.worker.step_report``). A live loop (``job.steps()``) and a script calling
``tm_launch.report_step`` say it; an unmodified script (a torchtitan or Megatron command run
as under torchrun) says nothing, and its workers were never watched for hangs. Live mode's
wrapper (``python -m tm_launch.worker``) therefore installs one global optimizer step hook
(``torch.optim.optimizer.register_optimizer_step_post_hook``) that reports, after every
optimizer step, the step the training is at:

* the optimizer's own count where it keeps one on the CPU (Adam, AdamW and the others that keep
  ``state[p]["step"]``): it is saved in and loaded from checkpoints, so a resumed job reports
  its real global step, as the script's own loop counts it;
* else the number of ``step()`` calls of that optimizer in this process;

and the most of these over the process's optimizers (two optimizers stepping once per
iteration, or ZeRO's wrapper and its inner optimizer, are one step). A count kept on an
accelerator is not read: ``item()`` would wait for the device at every step.

The first explicit report (``tm_launch.report_step``, ``job.steps()``) turns the hook off: a
script that counts its own steps is believed.
"""

from __future__ import annotations

import weakref


def optimizer_step(optimizer, calls: int) -> int:
    """The step ``optimizer`` is at after ``calls`` calls of its ``step()`` in this process: its
    own count when it keeps one on the CPU (loaded with a checkpoint), else ``calls``."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            count = state.get("step") if state else None
            if count is None:
                return calls
            if isinstance(count, (int, float)):
                return int(count)
            if getattr(count, "device", None) is not None and count.device.type == "cpu" and count.numel() == 1:
                return int(count.item())
            return calls
    return calls


class OptimizerSteps:
    """The global optimizer hook: reports ``report(step)`` after each optimizer step until
    ``stop()``; the step is the most any of this process's optimizers is at."""

    def __init__(self, report):
        self._report = report
        self._calls: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._last = 0
        self._handle = None

    def install(self) -> OptimizerSteps:
        from .. import torch_patches

        self._handle = torch_patches.after_every_optimizer_step(self._after_step)
        return self

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _after_step(self, optimizer, args, kwargs) -> None:
        calls = self._calls.get(optimizer, 0) + 1
        self._calls[optimizer] = calls
        step = optimizer_step(optimizer, calls)
        # A checkpoint loaded after some steps (a resumed job) moves the count back or on:
        # believe this optimizer when it is the only one, else the most of all of them.
        self._last = step if len(self._calls) == 1 else max(self._last, step)
        self._report(self._last)


_HOOK: OptimizerSteps | None = None


def install(report) -> None:
    """Count this process's optimizer steps and ``report`` them (live mode's wrapper)."""
    global _HOOK
    if _HOOK is None:
        _HOOK = OptimizerSteps(report).install()


def the_script_reports() -> None:
    """The script reports its steps itself (``tm_launch.report_step``, ``job.steps()``): stop
    counting for it."""
    global _HOOK
    if _HOOK is not None:
        _HOOK.stop()
        _HOOK = None
