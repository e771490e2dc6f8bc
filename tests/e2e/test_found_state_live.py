"""State the script keeps and never registers, found and carried (issue 57, parts 2 and 3).

``tests/scripts/found_state.py`` (its loop inside ``main()``) and ``found_state_module.py`` (its
loop at module level) register their model and optimizer only and keep an EMA
(``AveragedModel``, updated after the optimizer step), a GradScaler under CPU float16 autocast
(its scale changing during the run) and ``tokens_seen``, a plain variable of the loop that
drives the learning rate. 2 nodes of one worker and a warm spare, a real SIGKILL at a point of a
step; every rank's whole state (model, optimizer, EMA, scaler, counter) must equal the same
script's fault-free run under plain torchrun, bit for bit, and the recovery must stay live.

Kill points: ``backward`` is before the commit (the survivor's vote fails, its optimizer step is
held back, its EMA update in the same body must be undone before the step runs again);
``logging`` is after it (the survivor's step commits, the loss all-reduce after its EMA update
fails, and the joiner receives the step's end state).
"""

import os

import pytest
from test_exactness import KILL, STEPS, assert_exact_and_live, load, run_live
from torchrun_reference import run_torchrun

from tm_launch.local.localjob import REPO

pytestmark = pytest.mark.timeout(900)

IN_MAIN = os.path.join(REPO, "tests", "scripts", "found_state.py")
AT_MODULE = os.path.join(REPO, "tests", "scripts", "found_state_module.py")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache = {}

    def get(script: str, *extra: str) -> dict:
        if (script, extra) not in cache:
            out = str(tmp_path_factory.mktemp("ref"))
            run_torchrun(script, ["--steps", str(STEPS), "--out", out, *extra], nproc=2)
            cache[script, extra] = load(out)
            assert sorted(cache[script, extra]) == ["rank0", "rank1"]
        return cache[script, extra]

    return get


def found_line(job) -> str:
    lines = [line for line in job.logs_tail(20000).splitlines() if "did not register" in line]
    return lines[0] if lines else ""


def surveyed(job) -> dict:
    """The replica survey's log line (``replica_survey.describe``) as object -> ranks holding one copy."""
    lines = [line for line in job.logs_tail(20000).splitlines() if "replicas found: " in line]
    out = {}
    for part in lines[0].split("replicas found: ", 1)[1].rsplit(" (", 1)[0].split("; ") if lines else []:
        names, _, shape = part.partition(": ")
        out |= {name: shape for name in names.split("+")}
    return out


@pytest.mark.slow  # over ~12 s on 2 cores: the fast tier keeps near 10 minutes
@pytest.mark.parametrize(
    "script, extra, rank, phase",
    [
        (IN_MAIN, ("--ema", "--scaler", "--tokens", "--log-loss"), 1, "backward"),
        pytest.param(IN_MAIN, ("--ema", "--log-loss"), 0, "backward", marks=pytest.mark.slow),
        pytest.param(IN_MAIN, ("--ema", "--log-loss"), 1, "logging", marks=pytest.mark.slow),
        pytest.param(IN_MAIN, ("--ema", "--log-loss"), 0, "logging", marks=pytest.mark.slow),
        pytest.param(IN_MAIN, ("--scaler", "--log-loss"), 0, "backward", marks=pytest.mark.slow),
        pytest.param(IN_MAIN, ("--tokens",), 0, "backward", marks=pytest.mark.slow),
        pytest.param(AT_MODULE, ("--tokens", "--ema", "--log-loss"), 1, "backward", marks=pytest.mark.slow),
        pytest.param(AT_MODULE, ("--tokens",), 0, "forward", marks=pytest.mark.slow),
        pytest.param(IN_MAIN, ("--ema", "--ema-per-rank", "--log-loss"), 1, "backward", marks=pytest.mark.slow),
        pytest.param(IN_MAIN, ("--teacher", "mean", "--log-loss"), 1, "backward", marks=pytest.mark.slow),
        pytest.param(IN_MAIN, ("--teacher", "frozen", "--log-loss"), 0, "logging", marks=pytest.mark.slow),
    ],
    ids=[
        "everything-r1-before",
        "ema-r0-before",
        "ema-r1-after",
        "ema-r0-after",
        "scaler-r0",
        "tokens-main-r0",
        "module-r1",
        "module-tokens-r0",
        "ema-per-rank-r1",
        "mean-teacher-r1-before",
        "frozen-teacher-r0-after",
    ],
)
def test_state_found_without_registration_recovers_exactly(local_job, reference, script, extra, rank, phase):
    job, codes, got = run_live(local_job, extra, [(rank, phase, KILL)], script=script)
    assert_exact_and_live(job, codes, got, reference(script, *extra))
    if "--ema" in extra:
        assert "ema (AveragedModel" in found_line(job), job.logs_tail()
    if "--teacher" in extra:
        assert "teacher (Sequential" in found_line(job), job.logs_tail()
    if "--ema-per-rank" in extra:  # the survey found each rank's EMA its own: the joiner took rank 1's, not rank 0's
        assert surveyed(job).get("ema") == "[0] [1]", job.logs_tail()
