"""torchtitan under tm-launch, live: ``tm-launch ... -m tm_launch.torchtitan ARGS``.

``ARGS`` are ``torchtitan.train``'s (``--module llama3 --config llama3_8b --parallelism...``);
``python -m tm_launch.torchtitan`` is ``python -m torchtitan.train`` with ``LiveTrainer`` for
torchtitan's ``Trainer``. A config of your own builds it with ``LiveTrainer.Config`` in place of
``Trainer.Config``. Under torchrun or ``tm-launch --no-live`` it is torchtitan's ``Trainer``.

Under tm-launch, torchtitan's own step (``Trainer.train_step``: every micro-batch's forward and
backward, the gradient clip, the optimizer and LR scheduler steps, the loss logging) is a live
step (``tm_launch.worker.integrations.live_loop``): a failure before its commit runs it again, job-wide, from
the batch it started with; a committed step is never applied twice. Registered with the job:

* each model part (FSDP2 / TP DTensors: the replica of an HSDP rank is its ``dp_replicate`` peer;
  a pure FSDP2 or FSDP2 x TP shard has none and comes from its in-memory snapshot), each optimizer
  of torchtitan's ``OptimizersContainer`` and each LR scheduler of its ``LRSchedulersContainer``;
* the train state's step (the job's step: a joiner's loop continues there);
* per rank: the data loader's position with the tokens seen (``DataPosition``) and the RNG.

A spare builds the whole trainer in the sandbox (model, optimizer, data loader), runs its warm-up
steps there (no checkpoint loaded or written) and parks in the next one. torchtitan's DCP
checkpoints keep working as the fallback: a checkpoint whose step had a failed collective is
removed (its metadata could hold one rank's view only), and when some rank's state exists
nowhere any more every worker restarts from the newest one.

Pipeline parallelism (``--parallelism.pipeline-parallel-degree``) is live with each stage on one
rank or on its data-parallel replicas: ``model_parts`` holds one module per stage of this rank,
each registered as above (a stage comes from its replica, else from its snapshot), and the
schedule's ``step`` inside torchtitan's step is torch's, which the live runtime handles
(``spare.pipeline_stages``).

Live only where tested exactly: synchronous checkpoints (``--checkpoint.async-mode disabled``,
torchtitan's default) and pipeline parallelism without sharding of a stage, under a tested
schedule (``pipeline_not_live_reason``); otherwise the log says why and the job runs in
restart mode (every worker restarts from torchtitan's checkpoint).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, fields

import torch
from torchtitan.components.checkpointer.base import BaseCheckpointManager
from torchtitan.distributed import ParallelDims
from torchtitan.trainer import Trainer

import tm_launch

from ...protocol import WorkerEnv
from ..comms import telemetry
from ..log import first_line, log
from ..state.transfer import FSDP_TO_SHARDED_HOOK
from ..torch_patches import keep_rng_across_iterators
from .live_loop import LiveLoop, final_only

# torchtitan's names (``--parallelism.pipeline-parallel-schedule``, matched as torch's
# ``get_schedule_class`` matches them) of the schedules run live with torchtitan or with torch's
# own stages in the tests (``spare.pipeline_stages``); another one runs in restart mode.
LIVE_PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "interleavedzerobubble")


def not_live_reason(config, world_size: int, torch_version: str = torch.__version__) -> str | None:
    """Why a torchtitan job with ``config`` on ``world_size`` ranks runs in restart mode (None:
    it can run live)."""
    if config.parallelism.pipeline_parallel_degree > 1:
        why = pipeline_not_live_reason(config.parallelism, world_size, torch_version)
        if why is not None:
            return why
    if config.checkpoint.enable and config.checkpoint.async_mode != "disabled":
        return f"--checkpoint.async-mode {config.checkpoint.async_mode} (a save in flight outlives the step that started it)"
    return None


# torch releases whose pipeline stages recover live in the tests (docs/limits.md#torchs-pipeline-stages):
# on 2.15 a stage's set-up redone after a change mismatched its neighbour's ("Received data size
# doesn't match expected size", the worker aborted).
PIPELINE_LIVE_TORCH = ("2.13", "2.14")


def pipeline_not_live_reason(parallelism, world_size: int, torch_version: str = torch.__version__) -> str | None:
    """Pipeline parallelism is live alone (each stage on one rank), under a schedule of
    ``LIVE_PIPELINE_SCHEDULES``, and with data-parallel replicas of each stage (a joiner's stage
    from its replica; FSDP's state of a step left part-way put back: ``spare.pipeline_stages``).
    Not with a stage sharded further (FSDP, TP, CP, EP): a spare's sandbox never runs a pipeline
    step (``spare.pipeline_stages``), so its first forward is torchtitan's first, whose FSDP
    all-gathers differ from a later step's (the chunked loss's output layer)."""
    release = ".".join(torch_version.split("+")[0].split(".")[:2])
    if release not in PIPELINE_LIVE_TORCH:
        return f"pipeline parallelism on torch {release} (a stage recovers live on torch {' and '.join(PIPELINE_LIVE_TORCH)} only)"
    p = parallelism
    others = p.data_parallel_replicate_degree * p.context_parallel_degree * p.tensor_parallel_degree * p.pipeline_parallel_degree
    shard = p.data_parallel_shard_degree if p.data_parallel_shard_degree > 0 else world_size // max(1, others)
    within = {
        "FSDP sharding": shard,
        "tensor parallelism": p.tensor_parallel_degree,
        "context parallelism": p.context_parallel_degree,
        "expert parallelism": p.expert_parallel_degree,
    }
    sharded = [f"{name} {degree}" for name, degree in within.items() if degree > 1]
    if sharded:
        return (
            f"pipeline parallelism with {' and '.join(sharded)} of a stage (live: each stage on one rank, or on its data-parallel replicas)"
        )
    if p.pipeline_parallel_schedule_csv:
        return "a pipeline schedule read from a CSV file (not tested live)"
    if p.pipeline_parallel_schedule.lower() not in LIVE_PIPELINE_SCHEDULES:
        return f"pipeline schedule {p.pipeline_parallel_schedule} (not tested live; live: {', '.join(LIVE_PIPELINE_SCHEDULES)})"
    return None


class LiveTrainer(Trainer):
    """torchtitan's ``Trainer`` whose steps are tm-launch live steps (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        """``Trainer.Config``; builds a ``LiveTrainer``."""

    _job = None  # the live job, when this trainer runs live
    _loop: LiveLoop | None = None
    _batches: Batches | None = None

    def init_distributed(self) -> ParallelDims:
        env = WorkerEnv.from_environ()
        live = env.live  # under tm-launch, not --no-live
        reason = not_live_reason(self.config, env.world_size) if live else None
        if reason is not None:
            log.info(f"tm_launch.torchtitan: restart mode, not live: {reason}")
        if not live or reason is not None:
            return super().init_distributed()
        prepare_process(self.config)
        self._job = tm_launch.init()
        return ParallelDims.from_config(self.config.parallelism, self._job.world_size)

    def train(self):
        if self._job is None:
            return super().train()
        self._loop = LiveLoop(self._job)
        self.checkpointer = CommittedCheckpoints(self.checkpointer, self._job)
        keep_rng_across_iterators(self.dataloader)
        # An interrupted attempt's loss and grad norm (a failed collective's garbage) and a spare's
        # warm-up steps are never written to the metrics (TensorBoard, W&B, the log line).
        self.metrics_processor.log = final_only(self._job, self.metrics_processor.log)
        result = super().train()
        # Finished: only when torchtitan's loop ended as it should. An exception out of it leaves
        # the live loop unfinished, so that the worker's non-zero exit counts as a failure.
        self._loop.close()
        return result

    def batch_generator(self, data_iterable):
        """Called by ``train()`` once, after its checkpoint load, before its loop: what the job
        carries is registered here. A spare then runs ``--sandbox-steps`` real steps in the
        sandbox and parks in its next step until a generation names it; it receives the state of
        the ranks it takes and its loop continues at the job's step. The warm-up steps matter
        beyond speed: torchtitan's first step differs from later ones in its collectives (its
        chunked loss leaves the output layer resharding after forward from the first step on:
        one more all-gather per step), so a process whose first step met the job's would wait
        forever in a collective no peer runs."""
        if self._job is None:
            return super().batch_generator(data_iterable)
        self._batches = Batches(lambda: Trainer.batch_generator(self, data_iterable))
        job = self._job
        for i, part in enumerate(self.model_parts):
            job.register(**{f"model_{i}": ModelTensors(part)})
        for i, optimizer in enumerate(self.optimizers.optimizers):
            job.register(**{f"optimizer_{i}": optimizer})
        for i, scheduler in enumerate(self.lr_schedulers.schedulers):
            job.register(**{f"lr_scheduler_{i}": scheduler})
        job.register(train_state=TrainProgress(self))
        job.register(per_rank=True, data=DataPosition(self), rng=tm_launch.RNGState())
        return self._batches

    def train_step(self, data_iterator):
        if self._loop is None:
            return super().train_step(data_iterator)
        return self._loop.run(self.step - 1, lambda: super(LiveTrainer, self).train_step(data_iterator), at_step=self._at_step)

    def _at_step(self, step: int) -> None:
        """The job runs ``step`` (0-based): torchtitan's count during it is ``step + 1``. Differs
        from the loop's own count for a spare that joined after its warm-up steps, and when
        survivors returned to an earlier step (a lost rank's newest snapshot was still on its
        way): the steps between run again inside this one."""
        if step + 1 < self.step:
            log.info(f"tm_launch.torchtitan: step {step + 1} runs again (the job returned to it from step {self.step})")
        self.step = step + 1


def prepare_process(config) -> None:
    """What torchtitan's ``init_distributed`` does to the process besides starting the process
    group: autograd without worker threads (for its device-mesh stack) and the flight recorder's
    variables. Not ``TORCH_NCCL_ASYNC_ERROR_HANDLING``: live mode keeps its own (``tm_launch.protocol``)."""
    torch.autograd.set_multithreading_enabled(False)
    comm = config.comm
    os.environ["TORCH_FR_BUFFER_SIZE"] = str(comm.trace_buf_size)
    if comm.trace_buf_size > 0:
        os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
        dump_dir = os.path.join(config.dump_folder, comm.save_traces_folder)
        os.makedirs(dump_dir, exist_ok=True)
        os.environ["TORCH_FR_DUMP_TEMP_FILE"] = f"{dump_dir}/{comm.save_traces_file_prefix}"


class Batches:
    """The trainer's batch iterator, started again from the loader's position when that position
    is loaded (a step that runs again, a joiner's first step): torchtitan's own generator holds
    an iterator that a loaded position would not move."""

    def __init__(self, start):
        self._start = start
        self._it = None

    def __iter__(self):
        return self

    def __next__(self):
        if self._it is None:
            self._it = self._start()
        return next(self._it)

    def restart(self) -> None:
        self._it = None


class DataPosition:
    """Per rank: the data loader's position and the tokens this rank has seen (torchtitan counts
    them per rank, before its logging sums them), restored together."""

    def __init__(self, trainer: LiveTrainer):
        self.trainer = trainer

    def state_dict(self) -> dict:
        return {"loader": self.trainer.dataloader.state_dict(), "ntokens_seen": self.trainer.ntokens_seen}

    def load_state_dict(self, state: dict) -> None:
        self.trainer.dataloader.load_state_dict(state["loader"])
        self.trainer.ntokens_seen = state["ntokens_seen"]
        self.trainer._batches.restart()


class ModelTensors:
    """A model part's parameters and persistent buffers as they are, for the job to carry.

    Not the module's ``state_dict()``: torchtitan's state-dict hooks reshape tensors on the way
    out (its fused QKV projection is split into q, k and v with a DTensor redistribute, a
    collective), and a recovery reads the state of one rank while its peers do something else
    (receive a snapshot, restore their own), so a collective there waits forever. Loading
    copies into the same tensors, in place (FSDP2 keeps its sharded parameters' storage).

    Both first do what FSDP2's own hook does at the start of ``state_dict()`` and
    ``load_state_dict()``: put the parameters back in their sharded form (``sharded``). A step
    dropped part-way leaves a stage unsharded (under pipeline parallelism torchtitan does not
    reshard after forward), its module then holding FSDP's plain unsharded copies: read there,
    a snapshot would keep them without their layout; loaded there, a survivor's return to its
    own snapshot failed on ``aten.copy_`` (plain into DTensor), and had the copy gone through,
    the next forward would have run on the unsharded copies of the step it returned from."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self._buffers = {  # the persistent ones, as state_dict() has them (read once: every step snapshots)
            name
            for name, _ in module.named_buffers()
            if name.rpartition(".")[2] not in module.get_submodule(name.rpartition(".")[0])._non_persistent_buffers_set
        }

    def parts(self) -> list:
        return [self.module]  # its gradients are dropped with an interrupted step's

    def state_dict(self) -> dict:
        sharded(self.module)
        state = {name: p.detach() for name, p in self.module.named_parameters()}
        state.update((name, b.detach()) for name, b in self.module.named_buffers() if name in self._buffers)
        return state

    def load_state_dict(self, state: dict) -> None:
        own = self.state_dict()
        if own.keys() != state.keys():
            raise RuntimeError(
                f"tm_launch.torchtitan: the model's tensors differ from those received: {sorted(own.keys() ^ state.keys())[:5]}"
            )
        with torch.no_grad():
            for name, tensor in own.items():
                tensor.copy_(state[name])


def sharded(module: torch.nn.Module) -> None:
    """Every FSDP2 parameter group in ``module`` in its sharded form, its unsharded copies freed
    (the next forward all-gathers them again): FSDP2's own state-dict pre-hook, run as
    ``state_dict()`` and ``load_state_dict()`` would run it; nothing where it is sharded already."""
    for m in module.modules():
        for hook in list(m._state_dict_pre_hooks.values()):
            if getattr(hook, "__qualname__", None) == FSDP_TO_SHARDED_HOOK:
                hook(m, "", False)


class TrainProgress:
    """torchtitan's step as the job carries it: the step this rank's loop is in (a joiner's
    loop is put there: ``LiveLoop.join_at``) or, outside the loop, the steps completed. Its
    ``parts()`` is the optimizer container, which steps the registered optimizers."""

    def __init__(self, trainer: LiveTrainer):
        self.trainer = trainer

    def parts(self) -> list:
        return [self.trainer.optimizers]

    def _running(self):
        loop = self.trainer._loop
        return loop if loop is not None and loop.running else None

    def state_dict(self) -> dict:
        loop = self._running()
        return {"step": loop.started if loop is not None else self.trainer.step}

    def load_state_dict(self, state: dict) -> None:
        loop = self._running()
        if loop is not None:
            loop.join_at(state["step"])  # at_step() sets torchtitan's count for each step run
        else:
            self.trainer.step = state["step"]


class CommittedCheckpoints:
    """torchtitan's checkpointer as a live job must use it (everything else passes through):

    * in the sandbox (a spare warming up) nothing is loaded or saved: a spare receives the job's
      state when it is promoted, and its collectives reach no one;
    * a save in a step one of whose collectives failed is not made, and one that such a failure
      interrupted is removed: its metadata may have been gathered from this rank alone, so a
      later restart could load it. The next interval's save is the next checkpoint."""

    def __init__(self, inner: BaseCheckpointManager, job):
        self._inner = inner
        self._job = job

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def load(self, step: int = -1) -> bool:
        if self._job.in_sandbox:
            return False
        return self._inner.load(step)

    def save(self, curr_step: int, last_step: bool = False) -> bool:
        job = self._job
        if job.in_sandbox or not getattr(self._inner, "enable", False):
            return False
        if not job.step_ok:
            if self._inner._should_save(curr_step, last_step):
                log.info(f"tm_launch.torchtitan: step {curr_step}'s checkpoint not written: a collective of that step failed")
            return False
        try:
            with telemetry.checkpointing():  # a long DCP save is not a stuck rank (Job.checkpointing)
                saved = self._inner.save(curr_step, last_step)
        except Exception as e:  # DCP's planning meets the failed step's placeholder objects
            if job.step_ok:
                raise
            saved, why = True, f" ({first_line(e)})"
        else:
            why = ""
        if saved and not job.step_ok:
            path = self._inner._create_checkpoint_id(curr_step)
            shutil.rmtree(path, ignore_errors=True)
            log.info(f"tm_launch.torchtitan: step {curr_step}'s checkpoint removed ({path}): a collective failed while it was written{why}")
            return False
        return saved


def live_config(config) -> LiveTrainer.Config:
    """torchtitan's parsed ``Trainer.Config`` as a ``LiveTrainer.Config`` (the same fields)."""
    if type(config) is not Trainer.Config:
        raise SystemExit(
            f"tm_launch.torchtitan: error: the config is a {type(config).__qualname__}, not torchtitan's Trainer.Config; "
            "build that trainer's own live variant instead (subclass tm_launch.torchtitan.LiveTrainer)"
        )
    return LiveTrainer.Config(**{f.name: getattr(config, f.name) for f in fields(config) if f.init})


def main() -> None:
    """``python -m torchtitan.train``, building a ``LiveTrainer`` (a seed checkpoint, or
    torchtitan's local-tensor mode, is ``torchtitan.train`` itself: nothing trains there)."""
    from torchtitan.config import ConfigManager
    from torchtitan.observability import structured_logger
    from torchtitan.tools.logging import init_logger

    parsed = ConfigManager().parse_args()
    if parsed.checkpoint.create_seed_checkpoint or parsed.comm.mode == "local_tensor":
        from torchtitan.train import main as torchtitan_main

        return torchtitan_main()
    init_logger()
    config = live_config(parsed)
    structured_logger.init_structured_logger(
        source="training", output_dir=config.dump_folder, enable=config.debug.enable_structured_logging
    )
    trainer = None
    try:
        trainer = config.build()
        trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
    if torch.distributed.is_initialized() and trainer is not None and trainer._job is None:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
