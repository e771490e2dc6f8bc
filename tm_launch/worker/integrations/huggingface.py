"""Hugging Face ``Trainer`` under tm-launch.

**Live**: ``LiveTrainer`` (a ``Trainer``; subclass it as you would subclass ``Trainer``), with
``tm_launch.init()`` as the script's first call (``TrainingArguments`` starts the process group,
so tm-launch's must exist before it). Under tm-launch its optimizer steps are live steps
(``tm_launch.worker.integrations.live_loop``): ``training_step`` (forward, backward, DDP's gradient all-reduce, the
token count all-reduce for the loss scale) runs inside a live step and runs again on the same
batch when a peer failed before the commit; the ``Trainer``'s loop then steps the optimizer and
the scheduler once. A joining rank (a spare parks in ``train()`` before the loop) receives the
``Trainer``'s checkpoint from a survivor (weights, optimizer, scheduler, ``TrainerState``) and
resumes through ``train(resume_from_checkpoint=...)``: the ``Trainer``'s own resume is what puts
its loop at the step and the batch the job is at, so the joiner writes the state it received
into a checkpoint directory in memory (``/dev/shm``), in the ``Trainer``'s layout. Its RNG is
the dead rank's (per-rank mirror). Live only with one optimizer step per batch
(``gradient_accumulation_steps=1``); otherwise restart mode, and the log says why. Under plain
torchrun it is a ``Trainer``.

**Restart mode** (any ``Trainer``): ``callbacks=[ReportSteps()]`` tells the agent the
``global_step`` after each optimizer step, so ``ctl status`` shows it, ``ctl timeline`` draws the
run and its restarts, and the hang watchdog kills a worker that stops stepping.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import tempfile

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState

import tm_launch

from ..comms import telemetry
from ..log import log
from ..torch_patches import keep_rng_across_iterators
from .live_loop import LiveLoop, final_only, live_job, new_ddp_like


class ReportSteps(TrainerCallback):
    """Reports the ``Trainer``'s ``global_step`` to the tm-launch agent after each optimizer step."""

    def on_step_end(self, args, state, control, **kwargs):
        tm_launch.report_step(state.global_step)


class LiveTrainer(Trainer):
    """A ``Trainer`` whose optimizer steps are tm-launch live steps (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._loop: LiveLoop | None = None
        self._live_state: TrainerCheckpoint | None = None

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        resume_dir = None
        job = live_job()
        if job is not None:
            received = self._join_live(job)
            if received is not None:
                resume_dir = tempfile.mkdtemp(prefix="tm-launch-hf-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
                resume_from_checkpoint = received.write(resume_dir)
                log.info(
                    f"tm_launch.huggingface: resuming the Trainer at step {received.trainer_state['global_step']} from the state received"
                )
                if self.args.dataloader_num_workers > 0:
                    log.info(
                        "tm_launch.huggingface: random numbers drawn inside the train loader's worker processes start "
                        "afresh at this step on this rank (as after any checkpoint resume)"
                    )
        try:
            result = super().train(
                resume_from_checkpoint=resume_from_checkpoint, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs
            )
        finally:
            if resume_dir:
                shutil.rmtree(resume_dir, ignore_errors=True)
        if self._loop is not None:
            self._loop.close()
        return result

    def _join_live(self, job):
        """Go live if this run can be repaired in place; a spare parks here. Returns what a
        joining rank received (a ``Received``), else None."""
        if self.args.gradient_accumulation_steps != 1:
            log.info(
                f"tm_launch.huggingface: restart mode, not live: gradient_accumulation_steps="
                f"{self.args.gradient_accumulation_steps} (a step's earlier micro-batches would be lost)"
            )
            return None
        self._loop = LiveLoop(job)
        self._live_state = TrainerCheckpoint(self)
        job.register(trainer=self._live_state)
        self._logging = LoggingState(self)
        self.add_callback(self._logging)
        job.register(per_rank=True, rng=tm_launch.RNGState(), logging=self._logging)
        job.enter_before_loop()
        return self._live_state.received

    def _save_checkpoint(self, *args, **kwargs):
        """The main process writes while the others wait at the next collective: marked as a
        checkpoint save (``Job.checkpointing``), so that a long write is not taken for a stuck rank."""
        with telemetry.checkpointing():
            return super()._save_checkpoint(*args, **kwargs)

    def _maybe_log_save_evaluate(self, *args, **kwargs):
        """After the step's logging (which moves the per-rank sums of ``LoggingState``),
        evaluation and save: what the next step starts from is mirrored now (``LiveLoop.settled``)."""
        result = super()._maybe_log_save_evaluate(*args, **kwargs)
        if self._loop is not None:
            self._loop.settled()
        return result

    def log(self, *args, **kwargs):
        """Metrics of a step whose collectives after its commit failed (the loss gathered for
        logging is then this rank's garbage) are not logged (``live_loop.final_only``)."""
        if self._loop is None:
            return super().log(*args, **kwargs)
        return final_only(self._loop.job, super().log)(*args, **kwargs)

    def get_train_dataloader(self):
        """Its iterators leave the per-rank RNG alone (``live_loop.keep_rng_across_iterators``),
        under torchrun too: a LiveTrainer draws the same random numbers wherever it runs."""
        return keep_rng_across_iterators(super().get_train_dataloader())

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self._loop is None:
            return super().training_step(model, inputs, num_items_in_batch)

        def attempt():
            count = num_items_in_batch
            if self._local_count and count is not None:  # the all-reduce inside the step
                count = self.accelerator.gather(count.to(self.args.device)).sum()
            current = self.model_wrapped if isinstance(model, DistributedDataParallel) else model
            return super(LiveTrainer, self).training_step(current, inputs, count)

        return self._loop.run(self.state.global_step, attempt, on_new_generation=self._new_ddp)

    @property
    def _local_count(self) -> bool:
        """The loss scale's token count is all-reduced inside the live step, not before it."""
        return self._loop is not None and self.args.average_tokens_across_devices and self.args.world_size > 1

    def _get_num_items_in_batch(self, batch_samples, device):
        if not self._local_count:
            return super()._get_num_items_in_batch(batch_samples, device)
        self.args.average_tokens_across_devices = False  # count locally; training_step all-reduces
        try:
            return super()._get_num_items_in_batch(batch_samples, device)
        finally:
            self.args.average_tokens_across_devices = True

    def _new_ddp(self) -> None:
        """A new generation: this rank continues with a new DDP, as a joining rank does."""
        if isinstance(self.model_wrapped, DistributedDataParallel):
            self.model_wrapped = new_ddp_like(self.model_wrapped)


class LoggingState(TrainerCallback):
    """What the ``Trainer`` logs from, per rank (``_inner_training_loop``'s logging state on the
    trainer): this rank's loss summed since the last log (``_tr_loss``, all-gathered at the next
    log), the sum drained so far (``train_loss`` at the end), the step of the last log and the
    step this ``train()`` started at (what those averages divide by). Not in the ``Trainer``'s
    checkpoint: a resumed ``Trainer`` starts them afresh, so a joiner's first logged loss (the
    mean over ranks, divided by the steps since the resume) and everyone's ``train_loss``
    differed from the fault-free run's (found by ``tm-launch rehearse``). Registered per-rank: a
    joiner continues from the lost rank's. The loop sets them when it starts, after the joiner
    received them: they are put in place then (``on_train_begin``)."""

    KEYS = ("_tr_loss", "_total_loss_scalar", "_globalstep_last_logged", "_initial_global_step")

    def __init__(self, trainer: LiveTrainer):
        self.trainer = trainer
        self.pending: dict | None = None

    def state_dict(self) -> dict:
        if self.pending is not None or not hasattr(self.trainer, "_tr_loss"):
            return dict(self.pending or {})
        t = self.trainer
        return {k: getattr(t, k).detach().clone() if isinstance(getattr(t, k), torch.Tensor) else getattr(t, k) for k in self.KEYS}

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        if hasattr(self.trainer, "_tr_loss") and self.pending is None:  # inside the loop (a step that runs again)
            self._apply(state)
        else:
            self.pending = dict(state)

    def on_train_begin(self, args, state, control, **kwargs):
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._apply(pending)

    def _apply(self, state: dict) -> None:
        t = self.trainer
        for k in self.KEYS:
            if k == "_tr_loss":
                t._tr_loss = state[k].to(t.args.device).clone()
            else:
                setattr(t, k, state[k])


class TrainerCheckpoint:
    """The ``Trainer``'s checkpoint as the one registered object. Weights and optimizer state
    travel as tensors (compared between replicas); the scheduler and the ``TrainerState`` pickled."""

    def __init__(self, trainer: LiveTrainer):
        self.trainer = trainer
        self.received: Received | None = None

    def parts(self) -> list:
        t = self.trainer
        return [m for m in (t.model_wrapped,) if isinstance(m, torch.nn.Module)] + ([t.optimizer] if t.optimizer is not None else [])

    def state_dict(self) -> dict:
        t = self.trainer
        if t._loop is None or t._loop.started is None:
            return {}  # no step has run: nothing to give (a rank still joining)
        for cb in [cb for cb in t.callback_handler.callbacks + [t.control] if isinstance(cb, ExportableState)]:
            t.state.stateful_callbacks[cb.__class__.__name__] = cb.state()  # as Trainer._save_checkpoint does
        rest = {"trainer_state": dataclasses.asdict(t.state), "scheduler": t.lr_scheduler.state_dict() if t.lr_scheduler else None}
        return {"model": t.model.state_dict(), "optimizer": t.optimizer.state_dict(), "rest": pickle.dumps(rest)}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.received = Received(state["model"], state["optimizer"], **pickle.loads(state["rest"]))


@dataclasses.dataclass
class Received:
    model: dict
    optimizer: dict
    trainer_state: dict
    scheduler: dict | None

    def write(self, root: str) -> str:
        """A checkpoint directory the ``Trainer`` resumes from (its file names and layout)."""
        from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
        from transformers.utils import WEIGHTS_NAME

        path = os.path.join(root, f"checkpoint-{self.trainer_state['global_step']}")
        os.makedirs(path)
        torch.save(self.model, os.path.join(path, WEIGHTS_NAME))
        torch.save(self.optimizer, os.path.join(path, OPTIMIZER_NAME))
        if self.scheduler is not None:
            torch.save(self.scheduler, os.path.join(path, SCHEDULER_NAME))
        with open(os.path.join(path, TRAINER_STATE_NAME), "w") as f:
            json.dump(self.trainer_state, f)
        return path
