"""``job.report_step`` / ``tm_launch.report_step``: restart mode's progress, written to a real
agent store (a TCPStore, as the agent's), in-process or from a real worker process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from tm_launch.local.localjob import REPO
from tm_launch.protocol import WorkerEnv
from tm_launch.worker.agent_client import AgentClient
from tm_launch.worker.step_report import STATUS_INTERVAL, StepReporter, StepStats


@pytest.fixture
def agent_store():
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    yield store


def status(store) -> dict:
    return json.loads(store.get("worker/0/status"))


def test_straggler_windows_sum_each_steps_compute_and_only_complete_ones_are_reported():
    """The straggler statistic's input: each rank sums its compute time into windows of
    ``straggler_window`` steps and reports a window once it is complete (the agent compares a
    window once every rank reported it: ``StragglerWatch.check``); old windows are dropped."""
    stats = StepStats(window=2)
    stats.record(0, 1.0)
    assert stats.report(1)["windows"] == {}  # window 0 is not complete yet
    stats.record(1, 1.5)
    assert stats.report(2)["windows"] == {"0": 2.5}
    stats.record(3, 0.5, steps=2)  # steps 2 and 3 reported together: 0.5 s each
    assert stats.report(4)["windows"] == {"0": 2.5, "1": 1.0}
    for step in range(4, 12):
        stats.record(step, 1.0)
    assert stats.report(12)["windows"] == {"2": 2.0, "3": 2.0, "4": 2.0, "5": 2.0}  # windows 0 and 1 dropped


def test_reports_are_rate_limited_and_carry_the_step_times(agent_store):
    channel = AgentClient(WorkerEnv(agent_store=f"127.0.0.1:{agent_store.port}", local_rank=0))
    try:
        reporter = StepReporter(channel, rank=3, generation=2, window=2)
        reporter.step(1)
        t1 = time.perf_counter()
        first = status(agent_store)  # the first report is written at once: the worker runs
        assert (first["state"], first["step"], first["rank"], first["generation"], first["steps_run"]) == ("running", 1, 3, 2, 0)
        for step in range(2, 6):
            time.sleep(0.01)
            reporter.step(step)
        assert status(agent_store)["step"] == 1  # no store write per step
        time.sleep(STATUS_INTERVAL)
        reporter.step(8)  # one report for three steps, written by the heartbeat thread
        elapsed = time.perf_counter() - t1
        deadline = time.monotonic() + 10
        while status(agent_store)["step"] != 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        s = status(agent_store)
        assert (s["step"], s["steps_run"]) == (8, 5)
        assert all(t >= 0.009 for t in s["step_times"][:4]) and s["step_times"][4] >= STATUS_INTERVAL / 3
        assert sum(s["windows"].values()) == pytest.approx(elapsed, rel=0.05)  # every step's time, once
        reporter.step(8)
        assert reporter.stats.step_times == s["step_times"]  # a repeated report is not a step
        assert agent_store.check(["worker/0/beat"])  # the channel's heartbeat runs
        reporter.exiting()
        assert (status(agent_store)["state"], status(agent_store)["step"]) == ("exiting", 8)
    finally:
        channel.close()


def test_a_report_never_breaks_the_loop_when_the_agent_is_gone():
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    channel = AgentClient(WorkerEnv(agent_store=f"127.0.0.1:{store.port}", local_rank=0))
    reporter = StepReporter(channel, rank=0, generation=0, window=20)
    reporter.step(1)
    del store  # the agent's store goes away
    time.sleep(0.1)
    reporter.step(2)
    for step in range(3, 40):  # the heartbeat thread's write fails; a later report learns it
        time.sleep(STATUS_INTERVAL)
        reporter.step(step)
        if reporter.agent_gone:
            break
    reporter.exiting()
    assert reporter.agent_gone
    channel.close()


WORKER = r"""
import os, sys
import torch.distributed as dist
import tm_launch
from tm_launch.worker import step_report
how = sys.argv[1]
if how == "init":
    job = tm_launch.init()
    print("job", type(job).__name__, flush=True)
    for step in job.steps(3):
        pass
elif how in ("ended", "left"):  # the loop stops at step 2 of 10, saying so first or not
    job = tm_launch.init()
    for step in job.steps(10):
        if step == 2:
            if how == "ended":
                job.end_loop()
            break
else:  # a script that never calls tm_launch.init()
    dist.init_process_group("gloo")
    tm_launch.report_step(1)
    tm_launch.report_step(2)
print("channel", step_report._PROCESS is not None, flush=True)
"""


def run_worker(how: str, agent_env: dict, script: str = WORKER) -> list[str]:
    env = {
        **os.environ,
        "PYTHONPATH": REPO,
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "0",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "TM_GENERATION": "4",
        **agent_env,
    }
    for name in ("TM_AGENT_STORE", "TM_NO_LIVE"):
        if name not in agent_env:
            env.pop(name, None)
    out = subprocess.run([sys.executable, "-c", script, how], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


def test_a_no_live_worker_is_a_plain_job_whose_steps_reach_the_agent(agent_store):
    """Under --no-live (TM_NO_LIVE=1) init() gives a PlainJob, never a live one, and its steps()
    loop reports to the agent: the status ends ``finished`` at the last step."""
    out = run_worker("init", {"TM_AGENT_STORE": f"127.0.0.1:{agent_store.port}", "TM_NO_LIVE": "1"})
    assert out == ["job", "PlainJob", "channel", "True"]
    s = status(agent_store)
    assert (s["state"], s["step"], s["generation"], s["rank"]) == ("finished", 3, 4, 0)
    assert not agent_store.check(["worker/0/live"])


def test_a_script_without_init_reports_through_the_module_function(agent_store):
    out = run_worker("plain", {"TM_AGENT_STORE": f"127.0.0.1:{agent_store.port}"})
    assert out == ["channel", "True"]
    s = status(agent_store)  # its last report, written at exit (the loop itself is rate-limited)
    assert (s["state"], s["step"]) == ("exiting", 2)


@pytest.mark.parametrize("how, state", [("ended", "finished"), ("left", "exiting")])
def test_a_no_live_loop_ended_early_is_finished_only_when_it_says_so(agent_store, how, state):
    """``job.end_loop()`` before a ``break``: finished (a crash on the way out is then no
    failure); a loop left without it (a ``break``, or an exception) is not finished."""
    out = run_worker(how, {"TM_AGENT_STORE": f"127.0.0.1:{agent_store.port}", "TM_NO_LIVE": "1"})
    assert out == ["channel", "True"]
    s = status(agent_store)
    assert (s["state"], s["step"]) == (state, 2)


@pytest.mark.parametrize("how", ["init", "plain", "ended"])
def test_under_plain_torchrun_reporting_does_nothing(how):
    assert run_worker(how, {})[-2:] == ["channel", "False"]


LIVE_WORKER = r"""
import json, time
import tm_launch
job = tm_launch.init()  # a LiveJob that entered generation 0, not live until job.steps()

def status():
    s = json.loads(job.agent.store.get("worker/0/status"))
    return s["state"], s["step"]

job.report_step(7)
print("before", *status(), flush=True)
time.sleep(0.3)  # past the rate limit: a report inside job.steps() would be written at once
for step in job.steps(2):
    job.report_step(100)
    print("inside", *status(), flush=True)
"""


def test_report_step_is_restart_modes_only_a_live_loop_counts_its_own_steps(tmp_path):
    """A LiveJob reports restart-mode steps until it runs job.steps(); inside, report_step does
    nothing, and at exit its status stays the live loop's ``finished``."""
    from rendezvous.plan import Plan
    from rendezvous.planner import Limits
    from tm_launch.launcher.config import AgentConfig
    from tm_launch.launcher.supervisor import WorkerSupervisor

    bootstrap = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    cfg = AgentConfig(node_id="n1", addr="127.0.0.1", nproc=1, limits=Limits(1, 1, 1, 0), cmd=[], run_id="r")
    sup = WorkerSupervisor(cfg, lambda *a, **k: None)
    try:
        plan = Plan(generation=0, nodes=("n1",), nproc=1, store={"node": "n1", "addr": "127.0.0.1", "port": bootstrap.port}, live=True)
        sup.direct(plan)
        env = {**sup.env(plan, 0, sandbox=False), "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
        out = subprocess.run([sys.executable, "-c", LIVE_WORKER], capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        lines = [line.split() for line in out.stdout.splitlines()]
        assert lines[0] == ["before", "running", "7"]
        assert [line[0] for line in lines[1:]] == ["inside", "inside"] and all(line[2] != "100" for line in lines[1:]), lines
        final = json.loads(sup.store.get("worker/0/status"))
        assert (final["state"], final["step"]) == ("finished", 2)
    finally:
        sup.close()


def test_a_spare_warming_up_in_the_sandbox_reports_nothing(agent_store):
    """Before job.steps() a sandboxed spare is not part of the job: its reports are dropped."""
    script = "import tm_launch\njob = tm_launch.init()\njob.report_step(3)\nprint(job.in_sandbox)\n"
    env = {
        **os.environ,
        "PYTHONPATH": REPO,
        "OMP_NUM_THREADS": "1",
        "TM_AGENT_STORE": f"127.0.0.1:{agent_store.port}",
        "TM_SANDBOX": "1",
        "GROUP_RANK": "-1",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "RANK": "0",
    }
    env.pop("TM_NO_LIVE", None)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.split() == ["True"], out.stderr[-3000:]
    s = status(agent_store)
    assert s["state"] == "sandbox" and s["step"] is None and s["mode"] == "live"  # not a restart-mode report


TIMED_WORKER = r"""
import datetime, sys
import torch.distributed as dist
import tm_launch
how = sys.argv[1]
timeout = datetime.timedelta(seconds=77)
if how == "init":  # --no-live: tm_launch.init(timeout=...) is init_process_group(timeout=...)
    job = tm_launch.init(timeout=timeout)
    for step in job.steps(2):
        pass
else:
    dist.init_process_group("gloo", **({"timeout": timeout} if how == "torch" else {}))
    tm_launch.report_step(1)
"""


@pytest.mark.parametrize("how, want", [("init", 77.0), ("torch", 77.0), ("default", 1800.0)])
def test_restart_mode_tells_the_agent_the_timeout_its_collectives_run_under(agent_store, how, want):
    """The script's ``timeout=`` (to ``tm_launch.init`` or torch's ``init_process_group``), else
    gloo's 30 minutes, read from the real group: how long the agent waits for a busy worker."""
    run_worker(how, {"TM_AGENT_STORE": f"127.0.0.1:{agent_store.port}", "TM_NO_LIVE": "1"}, script=TIMED_WORKER)
    assert status(agent_store)["collective_timeout"] == want


def test_a_timeout_is_refused_as_torch_refuses_it():
    import datetime

    from tm_launch.worker.job.entry import timeout_seconds

    assert timeout_seconds(None) == 0.0 and timeout_seconds(datetime.timedelta(minutes=2)) == 120.0
    with pytest.raises(TypeError, match="expected timeout to be a datetime.timedelta, got int"):
        timeout_seconds(120)
    with pytest.raises(ValueError, match="timeout must be positive"):
        timeout_seconds(datetime.timedelta(0))


@pytest.mark.parametrize("asked, given", [(None, None), ("gloo", "gloo"), ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl")])
def test_a_plain_job_asks_torch_for_the_backend_the_script_asked_for(monkeypatch, asked, given):
    """``tm_launch.init()`` under torchrun / --no-live is ``init_process_group`` with the same
    backend: none named means torch's own default (gloo for CPU tensors, NCCL for CUDA ones),
    not NCCL alone, which would refuse a CPU model's gradients on a GPU machine."""
    import torch.distributed as dist

    from tm_launch.worker.job.plain import PlainJob

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend=None, **kw: calls.append(backend))
    PlainJob(asked)
    assert calls == [given]


PLAIN_EXIT = r"""
import atexit, weakref
import torch, torch.distributed as dist
import tm_launch
held = []
atexit.register(lambda: print("freed", held[0]() is None, flush=True))  # runs after init()'s own handler
job = tm_launch.init()
held.append(weakref.ref(dist.group.WORLD))
t = torch.ones(2)
dist.all_reduce(t, group=job.group)
"""


def test_a_plain_job_frees_its_group_before_the_interpreter_tears_down():
    """A script that never destroys the group ``tm_launch.init()`` started under torchrun has it
    destroyed and freed at exit, before teardown: freed there, gloo's worker thread could abort
    the process (``job.plain._destroy_default_group``; 7-11 of 30 two-rank runs here without it)."""
    assert run_worker("", {}, script=PLAIN_EXIT) == ["freed", "True"]


@pytest.mark.parametrize(
    "error, limit, want",
    [
        (RuntimeError("Connection closed by peer\n  frame 0\n  frame 1"), 160, "Connection closed by peer"),
        (RuntimeError(), 160, "RuntimeError"),  # an empty message: a worker's log line still says something
        (ValueError("  \n"), 160, "ValueError"),
        (RuntimeError("x" * 500), 80, "x" * 80),
    ],
)
def test_an_error_in_one_log_line(error, limit, want):
    from tm_launch.worker.log import first_line

    assert first_line(error, limit) == want
