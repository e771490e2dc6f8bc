"""The operator surface end to end: `ctl timeline`, Prometheus metrics, progress lines during long
waits, operator commands as events.

Real agents around the session etcd, a real spare taking over from a really killed worker, the
agents' metrics scraped over HTTP, `tm-launch ctl` as a subprocess. The pure parts are table tests
in tests/unit/ (ctl/test_timeline.py, test_joblog.py, test_waits.py, launcher/test_metrics.py).
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
    job.script_args = [
        "--steps",
        "220",
        "--step-sleep",
        "0.03",
        "--step-log",
        job.step_log,
        "--pause-step",
        "10",
        "--pause-file",
        trigger,
        "--kill-rank",
        "1",
        "--kill-step",
        "40",
        "--kill-trigger",
        trigger,
        "--kill-marker",
        marker,
    ]
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
        if (
            after
            and after.get(("tm_launch_generation", frozenset())) == 1
            and any(k[0] == "tm_launch_last_downtime_seconds" for k in after)
        ):
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
    job.wait_for(
        lambda s: s["generation"] == 0 and {n["id"] for n in s["nodes"] if n["role"] == "active"} == {"a", "b"},
        120,
        "generation 0 with a and b",
    )  # the job formed: no need to train (the fixture stops it)
    waits = [e for e in job.events() if e["kind"] == "waiting"]
    assert waits and waits[0]["waiting_for"] == "nodes" and waits[0]["elapsed_s"] >= 4, waits


def test_metrics_port_in_use_is_one_clear_line(etcd_endpoint, tmp_path):
    from tm_launch.cli import _local_addr

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cmd = launcher() + [
            "--nnodes",
            "1",
            "--rdzv-backend",
            "etcd-v3",
            "--rdzv-endpoint",
            etcd_endpoint,
            "--rdzv-id",
            f"busy-{time.time_ns()}",
            "--metrics-port",
            str(port),
            TRAIN,
            "--steps",
            "1",
        ]
        env = {**os.environ, "PYTHONPATH": REPO}
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert out.returncode != 0
    lines = [l for l in out.stderr.splitlines() if l.strip()]
    addr = _local_addr(None, [etcd_endpoint])  # the FQDN by default, as torchrun's MASTER_ADDR
    assert lines == [
        f"tm-launch: error: --metrics-port {port}: {addr}:{port} is already in use; pick a free port "
        "(every agent on one machine needs its own, e.g. PET_METRICS_PORT per agent)"
    ], out.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["timeline"], "timeline: give --out FILE.png (a picture), --json (the data), or both"),
        (["timeline", "--json"], "has no plans and no step samples in etcd yet; check --rdzv-id and --rdzv-endpoint"),
    ],
)
def test_ctl_timeline_mistakes_are_one_line(etcd_endpoint, args, message):
    cmd = launcher() + ["ctl", "--rdzv-endpoint", etcd_endpoint, "--rdzv-id", f"nothing-{time.time_ns()}", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": REPO}, cwd=REPO)
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1 and message in out.stderr, out.stderr


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
    assert [(e["node"], e["kind"], e["target"]) for e in events] == [
        ("operator", "cordoned", "node-x"),
        ("operator", "uncordoned", "node-x"),
    ]
