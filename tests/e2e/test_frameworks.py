"""Framework loops under tm-launch, with the real frameworks (versions pinned in pyproject.toml's
``frameworks`` extra, installed by ``make test``): a worker SIGKILLed with a spare present ends
with exactly the parameters of the fault-free run under plain torchrun, on every rank."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from test_live import assert_bitwise
from test_restart_mode import assert_restarted_once_never_live

from tm_launch.local.localjob import REPO

pytest.importorskip("lightning")

LIGHTNING = os.path.join(REPO, "tests", "scripts", "lightning_train.py")
# Every rank holds at PAUSE until the spare parked; the victim dies at KILL. 16 steps per epoch:
# epoch 1, after the loader's new iterator moved the per-rank RNG between two steps.
PAUSE, KILL = 18, 21


def torchrun(script: str, args: list[str], timeout: float = 300) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]


@pytest.fixture(scope="module")
def lightning_reference(tmp_path_factory):
    """Every rank's final parameters of the fault-free run: the same script under torchrun (where
    LiveStrategy is Lightning's DDPStrategy, its loader iterators leaving the RNG alone)."""
    out = tmp_path_factory.mktemp("lightning-ref")
    torchrun(LIGHTNING, ["--strategy", "live", "--out-dir", str(out)])
    return {r: torch.load(out / f"rank{r}.pt") for r in (0, 1)}


def assert_spare_took_over_live(job, codes, params, reference) -> None:
    """The killed worker's node was replaced by the spare c in a live generation 1, every rank
    ends bitwise equal to ``reference``, and each process ran each step once."""
    victim = next(e["node"] for e in job.events() if e["kind"] == "worker_failed")
    survivor = ({"a", "b"} - {victim}).pop()
    assert codes["c"] == 0 and codes[survivor] == 0 and codes[victim] != 0, job.logs_tail()
    plans = [e for e in job.events() if e["kind"] == "plan" and e.get("generation") == 1]
    assert plans and plans[0]["live"] and plans[0]["replaced"] == {"c": victim}, [e.get("message") for e in job.events()]
    for rank in (0, 1):
        assert_bitwise(params[rank], reference[rank])
    assert_each_process_ran_each_step_once(job)


def assert_each_process_ran_each_step_once(job) -> None:
    """Three processes logged steps (the survivor kept its process: 2 before the fault, +1
    joiner), each a run of consecutive steps: none ran twice, none was skipped."""
    steps_by_pid: dict[int, list[int]] = {}
    for _, rank, step, _, pid in job.step_records():
        steps_by_pid.setdefault(pid, []).append(step)
    assert len(steps_by_pid) == 3, steps_by_pid
    for pid, steps in steps_by_pid.items():
        assert steps == list(range(steps[0], steps[0] + len(steps))), (pid, steps)


def run_with_spare(local_job, script: str, args: list[str], before_release=None, env=None):
    """2 active nodes + 1 spare; every rank pauses at PAUSE until the spare has parked (and
    ``before_release(job)`` ran). ``env``: more worker environment."""
    job = local_job(nnodes="2", nproc=1, script=script, launcher_args=["--max-restarts", "2"])
    if env:
        job.env = env
    trigger = os.path.join(job.workdir, "trigger")
    out = os.path.join(job.workdir, "out")
    args = [os.path.join(job.workdir, "ckpt") if a == "CKPT" else a for a in args]
    job.script_args = [
        *args,
        "--out-dir",
        out,
        "--step-log",
        job.step_log,
        "--pause-step",
        str(PAUSE),
        "--pause-file",
        trigger,
        "--kill-marker",
        os.path.join(job.workdir, "killed"),
    ]
    job.start_all(["a", "b"])
    job.wait_for(lambda s: s["generation"] is not None, 180, "generation 0")
    job.start("c")
    job.wait_parked("c", timeout=180)
    if before_release:
        before_release(job)
    open(trigger, "w").close()
    codes = job.wait(timeout=300)
    return job, codes, {r: torch.load(os.path.join(out, f"rank{r}.pt")) for r in (0, 1)}


@pytest.mark.slow  # over ~12 s on 2 cores: the fast tier keeps near 10 minutes
@pytest.mark.parametrize(
    "phase",
    [
        "backward",
        pytest.param("forward", marks=pytest.mark.slow),
        pytest.param("optimizer", marks=pytest.mark.slow),
        pytest.param("logged", marks=pytest.mark.slow),
    ],
)
def test_lightning_live_strategy_spare_takes_over_bitwise(local_job, lightning_reference, phase):
    """Trainer(strategy=LiveStrategy()): rank 1 dies at one point of a step (inside DDP's gradient
    all-reduce, before it, after the commit, after the post-step loss all-reduce). The spare,
    parked before Lightning's loop, resumes through Lightning's own restore from the live state
    (weights, momentum, LR scheduler, loop position mid-epoch, the dead rank's RNG for dropout),
    the survivor keeps its process, and every rank ends bitwise equal to torchrun's run."""
    job, codes, params = run_with_spare(local_job, LIGHTNING, ["--kill-rank", "1", "--kill-step", str(KILL), "--kill-phase", phase])
    assert_spare_took_over_live(job, codes, params, lightning_reference)


@pytest.mark.slow
def test_lightning_script_calling_init_without_the_live_strategy_restarts_bitwise(local_job, tmp_path):
    """The shape the README's `init()` invites: a Lightning script that calls tm_launch.init() and
    keeps Lightning's own DDPStrategy. Its loop cannot be repaired in place, so the job stays in
    restart mode (the spare never runs it in a sandbox, where it would train alone as some rank);
    a worker SIGKILL restarts every worker from Lightning's epoch-end checkpoint and every rank
    ends bitwise equal to the same script under torchrun."""
    ref = tmp_path / "ref"
    torchrun(LIGHTNING, ["--strategy", "ddp", "--init", "--out-dir", str(ref), "--ckpt-dir", str(tmp_path / "ref-ckpt")])
    job = local_job(nnodes="2", nproc=1, script=LIGHTNING, launcher_args=["--max-restarts", "2"])
    out = os.path.join(job.workdir, "out")
    job.script_args = [
        "--strategy",
        "ddp",
        "--init",
        "--out-dir",
        out,
        "--ckpt-dir",
        os.path.join(job.workdir, "ckpt"),
        "--kill-rank",
        "1",
        "--kill-step",
        "20",
        "--kill-marker",
        os.path.join(job.workdir, "killed"),
    ]
    job.start_all(["a", "b", "c"])
    assert_restarted_once_never_live(job, job.wait(timeout=300))
    for rank in (0, 1):
        assert_bitwise(torch.load(os.path.join(out, f"rank{rank}.pt")), torch.load(ref / f"rank{rank}.pt"))


ACCELERATE = os.path.join(REPO, "tests", "scripts", "accelerate_train.py")


@pytest.fixture(scope="module")
def accelerate_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("accelerate-ref")
    torchrun(ACCELERATE, ["--out-dir", str(out)])
    return {r: torch.load(out / f"rank{r}.pt") for r in (0, 1)}


@pytest.mark.slow
@pytest.mark.parametrize("victim_rank", [0, 1])
def test_accelerate_loop_spare_takes_over_bitwise(local_job, accelerate_reference, victim_rank):
    """An accelerate loop on job.steps(): rank 0 (the spare warmed up as rank 1, so it runs the
    script again as rank 0 and accelerate must see rank 0) or rank 1 dies before its backward.
    Every rank ends bitwise equal to the same script under torchrun; the scheduler wrapped by
    AcceleratedScheduler and the optimizer inside AcceleratedOptimizer step exactly once per step."""
    job, codes, params = run_with_spare(local_job, ACCELERATE, ["--kill-rank", str(victim_rank), "--kill-step", str(KILL)])
    assert_spare_took_over_live(job, codes, params, accelerate_reference)


HF = os.path.join(REPO, "tests", "scripts", "hf_train.py")


@pytest.mark.slow
def test_hf_trainer_restarts_from_its_checkpoint_bitwise_and_reports_its_steps(local_job, tmp_path):
    """A Hugging Face Trainer (restart mode) with ReportSteps: rank 1 is SIGKILLed at step 15,
    every worker restarts (the spare takes the node's place, it never ran the script before) and
    the Trainer resumes from checkpoint-10; every rank ends bitwise equal to torchrun's run, and
    the agents saw the steps (the status and the step series ctl timeline draws)."""
    pytest.importorskip("transformers")
    ref = tmp_path / "ref"
    torchrun(HF, ["--output-dir", str(tmp_path / "ref-ckpt"), "--out-dir", str(ref)])
    job = local_job(nnodes="2", nproc=1, script=HF, launcher_args=["--max-restarts", "2"])
    out = os.path.join(job.workdir, "out")
    job.script_args = [
        "--output-dir",
        os.path.join(job.workdir, "ckpt"),
        "--out-dir",
        out,
        "--kill-rank",
        "1",
        "--kill-step",
        "15",
        "--kill-marker",
        os.path.join(job.workdir, "killed"),
        "--step-sleep",  # the agents sample a worker's step at most once a second: give them steps to see
        "0.15",
    ]
    job.start_all(["a", "b", "c"])
    job.wait_for(
        lambda s: any(any((w.get("step") or 0) >= 5 for w in (n["progress"] or {}).values()) for n in s["nodes"]), 180, "a reported step"
    )
    assert_restarted_once_never_live(job, job.wait(timeout=300))
    for rank in (0, 1):
        assert_bitwise(torch.load(os.path.join(out, f"rank{rank}.pt")), torch.load(ref / f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def hf_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf-ref")
    torchrun(HF, ["--live", "--output-dir", str(out / "ckpt"), "--out-dir", str(out)])
    return {r: torch.load(out / f"rank{r}.pt") for r in (0, 1)}


@pytest.mark.slow
@pytest.mark.parametrize("victim_rank", [1, 0])
def test_hf_live_trainer_spare_takes_over_bitwise(local_job, hf_reference, victim_rank):
    """LiveTrainer: a worker dies before its forward at step 9; the spare, parked in train(),
    resumes through the Trainer's own resume_from_checkpoint from the state a survivor sent (at
    step 9, mid-epoch), the survivor keeps its process and runs step 9 once more; every rank ends
    bitwise equal to a plain Trainer under torchrun, and no process runs a step twice."""
    pytest.importorskip("transformers")
    job, codes, params = run_with_spare(
        local_job, HF, ["--live", "--output-dir", "CKPT", "--kill-rank", str(victim_rank), "--kill-step", str(KILL)]
    )
    assert_spare_took_over_live(job, codes, params, hf_reference)


def drain_rank_1(job) -> None:
    node = next(n["id"] for n in job.status()["nodes"] if n["ranks"] == [1])
    assert job.ctl("drain", node).returncode == 0
    job.wait_for(lambda s: s["generation"] == 1, 60, "the drain plan")


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["lightning", "hf"])
def test_drain_hands_a_framework_rank_to_the_spare_bitwise(local_job, framework, request):
    """``ctl drain`` of rank 1's node: a planned switch at a step boundary, no failure. The spare
    receives the framework's state as of that step's start, the survivor starts a new DDP, and
    every rank ends bitwise equal to the framework's own run under torchrun. Steps of >= 50 ms
    put the switch (~0.5 s of steps after the request) at most 10 steps ahead, well before the
    last of 48; the bare steps (~15 ms) put HF's at step 52: the job ended before it."""
    script, args, ref = {
        "lightning": (LIGHTNING, ["--step-sleep", "0.05"], "lightning_reference"),
        "hf": (HF, ["--live", "--output-dir", "CKPT", "--step-sleep", "0.05"], "hf_reference"),
    }[framework]
    job, codes, params = run_with_spare(local_job, script, args, before_release=drain_rank_1)
    assert all(c == 0 for c in codes.values()), job.logs_tail()
    for rank in (0, 1):
        assert_bitwise(params[rank], request.getfixturevalue(ref)[rank])
    assert_each_process_ran_each_step_once(job)


# BatchNorm: running statistics each rank updates from its own batch, never registered by the
# script (the frameworks carry them inside the model's state_dict, as a replica's).
FRAMEWORK_BN = {
    "lightning": (LIGHTNING, ["--strategy", "live"], ["--bn", "--kill-phase", "backward"]),
    "hf": (HF, ["--live", "--output-dir", "CKPT"], ["--bn"]),
    "accelerate": (ACCELERATE, [], ["--bn"]),
}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("framework", sorted(FRAMEWORK_BN))
def test_a_framework_model_with_batchnorm_recovers_exactly_when_rank_0_dies(local_job, tmp_path, framework):
    """Rank 0 (whose buffers DDP broadcasts each forward) dies mid-step; every rank's whole
    state_dict, running statistics included, equals the same script's fault-free torchrun run."""
    if framework == "hf":
        pytest.importorskip("transformers")
    script, base, extra = FRAMEWORK_BN[framework]
    ref = tmp_path / "ref"
    torchrun(
        script, [a.replace("CKPT", str(tmp_path / "ref-ckpt")) for a in base] + [a for a in extra if a == "--bn"] + ["--out-dir", str(ref)]
    )
    # One intra-op thread, as torchrun gives each of its 2 workers on one node: BatchNorm's CPU
    # backward sums in an order that depends on the thread count (accelerate sets 2 threads per
    # process on 2 cores when OMP_NUM_THREADS is unset, as for 2 nodes of 1 worker).
    job, codes, params = run_with_spare(
        local_job, script, [*base, *extra, "--kill-rank", "0", "--kill-step", str(KILL)], env={"OMP_NUM_THREADS": "1"}
    )
    assert_spare_took_over_live(job, codes, params, {r: torch.load(ref / f"rank{r}.pt") for r in (0, 1)})
