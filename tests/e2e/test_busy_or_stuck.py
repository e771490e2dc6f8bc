"""Busy is not hung, end to end: real agents, etcd, gloo; nothing of the detection path mocked.

An ordinary script (``tests/scripts/ordinary.py``, every rank's whole state compared with plain
torchrun's fault-free run) does what scripts do between steps on one rank, unmarked
(``faults.BetweenSteps``): an evaluation, a ``torch.save`` then a barrier. Its peers wait for it
in a collective; the agents see its CPU time move and wait, as torch would. A rank that hangs
with no progress of any kind (a sleep, a read of a FIFO nobody writes, a Python deadlock) is
stuck: named from the collectives and its progress, replaced live by the spare within 10 s.
"""

import os

import pytest
from test_exactness import STEPS, assert_exact_and_live, differences, load, reference  # noqa: F401 - reference is a fixture

from tm_launch.local.localjob import REPO

ORDINARY = os.path.join(REPO, "tests", "scripts", "ordinary.py")
PAUSE, WORK = 8, 12

pytestmark = pytest.mark.timeout(900)


def run(local_job, work: list, spares: int, launcher: tuple = (), timeout: float = 600, nvml: bool = False):
    """2 active nodes of 1 worker + ``spares`` parked spares; ``work``: the --work-* arguments.
    ``nvml``: each agent's NVML faked at the pynvml boundary (one GPU), on which the pids listed
    in work/gpu_pids compute at 90%."""
    job = local_job(nnodes="2", nproc=1, script=ORDINARY, launcher_args=["--max-restarts", "3", *launcher])
    job.env = {"OMP_NUM_THREADS": "1"}
    out, trigger, workdir = (os.path.join(job.workdir, n) for n in ("out", "trigger", "work"))
    if nvml:
        os.makedirs(job.workdir, exist_ok=True)
        timeline = os.path.join(job.workdir, "gpu.yaml")
        with open(timeline, "w") as f:
            f.write(f"gpus: 1\ninit: {{compute_pids_file: {os.path.join(workdir, 'gpu_pids')}, compute_sm: 90}}\n")
        job.env["TM_FAKE_NVML"] = timeline
    job.script_args = ["--steps", str(STEPS), "--out", out, "--pause-step", str(PAUSE), "--pause-file", trigger]
    job.script_args += ["--work-dir", workdir, "--work-marker", os.path.join(job.workdir, "hung"), *work]
    job.start_all(["a", "b"])
    job.wait_for(lambda s: s["generation"] is not None, 120, "generation 0")
    for name in [f"s{i}" for i in range(spares)]:
        job.start(name)
        job.wait_parked(name, timeout=300)
    open(trigger, "w").close()
    codes = job.wait(timeout=timeout)
    with open(os.path.join(workdir, "started")) as f:
        started = [float(line.split()[0]) for line in f]
    return job, codes, load(out), started


def kills(job) -> list:
    return [e for e in job.events() if e["kind"] in ("culprit", "culprit_killed", "hang")]


def assert_nothing_killed(job, codes, got, ref):
    assert set(codes.values()) == {0}, job.logs_tail()
    assert kills(job) == [], kills(job)
    assert not [e for e in job.events() if e["kind"] == "plan" and e.get("generation", 0) >= 1], "no generation change"
    assert differences(got, ref) == {}, job.logs_tail()


@pytest.mark.slow  # over ~12 s on 2 cores: the fast tier keeps near 10 minutes
def test_rank_0_evaluating_alone_for_15s_is_waited_for(local_job, reference):
    """The issue's first finding: rank 0 evaluates (real forward passes) for 15 s after step 12
    while rank 1 waits in step 13's all-reduce; it used to be killed at 10 s."""
    job, codes, got, started = run(local_job, ["--work-rank", "0", "--work-step", str(WORK), "--work-seconds", "15"], spares=0)
    assert len(started) == 1
    assert_nothing_killed(job, codes, got, reference())


@pytest.mark.slow
@pytest.mark.parametrize("how, seconds", [("compute", 180), ("save", 60)])
def test_a_long_evaluation_or_save_on_one_rank_is_waited_for(local_job, reference, how, seconds):
    """3 minutes of evaluation, or a minute of ``torch.save`` then ``dist.barrier()`` on rank 0,
    with a warm spare there to take its place (it must not): nothing marked, no rank replaced,
    and a ``busy`` event says who, for how long and where."""
    work = ["--work-rank", "0", "--work-step", str(WORK), "--work-seconds", str(seconds), "--work-how", how]
    job, codes, got, _ = run(local_job, work, spares=1)
    assert_nothing_killed(job, codes, got, reference())
    if seconds >= 60:
        busy = [e for e in job.events() if e["kind"] == "busy"]
        assert busy and busy[0]["rank"] == 0 and "busy outside collectives for 1m" in busy[0]["message"], job.events()
        assert "ordinary.py" in busy[0]["message"] or "faults.py" in busy[0]["message"], busy[0]


@pytest.mark.slow
def test_the_scripts_own_timeout_ends_a_long_evaluation_as_torch_would(local_job, reference):
    """``tm_launch.init(timeout=timedelta(seconds=25))``: under torchrun rank 1's all-reduce would
    give up on an evaluating rank 0 after those 25 s (not gloo's 30 minutes). Rank 0 evaluates for
    90 s: it is blamed busy past its collective timeout a margin before the 25 s, its evidence
    names that timeout, and the spare takes its rank live; every rank ends as torchrun's run."""
    work = ["--timeout", "25", "--work-rank", "0", "--work-step", str(WORK), "--work-seconds", "90"]
    job, codes, got, started = run(local_job, work, spares=1)
    assert len(started) == 1, started  # the rank taking over joins after the step: it does not evaluate again
    assert_exact_and_live(job, codes, got, reference())
    culprits = [e for e in job.events() if e["kind"] == "culprit"]
    assert culprits and culprits[0]["ranks"] == [0] and culprits[0]["why"] == "busy past the collective timeout", job.events()
    progress = culprits[0]["evidence"]["progress"]["0"]
    assert progress["verdict"] == "busy" and progress["timeout_s"] == 25.0, progress
    killed = [e for e in job.events() if e["kind"] == "culprit_killed"]
    assert killed and 15.0 < killed[0]["time"] - started[0] < 25.0, (killed, started)


@pytest.mark.slow
def test_a_rank_waiting_on_its_busy_gpu_is_not_taken_for_a_hung_one(local_job, reference):
    """Rank 1 computes on its GPU from its first step, then waits 65 s on it after step 12 (its
    CPU asleep, its main thread still, no I/O: without NVML it is a hang, replaced within 10 s).
    The agents' NVML (faked at the pynvml boundary) shows SM samples of that pid: busy, not
    replaced, every rank as torchrun's run; a ``busy`` event names the GPU as its evidence."""
    work = ["--work-rank", "1", "--work-step", str(WORK), "--work-seconds", "65", "--work-how", "gpu"]
    job, codes, got, started = run(local_job, work, spares=1, nvml=True)
    assert len(started) == 1
    assert_nothing_killed(job, codes, got, reference())
    busy = [e for e in job.events() if e["kind"] == "busy"]
    assert busy and busy[0]["rank"] == 1 and "gpu 90%" in busy[0]["evidence"]["moved"], job.events()


@pytest.mark.slow  # over ~12 s on 2 cores: the fast tier keeps near 10 minutes
@pytest.mark.parametrize("how", ["sleep", pytest.param("fifo", marks=pytest.mark.slow), pytest.param("deadlock", marks=pytest.mark.slow)])
def test_a_rank_hung_without_progress_is_replaced_live_within_10s(local_job, reference, how):
    """After step 12 rank 1 hangs with nothing moving: the culprit rule names it ``stuck`` with
    its evidence, its agent kills it, the spare takes its rank live, and every rank ends
    exactly as torchrun's fault-free run."""
    job, codes, got, started = run(local_job, ["--work-rank", "1", "--work-step", str(WORK), "--work-how", how], spares=1)
    assert_exact_and_live(job, codes, got, reference())
    culprits = [e for e in job.events() if e["kind"] == "culprit"]
    assert culprits and culprits[0]["ranks"] == [1] and culprits[0]["why"] == "stuck", job.events()
    progress = culprits[0]["evidence"]["progress"]["1"]
    assert progress["verdict"] == "stuck" and progress["still_s"] >= 6.0, progress
    killed = [e for e in job.events() if e["kind"] == "culprit_killed"]
    assert killed and killed[0]["time"] - started[0] < 10.0, (killed, started)
    assert not [e for e in job.events() if e["kind"] == "hang"], "the culprit rule found it, not the heartbeat watchdog"


# -- a script error ends the job quickly and keeps the spares ----------------------------------------
RAISE = 12


@pytest.mark.slow  # over ~12 s on 2 cores: the fast tier keeps near 10 minutes
@pytest.mark.parametrize("ranks", ["1", pytest.param("all", marks=pytest.mark.slow)])
def test_a_script_error_ends_the_job_in_seconds_and_keeps_the_spares(local_job, ranks):
    """The script raises ValueError at step 12 on rank 1 (every attempt), or on every rank. Rank 1
    alone: its worker exits at once (no teardown waiting on its peer), the spare takes its rank
    once (a transient would have been healed), raises the same at the same step, and the job
    ends non-zero within 10 s of that second raise, the exception, the step and the rank named,
    the traceback printed once (the repeat named in one line).
    Every rank: the job ends at once, the spare never used."""
    import time

    job = local_job(nnodes="2", nproc=1, script=ORDINARY, launcher_args=["--max-restarts", "3"])
    job.env = {"OMP_NUM_THREADS": "1"}
    trigger = os.path.join(job.workdir, "trigger")
    job.script_args = [
        "--steps",
        str(STEPS),
        "--out",
        os.path.join(job.workdir, "out"),
        "--pause-step",
        str(PAUSE),
        "--pause-file",
        trigger,
    ]
    job.script_args += ["--raise-step", str(RAISE), "--raise-ranks", ranks]
    job.start_all(["a", "b"])
    job.wait_for(lambda s: s["generation"] is not None, 120, "generation 0")
    job.start("s0")
    job.wait_parked("s0", timeout=300)
    open(trigger, "w").close()
    released = time.time()
    codes = job.wait(timeout=300)
    ended = time.time()
    assert codes["a"] != 0 or codes["b"] != 0, job.logs_tail()
    events = job.events()
    raised = [e for e in events if e["kind"] == "script_error"]
    failed = [e for e in events if e["kind"] == "job_failed"]
    assert raised and failed, job.logs_tail()
    line = failed[-1]["message"]
    assert f"ValueError: bad batch at step {RAISE}" in line and "a bug in the script" in line, line
    assert all(e["evidence"]["exception"] == "ValueError" for e in raised), raised
    plans = [e for e in events if e["kind"] == "plan" and e.get("generation", 0) >= 1]
    if ranks == "all":
        assert "raised on every node" in line and "ranks 0, 1" in line, line
        assert not [p for p in plans if p.get("replaced")], "the spare is never used for a bug every rank hits"
        assert ended - raised[0]["time"] < 10, (raised[0]["time"], ended)
    else:
        assert "raised again after a replacement" in line and "rank 1" in line, line
        victim = raised[0]["node"]  # the node that holds rank 1
        assert [p["replaced"] for p in plans if p.get("replaced")] == [{"s0": victim}], plans  # one attempt
        assert len(raised) == 2 and raised[1]["node"] == "s0", raised
        logs = "".join(job.nodes[n].log() for n in ("a", "b", "s0"))
        assert logs.count("Traceback (most recent call last)") == 1, "the first raise's traceback, once"
        assert "again, the error this generation was made for" in job.nodes["s0"].log(), job.nodes["s0"].log()[-3000:]
        assert ended - raised[1]["time"] < 10, (raised[1]["time"], ended)
        assert raised[1]["time"] - raised[0]["time"] < 30, raised
    assert ended - released < 60, "torchrun took 29 s here; tm-launch used to take 143 s"


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_no_false_alarm_over_a_10_minute_run_with_long_evaluations(local_job, reference):
    """The soak: about 12 minutes fault-free (600 steps of 0.6 s), rank 0 evaluating for 65 s every
    100 steps (every 2 minutes), a warm spare waiting: zero kills, zero generation changes,
    every rank as torchrun's run."""
    work = ["--steps", "600", "--step-sleep", "0.6", "--work-rank", "0", "--work-step", "50", "--work-every", "100", "--work-seconds", "65"]
    job, codes, got, started = run(local_job, work, spares=1, timeout=1800)
    assert len(started) == 6, started
    assert_nothing_killed(job, codes, got, reference("--steps", "600"))  # the sleep and the evaluations change no state
    assert len([e for e in job.events() if e["kind"] == "busy"]) >= 6, "each evaluation said once a minute"
