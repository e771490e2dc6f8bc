"""Table tests for ``tm_launch.settings``: each tm-launch setting declared once, and what is
derived from it (the parser's options, their checks, AgentConfig's fields, the worker's
environment) agrees with the declaration."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from tm_launch import settings
from tm_launch.protocol import WorkerEnv

PROBLEMS = [
    ("spares", 0, None),
    ("spares", -1, "--spares -1: must be 0 or more"),
    ("lease_ttl", 0.5, None),
    ("lease_ttl", 0.0, "--lease-ttl 0.0: must be positive seconds"),
    ("sandbox_steps", 0, "--sandbox-steps 0: must be at least 1"),
    ("snapshot_every", 0, None),
    ("snapshot_every", -2, "--snapshot-every -2: must be 0 (never) or more"),
    ("snapshot_parity", 0, None),
    ("snapshot_parity", 1, "--snapshot-parity 1: must be 0 (a whole copy) or a group of 2 nodes or more"),
    ("snapshot_parity", -1, "--snapshot-parity -1: must be 0 (a whole copy) or a group of 2 nodes or more"),
    ("snapshot_parity", 2, None),
    ("metrics_port", None, None),
    ("metrics_port", 0, None),
    ("metrics_port", 65536, "--metrics-port 65536: must be a TCP port number (0-65535; 0 picks a free one)"),
    ("node_id", "anything", None),  # checked with the backend it depends on (launcher.options.validate)
]


@pytest.mark.parametrize("name, value, want", PROBLEMS)
def test_each_setting_checks_its_own_values(name, value, want):
    assert settings.BY_NAME[name].problem(value) == want


def test_problems_come_in_table_order():
    defaults = argparse.Namespace(**{s.name: s.default for s in settings.SETTINGS})
    assert settings.problems(defaults) == []
    bad = argparse.Namespace(**{**vars(defaults), "spares": -1, "metrics_port": -1})
    assert [p.split(":")[0] for p in settings.problems(bad)] == ["--spares -1", "--metrics-port -1"]


SIZES = [("1000000", 1000000), ("16GiB", 16 * 2**30), ("500MB", 500 * 10**6), ("1.5G", 1_500_000_000), (2048, 2048), ("3 kib", 3072)]


@pytest.mark.parametrize("text, want", SIZES)
def test_sizes(text, want):
    assert settings.parse_size(text) == want


@pytest.mark.parametrize("text", ["lots", "-1GB", "5 parsecs"])
def test_sizes_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        settings.parse_size(text)


def test_names_and_spellings_are_unique():
    names = [s.name for s in settings.SETTINGS]
    flags = [f for s in settings.SETTINGS for f in (s.flags or (s.option,))]
    variables = [v.name for v in settings.worker_variables()]
    assert len(set(names)) == len(names) and len(set(flags)) == len(flags) and len(set(variables)) == len(variables)
    assert all(v.startswith("TM_") for v in variables)


def test_a_flag_has_no_type_and_a_choice_its_choices():
    assert settings.BY_NAME["no_live"].argparse_kwargs() == {
        "dest": "no_live",
        "action": "store_true",
        "help": settings.BY_NAME["no_live"].help,
    }
    send = settings.BY_NAME["snapshot_send"].argparse_kwargs()
    assert send["choices"] == settings.SNAPSHOT_SENDS and "type" not in send
    assert settings.BY_NAME["snapshot_memory_limit"].argparse_kwargs()["type"] is settings.parse_size


def test_agent_config_has_every_setting_with_the_value_the_worker_defaults_to():
    from tm_launch.launcher.config import AgentConfig

    fields = {f.name: f.default for f in dataclasses.fields(AgentConfig)}
    for s in settings.SETTINGS:
        assert fields[s.name] == s.unset, s.name
    for v in settings.worker_variables():
        assert WorkerEnv.__dataclass_fields__[v.field].default == v.default


def test_the_worker_reads_back_what_the_agent_writes():
    """Every setting that reaches the worker, set away from its default, crosses the
    environment unchanged (the supervisor's ``to_worker`` -> ``tm_variables`` -> ``from_environ``)."""
    changed = {"node_id": "gpu-7", "join_timeout": 42.5, "collective_timeout": 9.0, "sandbox_steps": 5, "snapshot_every": 3}
    changed |= {"snapshot_send": "overlap", "snapshot_parity": 4, "snapshot_memory_limit": 2**30, "no_live": True}
    changed |= {"audit_every": 7}
    assert set(changed) == {s.name for s in settings.SETTINGS if s.worker}
    config = argparse.Namespace(**{s.name: s.unset for s in settings.SETTINGS} | changed)
    sent = WorkerEnv(agent_store="h:1", **settings.to_worker(config))
    got = WorkerEnv.from_environ(sent.tm_variables())
    assert got == sent
    assert (got.setup_timeout, got.no_live, got.snapshot_send) == (42.5, True, "overlap")


@pytest.mark.parametrize(
    "given, backend, script, want",
    [
        (0.0, "gloo", 0.0, 1800.0),  # nobody said: torch's own defaults
        (0.0, "nccl", 0.0, 600.0),
        (0.0, "gloo", 25.0, 25.0),  # the script's init(timeout=...), as torch honours it
        (0.0, "nccl", 3600.0, 3600.0),
        (40.0, "gloo", 25.0, 40.0),  # --collective-timeout / the YAML wins over the script
        (40.0, "nccl", 0.0, 40.0),
    ],
)
def test_the_collective_timeout_is_the_command_lines_else_the_scripts_else_the_backends(given, backend, script, want):
    assert settings.collective_timeout(given, backend, script) == want
    assert settings.chosen_timeout(given, script) == (want if given or script else 0.0)
