"""The data loop torchrun scripts have, *not* handed to ``job.data()`` (``tests/scripts/loop_data.py``:
``it = iter(loader)``, ``next(it)`` per step, ``set_epoch`` and a new ``iter()`` at an epoch's end;
or ``for x, y in loader:`` inside each step), live: ``tm_launch.worker.state.loop_loaders``.

Real agents, real etcd, gloo, a real SIGKILL; 2 nodes of 1 worker and 1 warm spare. A worker is
killed right after it took the last batch of an epoch, or the first of the next (its step ran
into the epoch's end and started the next pass), or half-way through a step's pass over its
loader: the survivor runs the step again (it must get the same batches), the spare takes the lost
rank (it must go on at that rank's pass and position). Every rank's whole state (parameters,
optimizer state, its global generator, its sampler's epoch) ends bitwise equal to plain torchrun's
fault-free run. A loader that cannot be exact fails the job at its first step with one line.
"""

import glob
import os

import pytest
import torch
from torchrun_reference import run_torchrun

from tm_launch.local.localjob import REPO

SCRIPT = os.path.join(REPO, "tests", "scripts", "loop_data.py")
STEPS = 30  # 6 epochs of 5 batches per rank
PAUSE = 8  # every rank holds at this step until the spare has parked
LAST_OF_EPOCH, FIRST_OF_EPOCH = 14, 15  # steps 10-14 are epoch 2's batches; step 15 meets its end and starts epoch 3


def load(prefix: str) -> dict:
    return {p.rsplit(".", 1)[1]: torch.load(p) for p in glob.glob(prefix + ".rank*")}


def assert_bitwise(got: dict, ref: dict) -> None:
    assert sorted(got) == sorted(ref), f"ranks that wrote their state: {sorted(got)}"
    for rank in sorted(ref):
        assert got[rank].keys() == ref[rank].keys(), rank
        diff = [k for k in ref[rank] if not torch.equal(got[rank][k], ref[rank][k])]
        assert not diff, f"{rank}: differs from the fault-free torchrun run in {diff}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """``get(extra) -> {rank: state}``: plain torchrun's fault-free run of the script, cached."""
    cache = {}

    def get(extra: tuple) -> dict:
        if extra not in cache:
            out = os.path.join(str(tmp_path_factory.mktemp("ref-loop")), "out")
            run_torchrun(SCRIPT, ["--steps", str(STEPS), "--out", out, *extra])
            cache[extra] = load(out)
            assert sorted(cache[extra]) == ["rank0", "rank1"]
        return cache[extra]

    return get


def run(local_job, extra: tuple, kill: tuple):
    """2 nodes x 1 worker + a parked spare; ``kill = (rank, step, phase)``."""
    job = local_job(nnodes="2", nproc=1, script=SCRIPT, launcher_args=["--max-restarts", "3"])
    job.env = {"OMP_NUM_THREADS": "1"}
    trigger = os.path.join(job.workdir, "trigger")
    rank, step, phase = kill
    job.script_args = [
        *("--steps", str(STEPS), "--out", os.path.join(job.workdir, "out"), "--step-log", job.step_log, *extra),
        *("--pause-step", str(PAUSE), "--pause-file", trigger, "--kill-rank", str(rank), "--kill-step", str(step)),
        *("--kill-phase", phase, "--kill-trigger", trigger, "--kill-marker", os.path.join(job.workdir, "killed")),
    ]
    job.start_all(["a", "b"])
    job.wait_for(lambda s: s["generation"] is not None, 180, "generation 0")
    job.start("spare")
    job.wait_parked("spare", timeout=180)
    open(trigger, "w").close()
    codes = job.wait(timeout=400)
    return job, codes, load(os.path.join(job.workdir, "out"))


@pytest.mark.slow  # over ~12 s on 2 cores: the fast tier keeps near 10 minutes
@pytest.mark.parametrize(
    "extra, kill",
    [
        pytest.param((), (1, LAST_OF_EPOCH, "forward"), id="next-last-batch-of-an-epoch"),
        pytest.param((), (0, FIRST_OF_EPOCH, "forward"), id="next-first-batch-of-the-next", marks=pytest.mark.slow),
        pytest.param((), (1, FIRST_OF_EPOCH, "vote"), id="next-first-batch-of-the-next-in-the-vote", marks=pytest.mark.slow),
        pytest.param(("--workers", "2"), (1, FIRST_OF_EPOCH, "forward"), id="next-2-workers-first-batch", marks=pytest.mark.slow),
        pytest.param(("--loop", "for"), (1, 12, "forward"), id="for-batch-in-loader-mid-pass", marks=pytest.mark.slow),
        pytest.param(("--loop", "for"), (0, 12, "logging"), id="for-batch-in-loader-after-commit", marks=pytest.mark.slow),
    ],
)
@pytest.mark.timeout(900)
def test_a_killed_rank_leaves_every_ranks_state_as_the_fault_free_torchrun_run(local_job, reference, extra, kill):
    job, codes, got = run(local_job, extra, kill)
    plans = [e for e in job.events() if e["kind"] == "plan" and e.get("generation", 0) >= 1]
    assert plans and plans[0]["live"] and list(plans[0]["replaced"]) == ["spare"], job.logs_tail()
    victim = plans[0]["replaced"]["spare"]
    assert codes[victim] != 0 and all(c == 0 for n, c in codes.items() if n != victim), job.logs_tail()
    assert not [e for e in job.events() if e["kind"] == "state_lost"], job.logs_tail()
    assert_bitwise(got, reference(extra))


@pytest.mark.slow
def test_a_loader_that_cannot_be_exact_fails_the_job_at_its_first_step_with_one_line(local_job):
    job = local_job(nnodes="2", nproc=1, script=SCRIPT, launcher_args=["--max-restarts", "3"])
    job.env = {"OMP_NUM_THREADS": "1"}
    job.script_args = ["--steps", str(STEPS), "--sampler", "random"]
    job.start_all(["a", "b"])
    codes = job.wait(timeout=240)
    assert all(c != 0 for c in codes.values()), codes
    failed = [e for e in job.events() if e["kind"] == "job_failed"]
    assert failed and "iterated inside job.steps() shuffles with a RandomSampler" in failed[0]["message"], job.logs_tail()
    assert not [e for e in job.events() if e["kind"] == "plan" and e.get("generation", 0) >= 1], "restarted"
