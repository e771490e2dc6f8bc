"""The agent's Prometheus metrics (tm_launch.launcher.metrics) and where --metrics-port comes
from (flag, YAML, PET_METRICS_PORT): in-process.

Real agents' metrics scraped over HTTP during a failover: tests/e2e/test_ops.py.
"""

import pytest

from tm_launch.local.localjob import TRAIN
from tm_launch.protocol import WorkerState, WorkerStatus


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
    m.on_statuses(
        {
            0: WorkerStatus(state=WorkerState.RUNNING, step_time=0.5, step=7),
            1: WorkerStatus(state=WorkerState.RUNNING, step_time=0.25, step=8),
            2: WorkerStatus(state=WorkerState.PARKED, step_time=9.0, step=1),
        }
    )
    m.on_downtime("lost", 2.5)
    values = {
        (s.name, frozenset(s.labels.items())): s.value
        for f in text_string_to_metric_families(generate_latest(m.registry).decode())
        for s in f.samples
    }
    assert values[("tm_launch_alarms_total", frozenset({("signal", "xid"), ("severity", "fatal")}))] == 2
    assert values[("tm_launch_alarms_total", frozenset({("signal", "temperature"), ("severity", "degraded")}))] == 1
    assert values[("tm_launch_worker_failures_total", frozenset({("kind", "worker_failed")}))] == 1
    assert values[("tm_launch_generation", frozenset())] == 3 and values[("tm_launch_spares_available", frozenset())] == 2
    assert [r for r in ("active", "spare", "draining", "failed") if values[("tm_launch_role", frozenset({("role", r)}))] == 1] == [
        "draining"
    ]
    assert values[("tm_launch_steps_per_second", frozenset())] == 3.0  # (2 + 4) / 2: parked workers do not train
    assert values[("tm_launch_step", frozenset())] == 8
    assert values[("tm_launch_downtime_seconds_bucket", frozenset({("cause", "lost"), ("le", "5.0")}))] == 1
    assert values[("tm_launch_downtime_seconds_bucket", frozenset({("cause", "lost"), ("le", "2.0")}))] == 0


@pytest.mark.parametrize(
    "argv, yaml_text, env, port",
    [
        ([], "", {}, None),  # off by default
        (["--metrics-port", "9101"], "", {}, 9101),
        ([], "metrics_port: 9102\n", {}, 9102),
        ([], "metrics_port: 9102\n", {"PET_METRICS_PORT": "9103"}, 9103),  # torchrun's precedence: env beats YAML
        (["--metrics-port", "9104"], "", {"PET_METRICS_PORT": "9103"}, 9104),
    ],
)
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
