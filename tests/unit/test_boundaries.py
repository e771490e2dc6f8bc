"""The rooms' import rules, checked in fresh interpreters (what a process loads is what it runs).

* A training process (``tm_launch``, ``tm_launch.worker``) loads no etcd client, no rendezvous,
  no health monitor and no agent or operator code: it talks to its agent through
  ``tm_launch.protocol`` only.
* The agent (``tm_launch.launcher``, and ``tm-launch`` itself) loads no worker code and no
  plotting library.
* The operator's commands (``tm_launch.ctl``) load neither the agent's nor the worker's code,
  nor torch (``ctl status`` answers in well under a second).
* What every process imports (``tm_launch.settings``, the settings table, and ``tm_launch.logs``,
  the logging convention) loads the standard library only.
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


@pytest.mark.parametrize("entry", ["tm_launch", "tm_launch.worker.job.live", "tm_launch.worker.__main__"])
def test_a_training_process_imports_only_the_protocol_and_torch(entry):
    loaded = loaded_after(entry, "tm_launch.worker.job.live")
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


# The worker's rooms, top to bottom: a module imports only from its own room or rooms below it
# (``tm_launch/worker/__init__.py`` says what each owns).
WORKER_LAYERS = [
    {"__main__"},  # python -m tm_launch.worker: runs the script
    {"integrations"},
    {"job", "rehearsal_dump"},  # rehearsal_dump: the state a rehearsal compares, armed by init()
    {"spare"},
    {"generation"},
    {"torch_patches", "torch_support"},
    {"snapshots"},
    {"state"},
    {"comms"},
    {"agent_client", "step_report", "failpoints", "phase_faults", "exit_notice", "api", "log", "__init__"},
]


def _room(parts: list[str]) -> str:
    """The room of a module given its path parts under ``tm_launch/worker``."""
    return parts[0][:-3] if len(parts) == 1 and parts[0].endswith(".py") else parts[0]


def _worker_imports():
    """(importing module's room, imported room, where) for every import inside the worker."""
    import ast

    root = os.path.join(REPO, "tm_launch", "worker")
    for dirpath, _, files in os.walk(root):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root).split(os.sep)
            package = ["tm_launch", "worker", *rel[:-1]]
            for node in ast.walk(ast.parse(open(path).read())):
                if not isinstance(node, ast.ImportFrom):
                    continue
                if node.level:
                    base = package[: len(package) - node.level + 1]
                    targets = [base + (node.module.split(".") if node.module else [])]
                    if not node.module:
                        targets = [base + [alias.name] for alias in node.names]
                elif node.module and node.module.startswith("tm_launch.worker."):
                    targets = [node.module.split(".")]
                else:
                    continue
                for target in targets:
                    if target[:2] == ["tm_launch", "worker"] and len(target) > 2:
                        yield _room(rel), target[2], f"{'/'.join(rel)}:{node.lineno}"


def test_the_workers_rooms_import_downwards_only():
    layer = {room: i for i, rooms in enumerate(WORKER_LAYERS) for room in rooms}
    upward = [
        f"{where}: {room} imports {target}" for room, target, where in _worker_imports() if target in layer and layer[target] < layer[room]
    ]
    assert upward == []
    unknown = sorted({room for room, _, _ in _worker_imports()} - set(layer))
    assert unknown == [], f"rooms missing from WORKER_LAYERS: {unknown}"


@pytest.mark.parametrize("entry", ["tm_launch.settings", "tm_launch.logs"])
def test_what_every_process_imports_loads_the_standard_library_only(entry):
    loaded = loaded_after(entry)
    assert under(loaded, "torch", "yaml", "numpy", *ETCD_CLIENTS, "rendezvous", "health") == []
    assert under(loaded, "tm_launch") == sorted({"tm_launch", entry})


def test_the_rehearsal_imports_no_worker_or_agent_code():
    loaded = loaded_after(
        "tm_launch.rehearsal.main", "tm_launch.rehearsal.runs", "tm_launch.rehearsal.compare", "tm_launch.rehearsal.report"
    )
    assert under(loaded, "tm_launch.worker", "tm_launch.launcher", "tm_launch.ctl", "health") == []
