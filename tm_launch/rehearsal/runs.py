"""The rehearsal's runs of the user's script on this machine, each in a directory of its own.

* **reference**: plain torchrun (``python -m torch.distributed.run --standalone``), the same
  world size, no fault: what the script does when nothing fails.
* **live**: tm-launch's live mode on a private etcd: ``nnodes`` agents of ``nproc`` workers and
  one spare (``tm_launch.local.localjob``, as the demo and the tests start them). The ranks wait
  in their first step until the spare has warmed up and parked (``TM_REHEARSAL_HOLD``), so
  every fault meets a warm spare, as a real job's should; with a fault, ``TM_FAILPOINT`` kills
  one rank's worker at one phase of one step, once (a marker file).

Every worker writes its whole state at exit (``TM_REHEARSAL_DUMP``:
``tm_launch.worker.rehearsal_dump``). Each run has its own working directory, so that relative
paths the script writes (checkpoints it would resume from, outputs) never meet another run's;
what the run left there is read after it (``files``) and compared too.
``OMP_NUM_THREADS`` is 1 unless the user set it: torchrun sets it so for several workers per
node and not for one, and a different thread count can change a CPU reduction's rounding.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field

from ..local.localjob import REPO, LocalJob
from .files import read_files

# The phases a rehearsal kills a worker at: its name -> the TM_FAILPOINT point, and what it means.
PHASES = {
    "forward": ("forward", "in the forward (a registered module's forward pre-hook)"),
    "backward": ("backward", "in the backward (gradient communication under way)"),
    "commit": ("vote", "in the commit vote (its vote counted, the decision not read)"),
    "optimizer": ("optimizer", "in the optimizer step (committed, not yet applied)"),
    "after-step": ("after-step", "after the optimizer step (its first collective after it)"),
    "between-effects": (
        "between-effects",
        "after the first of several optimizer steps in one step (its update applied, the rest of the step not run)",
    ),
}
SEVERAL_EFFECTS = ("between-effects",)  # run by default only where a step has more than one effect (several_effects)


def several_effects(dumps: dict) -> bool:
    """Whether the fault-free run's step has more than one optimizer step: the most optimizer
    steps one step had, counted as it ran, every optimizer's (an unregistered second one too;
    two that step on alternate steps count as one each: the between-effects kill is asked and
    never comes, NOT EXERCISED, where no step has two)."""
    return any(d["meta"].get("effects", 0) > 1 for d in dumps.values())


@dataclass
class Run:
    name: str
    phase: str | None = None
    victim: int | None = None
    step: int | None = None
    seconds: float = 0.0
    codes: dict = field(default_factory=dict)
    dumps: dict = field(default_factory=dict)  # rank -> dump
    files: dict | None = None  # what it left in its working directory (``files.read_files``)
    fired: bool | None = None  # the fault happened (its marker exists); None: no fault asked
    error: str | None = None  # the run itself went wrong (timeout, failed start)
    log_dir: str = ""
    tail: str = ""  # the last lines of its output, for a run that failed


def base_env(dump_dir: str) -> dict:
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "TM_REHEARSAL_DUMP": dump_dir,
    }
    env.setdefault("OMP_NUM_THREADS", "1")
    for name in ("TM_FAILPOINT", "TM_REHEARSAL_HOLD"):
        env.pop(name, None)
    return env


def read_dumps(directory: str) -> dict[int, dict]:
    import torch

    out = {}
    if not os.path.isdir(directory):
        return out
    for name in os.listdir(directory):
        if name.startswith("rank") and name.endswith(".pt"):
            try:
                dump = torch.load(os.path.join(directory, name), weights_only=False)
            except Exception:  # noqa: BLE001 -- a torn file counts as no state
                continue
            out[int(dump["meta"]["rank"])] = dump
    return out


def why(tail: str) -> str:
    """The line of a run's output that says why it failed: its last exception line (without
    torchrun's ``[rankN]:`` prefix), else its last line."""
    lines = [line.split("]: ", 1)[1] if line.startswith("[rank") and "]: " in line else line for line in tail.splitlines()]
    errors = [line.strip() for line in lines if re.match(r"\s*[\w.]*(Error|Exception|Interrupt)\b.*", line.strip())]
    return errors[-1] if errors else (lines[-1].strip() if lines else "no output")


def _tail(text: str, lines: int = 15) -> str:
    kept = [line for line in text.splitlines() if line.strip() and "registry.py" not in line]
    # torchrun's own report of a failed worker ends its output; the worker's traceback is above it
    cut = next(
        (i for i, line in enumerate(kept) if "torch.distributed.elastic" in line or line.startswith("W1") or line.startswith("E1")),
        len(kept),
    )
    return "\n".join(kept[:cut][-lines:] or kept[-lines:])


def reference(workdir: str, script: str, args: list[str], world: int, timeout: float) -> Run:
    """The script under plain torchrun, fault-free."""
    run = Run("reference", log_dir=os.path.join(workdir, "reference"))
    cwd = os.path.join(run.log_dir, "cwd")
    os.makedirs(cwd, exist_ok=True)
    dumps = os.path.join(run.log_dir, "state")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), script, *args]
    t0 = time.time()
    log = os.path.join(run.log_dir, "torchrun.log")
    try:
        with open(log, "wb") as out:
            code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=base_env(dumps), cwd=cwd, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        code, run.error = -1, f"did not finish in {timeout:.0f}s"
    run.seconds = time.time() - t0
    run.codes = {"torchrun": code}
    if code != 0 and run.error is None:
        run.error = f"exit {code}"
    with open(log, errors="replace") as f:
        run.tail = _tail(f.read())
    run.dumps = read_dumps(dumps)
    run.files = read_files(cwd)
    return run


def live(
    workdir: str,
    endpoint: str,
    name: str,
    script: str,
    args: list[str],
    nnodes: int,
    nproc: int,
    launcher_args: list[str],
    timeout: float,
    phase: str | None = None,
    victim: int | None = None,
    step: int | None = None,
) -> Run:
    """The script under tm-launch live with a warm spare; with ``phase``, rank ``victim``'s
    worker SIGKILLed at that phase of the first step >= ``step``."""
    run = Run(name, phase=phase, victim=victim, step=step, log_dir=os.path.join(workdir, name.replace(" ", "-")))
    cwd = os.path.join(run.log_dir, "cwd")
    os.makedirs(cwd, exist_ok=True)
    dumps = os.path.join(run.log_dir, "state")
    hold = os.path.join(run.log_dir, "spare-parked")
    marker = os.path.join(run.log_dir, "killed")
    env = {k: v for k, v in base_env(dumps).items() if k in ("TM_REHEARSAL_DUMP", "OMP_NUM_THREADS")}
    env["TM_REHEARSAL_HOLD"] = hold
    if phase is not None:
        env["TM_FAILPOINT"] = f"{PHASES[phase][0]}:{victim}:{step}:{marker}"
    job = LocalJob(
        endpoint=endpoint,
        run_id=f"rehearse-{uuid.uuid4().hex[:8]}",
        workdir=run.log_dir,
        nnodes=str(nnodes),
        nproc=nproc,
        launcher_args=["--max-restarts", "3", "--spares", "1", *launcher_args],
        script=script,
        script_args=list(args),
        env=env,
        cwd=cwd,
    )
    t0 = time.time()
    deadline = t0 + timeout
    try:
        job.start_all([f"node{i}" for i in range(nnodes)])
        # Polled once a second: each look is a `ctl status` process, CPU the job's workers need.
        job.wait_for(lambda s: s["generation"] is not None, max(1.0, deadline - time.time()), "the job's first generation", 1.0)
        job.start("spare")
        job.wait_parked("spare", timeout=max(1.0, deadline - time.time()), interval=1.0)
        open(hold, "w").close()
        run.codes = job.wait(timeout=max(1.0, deadline - time.time()))
    except (TimeoutError, RuntimeError) as e:
        run.error = str(e).splitlines()[0]
        open(hold, "w").close()
    finally:
        job.stop()
    run.seconds = time.time() - t0
    run.fired = os.path.exists(marker) if phase is not None else None
    run.tail = job.logs_tail(8)
    run.dumps = read_dumps(dumps)
    run.files = read_files(cwd)
    return run
