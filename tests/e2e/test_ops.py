"""The operator surface: `ctl timeline`, Prometheus metrics, progress lines during long waits.

Pure parts are table tests; the end-to-end tests run real agents around the session etcd, a real
spare taking over from a really killed worker, and scrape the agents' metrics over HTTP.
"""

import json
import os
import socket
import subprocess
import time
import urllib.request

import pytest

from rendezvous.etcd_server import free_ports
from tm_launch.local.localjob import REPO, TRAIN, launcher
from tm_launch.ctl.timeline import build, by_generation, label_rows
from tm_launch.joblog import append_samples, cause_kind
from tm_launch.waits import Every


# -- pure parts ------------------------------------------------------------------------------------
@pytest.mark.parametrize("before, add, cap, expect", [
    ([], [[1], [2]], 10, [[1], [2]]),
    ([[i] for i in range(8)], [[8], [9]], 10, [[i] for i in range(10)]),
    # over the cap: the older half is thinned by two, the recent half kept whole
    ([[i] for i in range(10)], [[10]], 10, [[0], [2], [4], [5], [6], [7], [8], [9], [10]]),
])
def test_append_samples_is_bounded_and_keeps_recent(before, add, cap, expect):
    assert append_samples(before, add, cap) == expect


def test_append_samples_stays_bounded_over_a_long_run():
    series = []
    for t in range(10_000):
        series = append_samples(series, [[t]], cap=100)
    assert len(series) <= 100 and series[0] == [0] and series[-1] == [9999]


@pytest.mark.parametrize("plan, reports, kind", [
    ({"generation": 0}, {}, "start"),
    ({"generation": 3, "state": "succeeded"}, {}, "finished"),
    ({"generation": 2, "state": "failed", "cause": "x"}, {}, "failed"),
    ({"generation": 1, "planned": True, "cause": "a: drain (operator)"}, {}, "drain"),
    ({"generation": 1, "cause": "scale up: c joined"}, {}, "scale_up"),
    ({"generation": 1, "cause": "b: killed"}, {"a": {"kind": "exit"}, "b": {"kind": "signal"}}, "signal"),
    ({"generation": 1, "cause": "b: lost"}, {"b": {"kind": "lost"}, "a": {"kind": "exit"}}, "lost"),
    ({"generation": 1, "cause": "b: exit 1"}, {"b": {"kind": "exit"}}, "exit"),
    ({"generation": 1, "cause": "b: xid 79"}, {"b": {"kind": "alarm"}}, "alarm"),
    ({"generation": 1, "cause": "b: ?"}, {}, "failure"),
])
def test_cause_kind(plan, reports, kind):
    assert cause_kind(plan, reports) == kind


@pytest.mark.parametrize("xs, gap, rows", [
    ([], 1.0, []),
    ([0, 5, 10], 1.0, [0, 0, 0]),
    ([0, 0.5, 0.7, 5], 1.0, [0, 1, 2, 0]),
    ([0, 0.5, 1.2, 1.3], 1.0, [0, 1, 0, 2]),
])
def test_label_rows_never_put_close_labels_on_one_row(xs, gap, rows):
    assert label_rows(xs, gap) == rows


@pytest.mark.parametrize("gens, runs", [
    ([], []),
    ([0, 0, 0], [[0, 0, 0]]),
    ([0, 0, 1, 1, 2], [[0, 0], [1, 1], [2]]),  # no line drawn across a generation change
])
def test_by_generation_cuts_a_ranks_samples_at_each_generation_change(gens, runs):
    samples = [{"generation": g, "step": i} for i, g in enumerate(gens)]
    assert [[s["generation"] for s in run] for run in by_generation(samples)] == runs
    assert [s for run in by_generation(samples) for s in run] == samples


def test_build_downtime_from_fault_to_entry():
    t0 = 1000.0
    history = [
        {"generation": 0, "created": t0, "cause": "initial rendezvous", "state": "running", "nodes": ["a", "b"]},
        {"generation": 1, "created": t0 + 10.5, "cause": "b: worker 0 killed by SIGKILL", "state": "running", "live": True,
         "replaced": {"c": "b"}, "nodes": ["a", "c"]},
        {"generation": 2, "created": t0 + 20.0, "cause": "a: drain (operator)", "state": "running", "live": True, "planned": True},
        {"generation": 3, "created": t0 + 30.0, "cause": "all workers finished", "state": "succeeded"},
    ]
    reports = {0: {"b": {"kind": "signal", "time": t0 + 10.0}, "a": {"kind": "exit", "time": t0 + 10.2}}}
    events = [{"kind": "entered", "generation": 1, "after_plan_s": 0.5}, {"kind": "entered", "generation": 1, "after_plan_s": 1.5},
              {"kind": "entered", "generation": 2, "after_plan_s": 0.25}]
    steps = {"a": [[t0 + 1, 0, 0, 10, 0.1, "running"], [t0 + 2, 0, 0, 20, 0.1, "parked"], [t0 + 13, 1, 0, 30, 0.1, "running"]]}
    data = build("r", history, reports, events, steps)
    by_gen = {g["generation"]: g for g in data["generations"]}
    assert by_gen[1]["kind"] == "signal" and by_gen[1]["fault_time"] == 10.0 and by_gen[1]["downtime_s"] == 2.0
    assert by_gen[2]["kind"] == "drain" and by_gen[2]["downtime_s"] == 0.25  # planned: from the plan itself
    assert by_gen[0]["downtime_s"] is None and by_gen[3]["downtime_s"] is None
    assert [s["step"] for s in data["series"]["0"]] == [10, 30]  # parked samples are not training
    json.dumps(data)  # `ctl timeline --json` prints exactly this


def test_build_restart_mode_downtime_from_the_step_series():
    """Restart mode has no ``entered`` events: the workers run again at the first sample of the
    new generation that ran a step (the step count starts again from the checkpoint)."""
    t0 = 1000.0
    history = [{"generation": 0, "created": t0, "state": "running"},
               {"generation": 1, "created": t0 + 10.1, "cause": "b: worker 0 killed by SIGKILL", "state": "running"}]
    reports = {0: {"b": {"kind": "signal", "time": t0 + 10.0}}}
    steps = {"a": [[t0 + 9, 0, 0, 42, 0.02, "running"], [t0 + 16, 1, 0, 41, None, "running"], [t0 + 17, 1, 0, 80, 0.02, "running"]],
             "b": [[t0 + 9, 0, 1, 43, 0.02, "running"], [t0 + 16.5, 1, 1, 41, None, "running"]]}
    data = build("r", history, reports, [], steps)
    change = data["generations"][1]
    assert (change["live"], change["kind"], change["downtime_s"]) == (False, "signal", 6.0)
    assert [s["step"] for s in data["series"]["0"]] == [42, 41, 80]


def test_every_prints_at_most_once_per_interval():
    now = [0.0]
    ticker = Every(5.0, clock=lambda: now[0])
    seen = []
    for i in range(0, 260):
        now[0] = i * 0.1
        if ticker.due():
            seen.append(round(now[0], 1))
    assert seen == [5.0, 10.0, 15.0, 20.0, 25.0]
    now[0] = 100.0  # a loop that stalled: one line, not a burst of the missed ones
    assert ticker.due() and not ticker.due()


# -- end to end ------------------------------------------------------------------------------------
def scrape(port: int) -> dict:
    """{(name, frozenset(labels)): value} from an agent's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


@pytest.mark.slow
def test_failover_timeline_and_metrics(local_job, tmp_path):
    """2 active nodes + 1 spare, each agent with its own metrics port; rank 1's worker SIGKILLs
    itself; the spare takes over. Then: the agents' metrics say generation 1 and its downtime,
    and `ctl timeline` draws a PNG whose data holds the failover generation with its cause."""
    job = local_job(nnodes="2", nproc=1, launcher_args=["--max-restarts", "3"])
    trigger, marker = os.path.join(job.workdir, "trigger"), os.path.join(job.workdir, "killed")
    job.script_args = ["--steps", "220", "--step-sleep", "0.03", "--step-log", job.step_log, "--pause-step", "10", "--pause-file", trigger,
                       "--kill-rank", "1", "--kill-step", "40", "--kill-trigger", trigger, "--kill-marker", marker]
    ports = dict(zip("abc", free_ports(3)))
    for n in "ab":
        job.start(n, extra_env={"PET_METRICS_PORT": str(ports[n])})
        time.sleep(0.2)
    job.wait_for(lambda s: s["generation"] is not None, 120, "generation 0")
    job.start("c", extra_env={"PET_METRICS_PORT": str(ports["c"])})
    job.wait_parked("c")
    spare = scrape(ports["c"])
    assert spare[("tm_launch_role", frozenset({("role", "spare")}))] == 1
    assert spare[("tm_launch_generation", frozenset())] == 0
    open(trigger, "w").close()

    # While training goes on in generation 1: the spare now holds rank 1 and says what happened.
    deadline, after = time.time() + 120, None
    while time.time() < deadline:
        try:
            after = scrape(ports["c"])
        except OSError:
            after = None
        if after and after.get(("tm_launch_generation", frozenset())) == 1 and any(k[0] == "tm_launch_last_downtime_seconds" for k in after):
            break
        time.sleep(0.3)
    else:
        pytest.fail(f"spare c's metrics never showed generation 1 with a downtime: {after}\n{job.logs_tail()}")
    assert after[("tm_launch_role", frozenset({("role", "active")}))] == 1
    assert after[("tm_launch_spares_available", frozenset())] == 0
    metric_down = after[("tm_launch_last_downtime_seconds", frozenset({("cause", "signal")}))]
    assert 0 < metric_down < 60
    assert after[("tm_launch_downtime_seconds_count", frozenset({("cause", "signal")}))] == 1
    survivor = "a" if job.status()["nodes"][0]["id"] == "a" else "b"
    kept = scrape(ports[survivor])
    assert kept[("tm_launch_generation", frozenset())] == 1
    assert kept[("tm_launch_generation_changes_total", frozenset({("cause", "signal")}))] == 1
    victim = ({"a", "b"} - {survivor}).pop()

    codes = job.wait(timeout=240)
    assert codes["c"] == 0 and codes[survivor] == 0, job.logs_tail()
    png = os.path.join(str(tmp_path), "timeline.png")
    out = job.ctl("timeline", "--out", png, "--json")
    assert out.returncode == 0, out.stderr
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(png) > 20_000
    data = json.loads(out.stdout)
    g1 = next(g for g in data["generations"] if g["generation"] == 1)
    assert g1["kind"] == "signal" and victim in g1["cause"] and g1["replaced"] == {"c": victim}, g1
    assert g1["downtime_s"] is not None and abs(g1["downtime_s"] - metric_down) < 1.0, (g1, metric_down)
    assert {"0", "1"} <= set(data["series"]) and {s["node"] for s in data["series"]["1"]} == {victim, "c"}
    assert data["generations"][-1]["kind"] == "finished"
    # The worker runtime says who sent what to whom, how much and how long.
    assert "received the training state of step" in job.nodes["c"].log(), job.nodes["c"].log()[-3000:]
    assert "sent the training state of step" in job.nodes[survivor].log()


def test_join_wait_says_what_it_waits_for(local_job):
    """One agent of an --nnodes 2 job prints what it waits for, with the time so far, then the
    second node joins and the job runs."""
    job = local_job(nnodes="2", nproc=1)
    job.script_args = ["--steps", "1"]
    job.start("a")
    deadline = time.time() + 60
    while "waiting for 2 node(s) to join" not in job.nodes["a"].log():
        assert time.time() < deadline and job.nodes["a"].proc.poll() is None, job.logs_tail()
        time.sleep(0.2)
    line = next(l for l in job.nodes["a"].log().splitlines() if "waiting for 2 node(s) to join" in l)
    assert f"run '{job.run_id}': 1 joined (a);" in line and " s of 600 s" in line, line
    job.start("b")
    job.wait_for(lambda s: s["generation"] == 0 and {n["id"] for n in s["nodes"] if n["role"] == "active"} == {"a", "b"}, 120,
                 "generation 0 with a and b")  # the job formed: no need to train (the fixture stops it)
    waits = [e for e in job.events() if e["kind"] == "waiting"]
    assert waits and waits[0]["waiting_for"] == "nodes" and waits[0]["elapsed_s"] >= 4, waits


def test_metrics_port_in_use_is_one_clear_line(etcd_endpoint, tmp_path):
    from tm_launch.cli import _local_addr

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cmd = launcher() + ["--nnodes", "1", "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd_endpoint,
                            "--rdzv-id", f"busy-{time.time_ns()}", "--metrics-port", str(port), TRAIN, "--steps", "1"]
        env = {**os.environ, "PYTHONPATH": REPO}
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert out.returncode != 0
    lines = [l for l in out.stderr.splitlines() if l.strip()]
    addr = _local_addr(None, [etcd_endpoint])  # the FQDN by default, as torchrun's MASTER_ADDR
    assert lines == [f"tm-launch: error: --metrics-port {port}: {addr}:{port} is already in use; pick a free port "
                     "(every agent on one machine needs its own, e.g. PET_METRICS_PORT per agent)"], out.stderr


def test_metrics_count_alarms_failures_and_role():
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from tm_launch.launcher.metrics import AgentMetrics

    m = AgentMetrics("a")
    m.on_event("alarm", {"alarm": {"signal": "xid", "severity": "fatal"}})
    m.on_event("alarm", {"alarm": {"signal": "xid", "severity": "fatal"}})
    m.on_event("alarm", {"alarm": {"signal": "temperature", "severity": "degraded"}})
    m.on_event("worker_failed", {})
    m.on_event("info", {})
    m.on_state(3, "draining", 2)
    m.on_statuses({0: {"state": "running", "step_time": 0.5, "step": 7}, 1: {"state": "running", "step_time": 0.25, "step": 8},
                   2: {"state": "parked", "step_time": 9.0, "step": 1}})
    m.on_downtime("lost", 2.5)
    values = {(s.name, frozenset(s.labels.items())): s.value
              for f in text_string_to_metric_families(generate_latest(m.registry).decode()) for s in f.samples}
    assert values[("tm_launch_alarms_total", frozenset({("signal", "xid"), ("severity", "fatal")}))] == 2
    assert values[("tm_launch_alarms_total", frozenset({("signal", "temperature"), ("severity", "degraded")}))] == 1
    assert values[("tm_launch_worker_failures_total", frozenset({("kind", "worker_failed")}))] == 1
    assert values[("tm_launch_generation", frozenset())] == 3 and values[("tm_launch_spares_available", frozenset())] == 2
    assert [r for r in ("active", "spare", "draining", "failed") if values[("tm_launch_role", frozenset({("role", r)}))] == 1] == ["draining"]
    assert values[("tm_launch_steps_per_second", frozenset())] == 3.0  # (2 + 4) / 2: parked workers do not train
    assert values[("tm_launch_step", frozenset())] == 8
    assert values[("tm_launch_downtime_seconds_bucket", frozenset({("cause", "lost"), ("le", "5.0")}))] == 1
    assert values[("tm_launch_downtime_seconds_bucket", frozenset({("cause", "lost"), ("le", "2.0")}))] == 0


@pytest.mark.parametrize("args, message", [
    (["timeline"], "timeline: give --out FILE.png (a picture), --json (the data), or both"),
    (["timeline", "--json"], "has no plans and no step samples in etcd yet; check --rdzv-id and --rdzv-endpoint"),
])
def test_ctl_timeline_mistakes_are_one_line(etcd_endpoint, args, message):
    cmd = launcher() + ["ctl", "--rdzv-endpoint", etcd_endpoint, "--rdzv-id", f"nothing-{time.time_ns()}", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": REPO}, cwd=REPO)
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1 and message in out.stderr, out.stderr


@pytest.mark.parametrize("argv, yaml_text, env, port", [
    ([], "", {}, None),  # off by default
    (["--metrics-port", "9101"], "", {}, 9101),
    ([], "metrics_port: 9102\n", {}, 9102),
    ([], "metrics_port: 9102\n", {"PET_METRICS_PORT": "9103"}, 9103),  # torchrun's precedence: env beats YAML
    (["--metrics-port", "9104"], "", {"PET_METRICS_PORT": "9103"}, 9104),
])
def test_metrics_port_from_flag_yaml_or_env(tmp_path, monkeypatch, argv, yaml_text, env, port):
    from tm_launch.launcher.options import parse_args

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    config = tmp_path / "job.yaml"
    config.write_text(yaml_text or "{}\n")
    assert parse_args(["--config", str(config), *argv, TRAIN]).metrics_port == port


def test_metrics_port_out_of_range_is_a_usage_error():
    from tm_launch.launcher.options import UsageError, parse_args

    with pytest.raises(UsageError, match=r"--metrics-port 70000: must be a TCP port number"):
        parse_args(["--metrics-port", "70000", TRAIN])


def test_operator_commands_are_events(etcd_endpoint):
    """`ctl drain/cordon/uncordon` land in the job's event log: an on-call person reading
    `ctl events` sees who moved a node, not only that it moved."""
    base = launcher() + ["ctl", "--rdzv-endpoint", etcd_endpoint, "--rdzv-id", f"op-{time.time_ns()}"]
    env = {**os.environ, "PYTHONPATH": REPO}
    for command in ("cordon", "uncordon"):
        out = subprocess.run(base + [command, "node-x"], capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
        assert out.returncode == 0, out.stderr
    out = subprocess.run(base + ["events", "--json"], capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    events = [json.loads(l) for l in out.stdout.splitlines()]
    assert [(e["node"], e["kind"], e["target"]) for e in events] == [("operator", "cordoned", "node-x"), ("operator", "uncordoned", "node-x")]
