"""Restart mode (scripts that do not use the live API, or --no-live): a spare takes the failed
node's group rank and every worker restarts at once, from the script's own checkpoint."""

import json
import os
import signal
import time

import pytest
import torch
from test_live import assert_bitwise, reference  # noqa: F401  (fixture)

STEPS = 60


def assert_restarted_once_never_live(job, codes) -> None:
    """One failed node (exit 1), the others finished; two restart-mode generations; the spare
    never ran the script in a sandbox (it would train alone as some rank)."""
    assert sorted(codes.values()) == [0, 0, 1], job.logs_tail()
    plans = [e for e in job.events() if e["kind"] == "plan"]
    assert len(plans) == 2 and not any(p["live"] for p in plans), [p["message"] for p in plans]
    assert not [e for e in job.events() if e["kind"] == "sandbox"], "a spare ran the script in a sandbox"


def _job(local_job, launcher=(), script=()):
    job = local_job(nnodes="2", nproc=1, launcher_args=["--no-live", *launcher])
    ckpt = os.path.join(job.workdir, "ckpt")
    out = os.path.join(job.workdir, "params.pt")
    job.script_args = [
        "--steps",
        str(STEPS),
        "--step-sleep",
        "0.02",
        "--ckpt-dir",
        ckpt,
        "--ckpt-every",
        "10",
        "--out",
        out,
        "--step-log",
        job.step_log,
        *script,
    ]
    return job, out


@pytest.mark.slow
def test_agent_sigkill_spare_takes_rank_same_world_size(local_job, reference):
    job, out = _job(local_job, launcher=["--max-restarts", "2"])
    job.start_all(["a", "b"])
    job.wait_for(lambda s: s["generation"] is not None, 120, "generation 0")
    job.start("c")
    job.wait_step(25)
    job.kill_agent("b")
    codes = job.wait(timeout=240)
    assert codes["a"] == 0 and codes["c"] == 0, job.logs_tail()
    plan = [e for e in job.events() if e["kind"] == "plan" and e.get("generation") == 1][0]
    assert plan["replaced"] == {"c": "b"} and not plan["live"] and sorted(plan["nodes"]) == ["a", "c"], plan
    assert_bitwise(torch.load(out), reference(2, 1, STEPS))  # resumed from the checkpoint: nothing lost


@pytest.mark.slow  # the fast tier replaces a node in restart mode in test_an_unmodified_torchrun_script_is_watched_shown_and_replaced
def test_crashing_worker_node_is_replaced_by_the_spare(local_job):
    job, out = _job(local_job, launcher=["--max-restarts", "3"], script=["--crash-node", "b", "--crash-step", "3"])
    job.start_all(["a", "b"])
    job.wait_for(lambda s: s["generation"] is not None, 120, "generation 0")  # b active, c the spare: not a join race
    job.start("c")
    codes = job.wait(timeout=240)
    assert codes["a"] == 0 and codes["c"] == 0 and codes["b"] != 0, job.logs_tail()
    assert "killed by SIGKILL" in job.nodes["b"].log()
    assert os.path.exists(out)


@pytest.mark.slow  # over ~12 s on 2 cores: the fast tier keeps near 10 minutes
def test_no_spare_and_crashing_worker_fails_clearly_when_restarts_run_out(local_job, tmp_path):
    """Also torchrun's per-agent restart count: only b's workers failed, so only b's agent starts
    a second attempt (attempt_1, TORCHELASTIC_RESTART_COUNT 1); a restarted its workers for b's
    failure and stays at attempt_0, each agent in its own <run id>_<random> log directory."""
    logs = tmp_path / "logs"
    job, out = _job(
        local_job,
        launcher=["--max-restarts", "1", "--log-dir", str(logs), "--redirects", "3"],
        script=["--crash-node", "b", "--crash-step", "2"],
    )
    job.start_all(["a", "b"])
    codes = job.wait(timeout=240)
    assert codes == {"a": 1, "b": 1}, job.logs_tail()
    assert "generation 1: job failed: max restarts (1) exhausted" in job.nodes["a"].log()  # 0 failed, 1 failed
    run_dirs = sorted(os.listdir(logs))
    assert len(run_dirs) == 2 and all(d.startswith(f"{job.run_id}_") for d in run_dirs), run_dirs
    assert sorted(sorted(os.listdir(logs / d)) for d in run_dirs) == [["attempt_0"], ["attempt_0", "attempt_1"]], run_dirs
    for d in run_dirs:
        assert (logs / d / "attempt_0" / "0" / "stderr.log").exists()


@pytest.mark.slow
def test_a_loop_without_job_steps_is_never_repaired_live(local_job, tmp_path):
    """A script that calls tm_launch.init() but runs its own loop (a framework's shape) cannot be
    substituted in place: the job stays in restart mode, the spare never runs the script in a
    sandbox (it would train alone as some rank), and a worker SIGKILL ends with exactly the
    parameters of the same script under plain torchrun."""
    import subprocess
    import sys

    from tm_launch.local.localjob import REPO

    script = os.path.join(REPO, "tests", "scripts", "plain_loop.py")
    ref = tmp_path / "ref.pt"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            script,
            "--steps",
            "30",
            "--out",
            str(ref),
            "--step-sleep",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    job = local_job(nnodes="2", nproc=1, script=script, launcher_args=["--max-restarts", "2"])
    params = os.path.join(job.workdir, "params.pt")
    job.script_args = [
        "--steps",
        "30",
        "--out",
        params,
        "--ckpt-dir",
        os.path.join(job.workdir, "ckpt"),
        "--kill-rank",
        "1",
        "--kill-step",
        "15",
        "--kill-marker",
        os.path.join(job.workdir, "killed"),
    ]
    job.start_all(["a", "b", "c"])
    assert_restarted_once_never_live(job, job.wait(timeout=240))
    assert_bitwise(torch.load(params), torch.load(ref))


def _wait_steps_in_status(job, at_least: int, timeout: float = 120) -> None:
    """Until ``ctl status`` shows a step >= ``at_least`` for nodes a and b (its STEP column)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        rows = [line.split() for line in job.ctl("status").stdout.splitlines()]
        steps = {row[0]: row[-1] for row in rows if row[:1] in (["a"], ["b"])}
        if len(steps) == 2 and all(step.isdigit() and int(step) >= at_least for step in steps.values()):
            return
        time.sleep(0.2)
    raise TimeoutError(f"ctl status never showed step {at_least} for a and b: {rows}\n{job.logs_tail()}")


def _timeline_when(job, ready, timeout: float) -> dict:
    """``ctl timeline --json`` once ``ready(data)``."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        out = job.ctl("timeline", "--json")
        if out.returncode == 0 and ready(json.loads(out.stdout)):
            return json.loads(out.stdout)
        time.sleep(0.5)
    raise TimeoutError(f"ctl timeline never showed it\n{job.logs_tail()}")


@pytest.mark.slow  # over ~12 s on 2 cores: the fast tier keeps near 10 minutes
def test_an_unmodified_torchrun_script_is_watched_shown_and_replaced(local_job, tmp_path):
    """A script that knows nothing of tm-launch (``init_process_group``, a loop of its own, no
    report): its steps are counted from its optimizer, so ``ctl status`` shows them and the hang
    watchdog kills b's SIGSTOPped worker; ``ps`` shows the worker as torchrun starts it; the spare
    takes b's ranks and every worker restarts from the checkpoint, and the plan, the log and
    ``ctl status`` say why the job is not repaired in place; b stays in ``ctl status`` as
    replaced after its agent has gone."""
    from tm_launch.local.localjob import REPO

    script = os.path.join(REPO, "tests", "scripts", "plain_loop.py")
    job = local_job(
        nnodes="2",
        nproc=1,
        script=script,
        launcher_args=["--max-restarts", "1", "--health-hang-timeout", "2", "--health-hang-warmup-steps", "0"],
    )
    out = os.path.join(job.workdir, "params.pt")
    job.script_args = [
        "--unmodified",
        "--steps",
        "300",
        "--step-sleep",
        "0.02",
        "--ckpt-dir",
        os.path.join(job.workdir, "ckpt"),
        "--out",
        out,
    ]
    job.start_all(["a", "b"])
    _wait_steps_in_status(job, 12)
    job.start("c")
    job.wait_for(lambda s: any(n["id"] == "c" and n["role"] == "spare" for n in s["nodes"]), 60, "c a spare")
    with open(f"/proc/{job.worker_pids('a')[0]}/cmdline") as f:
        title = f.read().replace("\0", " ").split()
    assert title[1:3] == ["-u", script] and "tm_launch.worker" not in title, title
    job.kill_worker("b", signal.SIGSTOP)
    codes = job.wait(timeout=240)
    assert codes == {"a": 0, "b": 1, "c": 0}, job.logs_tail()
    assert [e["node"] for e in job.events() if e["kind"] == "hang"] == ["b"], job.logs_tail()
    plan = next(e for e in job.events() if e["kind"] == "plan" and e.get("generation") == 1)
    assert plan["replaced"] == {"c": "b"} and not plan["live"] and "live loop" in plan["restart_why"], plan
    assert "restart (all workers start afresh: no worker has entered tm_launch's live loop" in plan["message"], plan
    assert os.path.exists(out)
    shown = job.ctl("status")
    assert "not live: no worker has entered tm_launch's live loop" in shown.stdout, shown.stdout
    roles = {n["id"]: (n["role"], n["reason"]) for n in job.status()["nodes"]}
    assert roles["b"] == ("replaced", "by c in generation 1"), roles


@pytest.mark.parametrize(
    "launcher", [pytest.param([], marks=pytest.mark.slow), pytest.param(["--no-live"], marks=pytest.mark.slow)], ids=["init", "no-live"]
)
def test_a_hung_restart_mode_worker_is_killed_and_every_worker_restarts(local_job, tmp_path, launcher):
    """A loop of its own that reports its steps (tests/scripts/plain_loop.py, job.report_step): no
    worker is live, yet ``ctl status`` shows each worker's step, the hang watchdog kills the
    SIGSTOPped worker of b, every worker restarts from the checkpoint, and ``ctl timeline``
    draws both ranks' steps and the restart's downtime. Under ``--no-live`` the same through a
    PlainJob. (The run is long: the test ends it once the restart is drawn.)"""
    from tm_launch.local.localjob import REPO

    job = local_job(
        nnodes="2",
        nproc=1,
        script=os.path.join(REPO, "tests", "scripts", "plain_loop.py"),
        launcher_args=["--max-restarts", "1", "--health-hang-timeout", "2", "--health-hang-warmup-steps", "0", *launcher],
    )
    job.script_args = ["--steps", "100000", "--step-sleep", "0.02", "--ckpt-dir", os.path.join(job.workdir, "ckpt")]
    job.start_all(["a", "b"])
    _wait_steps_in_status(job, 12)
    job.kill_worker("b", signal.SIGSTOP)

    def restart_drawn(data):
        change = next((g for g in data["generations"] if g["generation"] == 1), None)
        return change is not None and change["downtime_s"] is not None

    _timeline_when(job, restart_drawn, 120)
    assert [e["local_rank"] for e in job.events() if e["kind"] == "hang"] == [0], job.logs_tail()
    plans = [e for e in job.events() if e["kind"] == "plan"]
    assert [p["generation"] for p in plans] == [0, 1] and not any(p["live"] for p in plans), [p["message"] for p in plans]
    out = job.ctl("timeline", "--json", "--out", str(tmp_path / "timeline.png"))
    assert out.returncode == 0 and "1 generation change(s), 2 rank(s)" in out.stderr, out.stderr
    data = json.loads(out.stdout)
    assert sorted(data["series"]) == ["0", "1"]
    assert {s["generation"] for ss in data["series"].values() for s in ss} == {0, 1}
    change = data["generations"][1]
    assert change["kind"] == "signal" and not change["live"] and 0 < change["downtime_s"] < 60, change
