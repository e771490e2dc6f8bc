"""Hugging Face ``Trainer`` under tm-launch: ``Trainer(..., callbacks=[tm_launch.huggingface.ReportSteps()])``.

The ``Trainer`` owns its loop, so its failures are repaired in restart mode: every worker
restarts and resumes through ``trainer.train(resume_from_checkpoint=...)`` from the script's
checkpoints (``save_steps``). This callback makes that mode visible: after every optimizer step
it tells the agent the ``Trainer``'s ``global_step`` (``tm_launch.report_step``), so ``ctl
status`` shows the step, ``ctl timeline`` draws the run and its restarts, and the hang watchdog
kills a worker that stops stepping. Under plain torchrun it does nothing.
"""

from __future__ import annotations

from transformers import TrainerCallback

import tm_launch


class ReportSteps(TrainerCallback):
    """Reports the ``Trainer``'s ``global_step`` to the tm-launch agent after each optimizer step."""

    def on_step_end(self, args, state, control, **kwargs):
        tm_launch.report_step(state.global_step)
