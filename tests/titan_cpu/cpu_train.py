"""torchtitan's own ``torchtitan.train.main`` on CPU: ``python cpu_train.py ARGS`` is
``python -m torchtitan.train ARGS`` on a machine without GPUs.

torchtitan 0.3.0 with torch 2.13 assumes an accelerator; on CPU it needs the workarounds measured
in ARCHITECTURE.md ("torchtitan 0.3.0 on CPU with torch 2.13") and nothing more (forcing the
device also takes a stand-in for the memory statistics ``torch.cuda`` has; pipeline parallelism
takes torch 2.14's microbatch API on 2.13's schedules). Each one is a
function below, applied before torchtitan builds anything; the trainer, its loop, its
checkpointer and its command line are torchtitan's, unchanged. The workarounds are test
scaffolding for a CPU-only machine: on GPUs a torchtitan user runs ``-m torchtitan.train``
directly.

Also, for the tests (inert unless the variables are set):

- ``TT_KILL_RANK`` / ``TT_KILL_STEP`` / ``TT_KILL_MARKER``: that rank SIGKILLs itself once, right
  after its optimizer step ``TT_KILL_STEP`` (before that step's checkpoint; ``TT_KILL_PHASE=forward``:
  at the start of that step's forward; ``microbatch``: in its first model part's forward of the
  step's second microbatch, mid-pipeline), and creates the marker
  file so that the restarted run does not kill again. With ``TT_KILL_AFTER`` (a path) every
  rank first waits there for that file, so that a test can hold the kill until its spare has joined.
- ``TT_KILL2_RANK`` / ``TT_KILL2_STEP`` / ``TT_KILL2_MARKER`` / ``TT_KILL2_AFTER``: a second kill
  of the same kind, later in the same run (two faults in a row).
- ``TT_HOLD_STEP`` / ``TT_HOLD_UNTIL``: every rank waits after that step until the file exists
  (a test's spare parks before the job goes on).
- ``TT_LIVE=1``: ``tm_launch.torchtitan``'s entry (live mode) in place of ``torchtitan.train``'s.
- ``TT_STEP_LOG``: each rank appends ``time rank step restart pid`` after each step, the format
  ``tm_launch.local.localjob`` reads for its downtime measure.
- ``TT_COMPILE_LOG``: each process appends one JSON line per step it runs, a spare's warm-up
  steps included (``tests/scripts/compile_records.py``): what Dynamo has compiled so far, the count a test of
  ``--compile.enable`` compares (a recompile is one more graph) and the seconds a benchmark reads.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import types
from datetime import timedelta

import torch
import torch._utils
import torch.distributed as dist


class CpuDeviceModule(types.SimpleNamespace):
    """What torchtitan calls on its ``device_module`` (``torch.cuda`` on GPUs), for the CPU:
    ``torch.cpu`` has no memory statistics or device properties, which torchtitan's memory
    monitor and MFU estimate read. The numbers are placeholders (zero peak memory, the host's
    RAM as capacity): only logged, never used for a decision."""

    def __init__(self):
        super().__init__(
            set_device=torch.cpu.set_device,
            current_device=lambda: 0,
            device_count=lambda: 1,
            synchronize=torch.cpu.synchronize,
            is_available=lambda: True,
            get_device_name=lambda device=None: "cpu",
            get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=_host_memory(), name="cpu"),
            memory_stats=lambda device=None: {},
            reset_peak_memory_stats=lambda device=None: None,
            empty_cache=lambda: None,
        )


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def force_cpu_device() -> None:
    """torchtitan picks its device once, at import of ``torchtitan.tools.utils``
    (``_get_available_device_type() or "cuda"``) and every module imports the result by name, so
    the choice is made there: while that module is imported, torch reports "cpu" with the module
    above. torchtitan then gets ``cpu`` devices and, from torch's backend map, gloo."""
    if "torchtitan.tools.utils" in sys.modules:
        raise RuntimeError("force_cpu_device() must run before torchtitan is imported")
    saved = torch._utils._get_available_device_type, torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda device_type=None: CpuDeviceModule()
    try:
        import torchtitan.tools.utils  # noqa: F401
    finally:
        torch._utils._get_available_device_type, torch._utils._get_device_module = saved


def alias_set_timeout() -> None:
    """torchtitan lowers every group's timeout after the first step with
    ``torch.distributed.set_timeout``, which torch 2.13 does not have; ``_set_pg_timeout`` is
    the same operation under its private name."""
    if not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        def set_timeout(timeout: timedelta, group=None) -> None:
            _set_pg_timeout(timeout, group)

        dist.set_timeout = set_timeout


def sdpa_attention() -> None:
    """FlexAttention has no CPU backward in torch 2.13: the llama3 model spec gets SDPA as its
    inner attention (causal, maskless; torchtitan's trainer then builds no block masks).
    Patched where llama3's layer builder looks the function up, before any config is built."""
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common.attention import ScaledDotProductAttention

    real = llama3.get_attention_config

    def get_attention_config(backend: str):
        if backend == "flex":
            return ScaledDotProductAttention.Config()
        return real(backend)

    llama3.get_attention_config = get_attention_config


def fsdp_force_sum() -> None:
    """gloo has no ``PREMUL_SUM``, which FSDP2 uses to scale gradients in its reduce-scatter:
    every module torchtitan shards gets ``set_force_sum_reduction_for_comms(True)`` (a plain sum,
    the scaling done apart), set by wrapping ``fully_shard`` where torchtitan calls it."""
    import torchtitan.distributed.fsdp as tt_fsdp
    from torch.distributed.fsdp import FSDPModule

    real = tt_fsdp.fully_shard

    def fully_shard(module, *args, **kwargs):
        sharded = real(module, *args, **kwargs)
        for m in module if isinstance(module, list) else [module]:  # a list: one FSDP unit of several modules
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
        return sharded

    tt_fsdp.fully_shard = fully_shard
    for name, mod in list(sys.modules.items()):
        if name.startswith("torchtitan.") and getattr(mod, "fully_shard", None) is real:
            mod.fully_shard = fully_shard


def partial_dtensor_default() -> None:
    """torchtitan's default SPMD backend (``spmd_types``) fails under torch 2.13's FSDP2 ("all
    parameters must be DTensors on the full SPMD mesh"); ``partial_dtensor`` (DTensor for the
    model-parallel axes only) works. Set on the config the registry function returns, before the
    command line is applied, so ``--parallelism.spmd-backend`` still wins."""
    from torchtitan.config.manager import ConfigManager

    real = ConfigManager._load_config

    def _load_config(self, args):
        config, rest = real(self, args)
        config.parallelism.spmd_backend = "partial_dtensor"
        return config, rest

    ConfigManager._load_config = _load_config


def pipeline_microbatch_api() -> None:
    """torchtitan 0.3.0 hands its pipeline schedule the step's microbatches already split
    (``step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)``, torch 2.14's API); torch 2.13's
    ``step`` takes the whole batch and splits it itself along dim 0 (its default chunk spec), so
    under 2.13 every pipeline-parallel torchtitan run fails in its first step ("Expecting 2
    arg_mbs but got 1"). Each schedule torchtitan builds gets a ``step`` that also takes the
    microbatches: concatenated again along dim 0, which torch 2.13 splits back into views of the
    same rows, the same numbers. Nothing is done on a torch whose ``step`` takes them."""
    import inspect

    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    if "arg_mbs" in inspect.signature(PipelineScheduleSingle.step).parameters:
        return
    import torchtitan.distributed.pipeline_parallel as tt_pp

    real = tt_pp._build_pipeline_schedule

    def whole(parts: list, what: str):
        if not all(isinstance(p, torch.Tensor) for p in parts):
            raise TypeError(f"cpu_train.pipeline_microbatch_api: {what} holds a value that is not a tensor")
        return torch.cat(parts)

    def _build_pipeline_schedule(**kwargs):
        schedule = real(**kwargs)

        def step_with_microbatches(*args, arg_mbs=None, kwarg_mbs=None, target_mbs=None, **step_kwargs):
            if arg_mbs:
                args = tuple(whole(list(column), "arg_mbs") for column in zip(*arg_mbs))
            if kwarg_mbs and any(kwarg_mbs):
                step_kwargs.update({k: whole([mb[k] for mb in kwarg_mbs], f"kwarg_mbs[{k!r}]") for k in kwarg_mbs[0]})
            if target_mbs is not None:
                step_kwargs["target"] = whole(list(target_mbs), "target_mbs")
            # the class's step, looked up now: tm-launch's live runtime wraps it later (in its first step)
            return type(schedule).step(schedule, *args, **step_kwargs)

        schedule.step = step_with_microbatches
        return schedule

    tt_pp._build_pipeline_schedule = _build_pipeline_schedule


KILLS = ("TT_KILL", "TT_KILL2")  # the variables' prefixes of the first kill and of a second one


def kill_step(step: int, env: dict, kill: str = "TT_KILL") -> bool:
    """Whether ``step`` is the step of the kill whose variables start with ``kill``, still to
    come: its marker file does not exist yet (a restarted run passes the step again)."""
    if not env.get(f"{kill}_STEP"):
        return False
    marker = env.get(f"{kill}_MARKER")
    return step == int(env[f"{kill}_STEP"]) and not (marker and os.path.exists(marker))


def kill_point(rank: int, step: int, env: dict, kill: str = "TT_KILL") -> bool:
    """Whether this rank kills itself at ``step``: the kill's step (``kill_step``) and its rank."""
    return kill_step(step, env, kill) and rank == int(env.get(f"{kill}_RANK", "0"))


def hold_for_kill(step: int, env: dict, kill: str) -> None:
    """Every rank, not only the victim, waits for ``<kill>_AFTER`` where the kill comes: a
    victim held alone while its peers waited for it in a collective was, once the spare took
    seconds to park (a loaded machine), a rank stuck outside the collective to tm-launch's culprit
    rule (nothing of it moved), and was killed as hung before the test's own kill."""
    if kill_step(step, env, kill):
        wait_for_file(env.get(f"{kill}_AFTER"), timeout=300)


def wait_for_file(path: str | None, timeout: float) -> None:
    deadline = time.time() + timeout
    while path and not os.path.exists(path):
        if time.time() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)


def in_sandbox() -> bool:
    import tm_launch

    return tm_launch.init().in_sandbox


def kill_now(kill: str = "TT_KILL") -> None:
    """The kill: once ``<kill>_AFTER`` exists, after creating the marker."""
    wait_for_file(os.environ.get(f"{kill}_AFTER"), timeout=300)
    marker = os.environ.get(f"{kill}_MARKER")
    if marker:
        open(marker, "w").close()
    os.kill(os.getpid(), signal.SIGKILL)


def kill_in_second_forward(module, kill: str) -> None:
    """The kill at the start of ``module``'s second forward from now: under pipeline parallelism
    the forward of this rank's first stage for the step's second microbatch, while the first one's
    activations (or, on a last stage, its backward) are with the neighbour."""
    calls = [0]

    def pre_hook(*_):
        calls[0] += 1
        if calls[0] == 2:
            kill_now(kill)

    module.register_forward_pre_hook(pre_hook)


def install_test_hooks() -> None:
    """The step log and the kill, after each ``Trainer.train_step`` (optimizer step done,
    checkpoint of that step not yet written); with ``TT_KILL_PHASE=forward``, the kill comes
    at the start of the step's forward instead (before its optimizer step: not committed)."""
    from torchtitan.trainer import Trainer

    scripts = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
    if scripts not in sys.path:
        sys.path.append(scripts)  # compile_records (last: nothing of torchtitan's is shadowed)
    real, real_forward = Trainer.train_step, Trainer.forward_backward_step

    def forward_backward_step(self, *args, **kwargs):
        for kill in KILLS:
            phase = os.environ.get("TT_KILL_PHASE")
            if phase in ("forward", "microbatch") and kill_step(self.step, os.environ, kill):
                if os.environ.get("TT_LIVE") == "1" and in_sandbox():
                    continue
                hold_for_kill(self.step, os.environ, kill)
                if kill_point(dist.get_rank(), self.step, os.environ, kill):
                    if phase == "forward":
                        kill_now(kill)
                    kill_in_second_forward(self.model_parts[0], kill)
        return real_forward(self, *args, **kwargs)

    def train_step(self, *args, **kwargs):
        started = time.time()
        out = real(self, *args, **kwargs)
        sandbox = os.environ.get("TT_LIVE") == "1" and in_sandbox()
        rank = dist.get_rank()
        if os.environ.get("TT_COMPILE_LOG"):
            from compile_records import append, compile_record  # tests/scripts/compile_records.py

            append(os.environ["TT_COMPILE_LOG"], compile_record(rank, self.step, sandbox, started))
        if sandbox:
            return out  # a spare's warm-up step: not a step of the job
        log = os.environ.get("TT_STEP_LOG")
        if log:
            with open(log, "a") as f:
                f.write(f"{time.time():.6f} {rank} {self.step} {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} {os.getpid()}\n")
        if os.environ.get("TT_HOLD_STEP") == str(self.step):
            wait_for_file(os.environ.get("TT_HOLD_UNTIL"), timeout=300)
        for kill in KILLS:
            if os.environ.get("TT_KILL_PHASE", "after-step") == "after-step" and kill_step(self.step, os.environ, kill):
                hold_for_kill(self.step, os.environ, kill)
                if kill_point(rank, self.step, os.environ, kill):
                    kill_now(kill)
        return out

    Trainer.train_step, Trainer.forward_backward_step = train_step, forward_backward_step


def apply_cpu_workarounds() -> None:
    """All of them, in order: the device before torchtitan is imported, the rest before it
    parses its command line and builds its config."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    force_cpu_device()
    alias_set_timeout()
    partial_dtensor_default()
    sdpa_attention()
    fsdp_force_sum()
    pipeline_microbatch_api()


if __name__ == "__main__":
    # A spare promoted to ranks other than the ones it warmed up as runs this file again in the
    # same process (tm_launch.worker): torchtitan is imported and patched by then.
    # The workarounds are called from this file imported as a module: this run's ``__main__``
    # globals are cleared before the next run, and torchtitan keeps using what they installed.
    if "torchtitan.tools.utils" not in sys.modules:
        import cpu_train

        cpu_train.apply_cpu_workarounds()
        cpu_train.install_test_hooks()
    if os.environ.get("TT_LIVE") == "1":  # python -m tm_launch.torchtitan (live mode)
        from tm_launch.torchtitan import main
    else:  # python -m torchtitan.train
        from torchtitan.train import main

    main()
