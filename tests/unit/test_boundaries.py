"""The rooms' import rules, checked in fresh interpreters (what a process loads is what it runs).

* A training process (``tm_launch``, ``tm_launch.worker``) loads no etcd client, no rendezvous,
  no health monitor and no agent or operator code: it talks to its agent through
  ``tm_launch.protocol`` only.
* The agent (``tm_launch.launcher``, and ``tm-launch`` itself) loads no worker code and no
  plotting library.
* The operator's commands (``tm_launch.ctl``) load neither the agent's nor the worker's code,
  nor torch (``ctl status`` answers in well under a second).
* The rehearsal (``tm-launch rehearse``, ``tm_launch.rehearsal``) runs on the operator's side: it
  starts agents and torchrun as processes and reads the state files workers wrote; it loads no
  worker or agent code, and no worker loads it.
"""

import os
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))  # the repository root

ETCD_CLIENTS = ("etcd", "etcd3gw", "requests", "urllib3")


def loaded_after(*modules: str) -> set[str]:
    """The modules a fresh interpreter holds after importing ``modules``."""
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + "print('\\n'.join(sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return set(out.stdout.split())


def under(modules: set[str], *roots: str) -> list[str]:
    return sorted(m for m in modules if any(m == r or m.startswith(r + ".") for r in roots))


@pytest.mark.parametrize("entry", ["tm_launch", "tm_launch.worker.runtime", "tm_launch.worker.__main__"])
def test_a_training_process_imports_only_the_protocol_and_torch(entry):
    loaded = loaded_after(entry, "tm_launch.worker.runtime")
    assert under(loaded, *ETCD_CLIENTS, "rendezvous", "health") == []
    assert under(loaded, "tm_launch.launcher", "tm_launch.ctl", "tm_launch.local", "tm_launch.joblog", "tm_launch.rehearsal") == []
    assert "tm_launch.protocol" in loaded


@pytest.mark.parametrize("entry", ["tm_launch.cli", "tm_launch.launcher.agent"])
def test_the_agent_imports_no_worker_or_plotting_code(entry):
    loaded = loaded_after(entry)
    assert under(loaded, "tm_launch.worker", "tm_launch.ctl", "tm_launch.local", "tm_launch.rehearsal", "matplotlib") == []


def test_the_operators_commands_import_neither_agent_nor_worker_nor_torch():
    loaded = loaded_after("tm_launch.ctl.commands", "tm_launch.ctl.timeline")
    assert under(loaded, "tm_launch.launcher", "tm_launch.worker", "tm_launch.local", "torch") == []


def test_the_rehearsal_imports_no_worker_or_agent_code():
    loaded = loaded_after(
        "tm_launch.rehearsal.main", "tm_launch.rehearsal.runs", "tm_launch.rehearsal.compare", "tm_launch.rehearsal.report"
    )
    assert under(loaded, "tm_launch.worker", "tm_launch.launcher", "tm_launch.ctl", "health") == []
