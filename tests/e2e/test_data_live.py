"""The data loop a torchrun user writes (``tests/scripts/data_loop.py``: ``batches = job.data(loader)``,
``next(batches)`` per step, a shuffled ``DistributedSampler``, several epochs), live.

Real agents, real etcd, gloo, a real SIGKILL; 2 nodes of 1 worker and 1 warm spare. A worker is
killed right after it took the last batch of an epoch, or the first of the next: the survivor runs
the step again (it must get the same batch) and the spare takes the lost rank (it must go on at
that rank's epoch and position). Every rank's whole state (parameters, optimizer state, its
generator, its data position) ends bitwise equal to plain torchrun's fault-free run.
"""

import glob
import os

import pytest
import torch
from torchrun_reference import run_torchrun

from tm_launch.local.localjob import REPO

SCRIPT = os.path.join(REPO, "tests", "scripts", "data_loop.py")
STEPS = 30  # 6 epochs of 5 batches per rank
PAUSE = 8  # every rank holds at this step until the spare has parked
LAST_OF_EPOCH, FIRST_OF_EPOCH = 14, 15  # steps 10-14 are epoch 2's batches, 15 is epoch 3's first


def load(prefix: str) -> dict:
    return {p.rsplit(".", 1)[1]: torch.load(p) for p in glob.glob(prefix + ".rank*")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """``get(extra) -> {rank: state}``: plain torchrun's fault-free run of the script, cached."""
    cache = {}

    def get(extra: tuple) -> dict:
        if extra not in cache:
            out = os.path.join(str(tmp_path_factory.mktemp("ref-data")), "out")
            run_torchrun(SCRIPT, ["--steps", str(STEPS), "--out", out, *extra])
            cache[extra] = load(out)
            assert sorted(cache[extra]) == ["rank0", "rank1"]
        return cache[extra]

    return get


def run(local_job, extra: tuple, kill: tuple | None = None, spare: bool = True):
    """2 nodes x 1 worker (+ a parked spare); ``kill = (rank, step, phase)``."""
    job = local_job(nnodes="2", nproc=1, script=SCRIPT, launcher_args=["--max-restarts", "3"])
    job.env = {"OMP_NUM_THREADS": "1"}
    trigger = os.path.join(job.workdir, "trigger")
    args = ["--steps", str(STEPS), "--out", os.path.join(job.workdir, "out"), "--step-log", job.step_log, *extra]
    if kill:
        rank, step, phase = kill
        args += ["--pause-step", str(PAUSE), "--pause-file", trigger, "--kill-rank", str(rank), "--kill-step", str(step)]
        args += ["--kill-phase", phase, "--kill-trigger", trigger, "--kill-marker", os.path.join(job.workdir, "killed")]
    job.script_args = args
    job.start_all(["a", "b"])
    job.wait_for(lambda s: s["generation"] is not None, 180, "generation 0")
    if spare:
        job.start("spare")
        job.wait_parked("spare", timeout=180)
    open(trigger, "w").close()
    codes = job.wait(timeout=400)
    return job, codes, load(os.path.join(job.workdir, "out"))


def assert_bitwise(got: dict, ref: dict) -> None:
    assert sorted(got) == sorted(ref), f"ranks that wrote their state: {sorted(got)}"
    for rank in sorted(ref):
        assert got[rank].keys() == ref[rank].keys(), rank
        diff = [k for k in ref[rank] if not torch.equal(got[rank][k], ref[rank][k])]
        assert not diff, f"{rank}: differs from the fault-free torchrun run in {diff} (data position {got[rank]['data'].tolist()})"


@pytest.mark.slow  # over ~12 s on 2 cores: the fast tier keeps near 10 minutes
@pytest.mark.parametrize(
    "extra, kill",
    [
        pytest.param((), (1, LAST_OF_EPOCH, "forward"), id="plain-last-batch-of-an-epoch"),
        pytest.param((), (0, FIRST_OF_EPOCH, "forward"), id="plain-first-batch-of-the-next", marks=pytest.mark.slow),
        pytest.param((), (1, FIRST_OF_EPOCH, "vote"), id="plain-first-batch-of-the-next-in-the-vote", marks=pytest.mark.slow),
        pytest.param(("--loader", "stateful"), (1, LAST_OF_EPOCH, "forward"), id="stateful-last-batch", marks=pytest.mark.slow),
        pytest.param(
            ("--loader", "stateful"), (0, FIRST_OF_EPOCH, "logging"), id="stateful-first-batch-after-commit", marks=pytest.mark.slow
        ),
        pytest.param(("--loader", "iterable"), (1, FIRST_OF_EPOCH, "forward"), id="iterable-dataset-first-batch", marks=pytest.mark.slow),
        pytest.param(("--workers", "2"), (1, FIRST_OF_EPOCH, "forward"), id="plain-2-workers-first-batch", marks=pytest.mark.slow),
        pytest.param(
            ("--loader", "stateful", "--workers", "2"), (0, LAST_OF_EPOCH, "forward"), id="stateful-2-workers", marks=pytest.mark.slow
        ),
    ],
)
@pytest.mark.timeout(900)  # a live run and a torchrun run; DataLoader workers start with every epoch (> 300 s on a loaded 2-core machine)
def test_a_killed_rank_leaves_every_ranks_data_and_state_as_the_fault_free_torchrun_run(local_job, reference, extra, kill):
    job, codes, got = run(local_job, extra, kill)
    plans = [e for e in job.events() if e["kind"] == "plan" and e.get("generation", 0) >= 1]
    assert plans and plans[0]["live"] and list(plans[0]["replaced"]) == ["spare"], job.logs_tail()
    victim = plans[0]["replaced"]["spare"]
    assert codes[victim] != 0 and all(c == 0 for n, c in codes.items() if n != victim), job.logs_tail()
    assert not [e for e in job.events() if e["kind"] == "state_lost"], job.logs_tail()
    assert_bitwise(got, reference(extra))


@pytest.mark.parametrize(
    "extra, says",
    [
        (("--loader", "random"), "job.data(): the DataLoader's sampler RandomSampler is not a function of (seed, epoch, rank)"),
        (("--loader", "stateful", "--register-loader"), "job.register(data=<StatefulDataLoader>) cannot rewind the iterator"),
    ],
)
def test_a_loader_that_cannot_be_exact_fails_the_job_with_one_line(local_job, extra, says):
    """Refused when the loader is handed over (or registered): the job fails at once, with the
    worker's one line, and is not restarted."""
    job = local_job(nnodes="2", nproc=1, script=SCRIPT, launcher_args=["--max-restarts", "3"])
    job.env = {"OMP_NUM_THREADS": "1"}
    job.script_args = ["--steps", str(STEPS), *extra]
    job.start_all(["a", "b"])
    codes = job.wait(timeout=240)
    assert all(c != 0 for c in codes.values()), codes
    failed = [e for e in job.events() if e["kind"] == "job_failed"]
    assert failed and says in failed[0]["message"], job.logs_tail()
    assert not [e for e in job.events() if e["kind"] == "plan" and e.get("generation", 0) >= 1], "restarted"
