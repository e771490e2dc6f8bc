"""Live failover for PyTorch Lightning: ``Trainer(strategy=tm_launch.lightning.LiveStrategy())``.

Lightning owns the loop, so the script cannot wrap it in ``job.steps()``; this strategy makes
Lightning's own optimizer step the live step (torchrun or tm-launch restart mode: it is
Lightning's ``DDPStrategy``, nothing else changes):

* **A step** is one ``optimizer_step``. Its closure (``training_step``, backward, DDP's gradient
  all-reduce, ``self.log(..., sync_dist=True)``) runs inside a live step and the job-wide
  commit vote follows it. When a peer fails during the closure, nothing is applied: once the
  job has replaced the peer the closure runs again on the same batch, so Lightning's loop
  never counts a step that did not commit and never redoes one that did.
* **The state** a joining rank receives is Lightning's own checkpoint (``dump_checkpoint``:
  weights, optimizers, schedulers, callbacks, precision, the loops' progress as of the start
  of the step), and it resumes through Lightning's checkpoint restore, from memory: its loop
  starts at the job's step and its train loader skips the batches this epoch already used.
  Per-rank state (the RNG of the rank it replaces) comes from that rank's mirror.
* **A spare** parks in ``setup_environment``, before Lightning's loop has run (the loop must
  not start before it knows its position, so it runs no warm-up steps): imports, the model
  and the ``Trainer`` are ready when a generation names it.

Live only for what it can repair exactly: automatic optimization with one optimizer step per
batch (``accumulate_grad_batches=1``) and train loaders it can resume mid-epoch (map-style
datasets, or loaders with their own ``state_dict``). Anything else runs in restart mode, and
the log says why.
"""

from __future__ import annotations

import copy
import pickle

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, IterableDataset

import tm_launch

from ..comms import telemetry
from ..log import log
from ..torch_patches import gain_methods, keep_rng_across_iterators
from .live_loop import LiveLoop, final_only, live_job, new_ddp_like

_TENSOR_KEYS = ("state_dict", "optimizer_states")  # identical on every DDP replica: sent as tensors


def not_live_reason(trainer) -> str | None:
    """Why ``trainer``'s loop cannot be repaired in place (None: it can)."""
    module = trainer.lightning_module
    if not module.automatic_optimization:
        return "manual optimization (the forward and backward run before optimizer.step(), outside the live step)"
    if trainer.accumulate_grad_batches != 1:
        return f"accumulate_grad_batches={trainer.accumulate_grad_batches} (a step's earlier micro-batches would be lost)"
    return None


class LiveStrategy(DDPStrategy):
    """Lightning's DDP strategy whose optimizer steps are tm-launch live steps (module docstring)."""

    strategy_name = "tm_launch_live"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._loop: LiveLoop | None = None  # while this run is live
        self._state: LightningState | None = None
        self._loops_at_step_start: dict | None = None
        self._zero_grad_at_step_start: dict | None = None

    # -- set-up --------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        job = live_job()
        if job is not None:
            self._join_live(job)
        super().setup_environment()  # init_process_group: already done by tm_launch.init()

    def _join_live(self, job) -> None:
        trainer = self.lightning_module.trainer
        reason = not_live_reason(trainer)
        if reason is not None:
            log.info(f"tm_launch.lightning: restart mode, not live: {reason}")
            return
        self._loop = LiveLoop(job)
        for logger in trainer.loggers:  # no metrics of an interrupted step (``live_loop.final_only``)
            logger.log_metrics = final_only(job, logger.log_metrics)
        self._state = LightningState(self)
        job.register(lightning=self._state)
        job.register(per_rank=True, rng=tm_launch.RNGState())
        job.enter_before_loop()  # a spare parks here; promoted, it receives the state at once
        if self._state.received is not None:
            _stepped_once_more(self._state.received)
            trainer._checkpoint_connector._loaded_checkpoint = self._state.received
            log.info(
                f"tm_launch.lightning: resuming Lightning at step {self._state.received['global_step']} "
                f"(epoch {self._state.received['epoch']}) from the state received"
            )

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        """Rank 0 writes while its peers wait at Lightning's barrier: marked as a checkpoint save
        (``Job.checkpointing``), so that a long write is not taken for a stuck rank."""
        with telemetry.checkpointing():
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path, weights_only=None):
        """A joining rank resumes from the live state, not from the checkpoint the script names."""
        if self._state is not None and self._state.received is not None:
            return self._state.received
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def process_dataloader(self, dataloader):
        """Train loaders resume mid-epoch (``resumable``) and their iterators leave the per-rank
        RNG alone (``live_loop.keep_rng_across_iterators``), under torchrun too: LiveStrategy
        draws the same random numbers wherever it runs."""
        dataloader = super().process_dataloader(dataloader)
        if not isinstance(dataloader, DataLoader):
            return dataloader
        keep_rng_across_iterators(dataloader)
        if hasattr(dataloader, "state_dict"):
            return dataloader
        if isinstance(dataloader.dataset, IterableDataset):
            if self._loop is not None:
                raise RuntimeError(
                    "tm_launch.lightning.LiveStrategy cannot resume an IterableDataset mid-epoch on a joining rank: use "
                    "a map-style dataset or a loader with state_dict()/load_state_dict() (torchdata's "
                    "StatefulDataLoader), or Lightning's DDPStrategy (restart mode)"
                )
            return dataloader
        return resumable(dataloader, self.lightning_module.trainer)

    # -- the live step -------------------------------------------------------------------------
    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        trainer = self.lightning_module.trainer
        if self._loop is None:  # restart mode (or torchrun): the agent still sees the steps
            result = super().optimizer_step(optimizer, closure, model, **kwargs)
            tm_launch.report_step(trainer.global_step + 1)  # Lightning counts it when this returns
            return result
        attempts = 0

        def attempt():
            nonlocal attempts
            if attempts:  # the step runs again: its interrupted attempt's zero_grad never happened
                self._zero_grad_progress().load_state_dict(copy.deepcopy(self._zero_grad_at_step_start))
            attempts += 1
            return closure()

        result = self._loop.run(trainer.global_step, attempt, on_new_generation=self._new_ddp, on_new_step=self._snapshot_loops)
        return super().optimizer_step(optimizer, lambda: result, model, **kwargs)

    def _zero_grad_progress(self):
        """Lightning's count of ``zero_grad`` calls, which its closure makes once per attempt."""
        return self.lightning_module.trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.zero_grad

    def _snapshot_loops(self, step: int) -> None:
        """What the loops look like at the start of a step: the position a joining rank resumes at
        (and the ``zero_grad`` count a step that runs again starts from)."""
        self._loops_at_step_start = copy.deepcopy(self.lightning_module.trainer.fit_loop.state_dict())
        self._zero_grad_at_step_start = copy.deepcopy(self._zero_grad_progress().state_dict())

    def _new_ddp(self) -> None:
        """A new generation: this rank continues with a new DDP, as a joining rank does
        (``live_loop.new_ddp_like``)."""
        if isinstance(self.model, DistributedDataParallel):
            self.model = new_ddp_like(self.model)
            self._register_ddp_hooks()

    def on_train_end(self) -> None:
        if self._loop is not None:
            self._loop.close()
        super().on_train_end()


def _stepped_once_more(ckpt: dict) -> None:
    """Undo in ``ckpt`` (loops as of a step's start, inside its batch) what Lightning's restore
    adds: its training epoch loop's ``reset()`` on a restart counts the checkpoint's batch as
    stepped (``_batches_that_stepped += 1``: Lightning saves after a batch's end, before that
    count moves, unless it saved at the epoch's last batch), where this batch has not stepped
    yet and will count itself when it does. Left alone, a joining rank's loggers would log one
    step ahead of the fault-free run from then on."""
    epoch_loop = ckpt.get("loops", {}).get("fit_loop", {}).get("epoch_loop.state_dict")
    if isinstance(epoch_loop, dict) and epoch_loop.get("_batches_that_stepped", 0) > 0:
        epoch_loop["_batches_that_stepped"] -= 1


class ReportSteps(Callback):
    """Restart mode's progress for Lightning's own strategies (``Trainer(callbacks=[ReportSteps()])``):
    the agent sees the ``global_step`` after every batch (``ctl status``, ``ctl timeline``, the
    hang watchdog). ``LiveStrategy`` reports by itself."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        tm_launch.report_step(trainer.global_step)


class LightningState:
    """Lightning's checkpoint as the one registered object: what a joining rank resumes from.

    Weights and optimizer states are sent as tensors (and compared between replicas); the rest
    (callbacks, schedulers, loops, precision, hyperparameters) travels pickled, because
    per-rank values there (a callback's best score from an unsynced metric) differ between
    DDP replicas by design."""

    def __init__(self, strategy: LiveStrategy):
        self.strategy = strategy
        self.received: dict | None = None

    def parts(self) -> list:
        """What this state carries (``LiveJob`` lets these optimizers step and clears these
        gradients and DDP reducers when a step is interrupted)."""
        s = self.strategy
        return ([s.model] if s.model is not None else []) + list(s.optimizers)

    def state_dict(self) -> dict:
        s = self.strategy
        if s._loops_at_step_start is None:
            return {}  # no step has run: nothing to give (a rank still joining)
        ckpt = s.lightning_module.trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        ckpt["loops"] = {**ckpt["loops"], "fit_loop": s._loops_at_step_start}
        ckpt["global_step"] = s._loop.started
        tensors = {k: ckpt.pop(k) for k in _TENSOR_KEYS if k in ckpt}
        return {**tensors, "rest": pickle.dumps(ckpt)}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.received = {**pickle.loads(state["rest"]), **{k: state[k] for k in _TENSOR_KEYS if k in state}}


# -- train loaders resumed mid-epoch ---------------------------------------------------------------
class _Resumable:
    """What a train loader's class gains (``resumable``): its position in the epoch is part of
    Lightning's loop state, and after ``load_state_dict`` its next iterator starts after the
    batches already used (the sampler skips their indices: no batch is loaded twice)."""

    def state_dict(self) -> dict:
        trainer = self._tm_trainer
        return {"epoch": trainer.current_epoch, "batches": trainer.fit_loop.epoch_loop.batch_progress.current.processed}

    def load_state_dict(self, state: dict) -> None:
        self._tm_resume = (state["epoch"], state["batches"])

    @property
    def _index_sampler(self):
        base = DataLoader._index_sampler.fget(self)
        return _Skipping(base, self) if getattr(self, "_tm_resume", None) else base


class _Skipping:
    """The sampler of the first iterator after a resume: the epoch's first batches left out."""

    def __init__(self, base, loader):
        self.base, self.loader = base, loader

    def __len__(self) -> int:
        return len(self.base)  # the epoch's length: Lightning counts the batches left out as done

    def __iter__(self):
        resume, self.loader._tm_resume = self.loader._tm_resume, None
        epoch, batches = resume if resume is not None else (None, 0)
        if epoch != self.loader._tm_trainer.current_epoch or not 0 < batches < len(self.base):
            return iter(self.base)
        # Lightning starts a resumed run's first iterator before it sets the sampler's epoch
        # (fit_loop.setup_data, then on_advance_start): a DistributedSampler would hand out
        # epoch 0's order for the rest of the resumed epoch.
        sampler = getattr(self.loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        if self.loader.num_workers > 0:
            log.info(
                f"tm_launch.lightning: resuming the train loader at batch {batches} of epoch {epoch}: random numbers drawn "
                "inside its worker processes start afresh here (as after any checkpoint resume)"
            )
        it = iter(self.base)
        for _ in range(batches):
            next(it)
        return it


def resumable(loader: DataLoader, trainer) -> DataLoader:
    """``loader`` itself, its class swapped for one that can resume mid-epoch (``_Resumable``)."""
    gain_methods(loader, {k: v for k, v in vars(_Resumable).items() if not k.startswith("__")})
    object.__setattr__(loader, "_tm_trainer", trainer)
    object.__setattr__(loader, "_tm_resume", None)
    return loader
