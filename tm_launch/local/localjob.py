"""Several tm-launch "nodes" on one machine: agents on loopback around one etcd.

The demo, the benchmarks and the end-to-end tests all need the same things: start N agents
as real processes, inject a real fault (a signal to a worker or an agent, a drain), wait for the
job, and read what happened from the training script's step log. This is the one place that
knows how; it only starts processes and reads files, it never reaches into the agents.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(REPO, "tests", "scripts", "train.py")


def launcher() -> list[str]:
    return [sys.executable, "-m", "tm_launch.cli"]


@dataclass
class Node:
    name: str
    proc: subprocess.Popen
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


@dataclass
class LocalJob:
    """One job: ``nodes`` agents sharing ``run_id`` on ``endpoint``; files under ``workdir``."""

    endpoint: str
    run_id: str
    workdir: str
    nnodes: str = "2"
    nproc: int = 1
    backend: str = "etcd-v3"
    launcher_args: list[str] = field(default_factory=list)
    script: str = TRAIN
    script_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    nodes: dict[str, Node] = field(default_factory=dict)
    cwd: str | None = None  # the agents' (and so the workers') working directory; default the repository

    @property
    def step_log(self) -> str:
        return os.path.join(self.workdir, "steps.log")

    def start(self, name: str, extra_env: dict[str, str] | None = None, wrap: list[str] = (), extra_args: list[str] = ()) -> Node:
        """``wrap``: a command prefix (e.g. ``ip netns exec NS``, which execs: the pid stays the
        agent's); ``extra_args``: launcher options for this node only (e.g. --local-addr)."""
        os.makedirs(self.workdir, exist_ok=True)
        cmd = (
            [*wrap]
            + launcher()
            + [
                *extra_args,
                "--nnodes",
                self.nnodes,
                "--nproc-per-node",
                str(self.nproc),
                "--rdzv-backend",
                self.backend,
                "--rdzv-endpoint",
                self.endpoint,
                "--rdzv-id",
                self.run_id,
                "--node-id",
                name,
                "--event-log",
                os.path.join(self.workdir, f"{name}.events.jsonl"),
                *self.launcher_args,
                self.script,
                *self.script_args,
            ]
        )
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
            **self.env,
            **(extra_env or {}),
        }
        log_path = os.path.join(self.workdir, f"{name}.log")
        proc = subprocess.Popen(
            cmd, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, env=env, cwd=self.cwd or REPO, start_new_session=True
        )
        node = Node(name, proc, log_path)
        self.nodes[name] = node
        return node

    def start_all(self, names: list[str], gap: float = 0.2) -> None:
        for name in names:
            self.start(name)
            time.sleep(gap)

    def ctl(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        cmd = launcher() + ["ctl", "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.run_id, "--rdzv-backend", self.backend, *args]
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)

    def status(self) -> dict:
        out = self.ctl("status", "--json")
        if out.returncode != 0:
            raise RuntimeError(out.stderr.strip())
        return json.loads(out.stdout)

    def wait_for(self, predicate, timeout: float, what: str, interval: float = 0.2):
        """Poll ``predicate(status)`` until it returns something truthy; fail with ``what``."""
        deadline = time.time() + timeout
        last = None
        while time.time() < deadline:
            try:
                last = self.status()
                value = predicate(last)
                if value:
                    return value
            except (RuntimeError, ValueError, KeyError, subprocess.TimeoutExpired):
                pass  # a slow or failed `ctl status` (a loaded machine): ask again until the deadline
            if self.nodes and all(n.proc.poll() is not None for n in self.nodes.values()):
                break
            time.sleep(interval)
        raise TimeoutError(f"timed out waiting for {what}; last status: {json.dumps(last)[:2000]}\n{self.logs_tail()}")

    def wait_parked(self, node: str, timeout: float = 120, interval: float = 0.2) -> None:
        """Wait until a spare's sandboxed workers have warmed up and parked, and its agent has
        said so in etcd (its warm marker: a plan promotes it before cold spares)."""

        def parked(s):
            for n in s["nodes"]:
                if (
                    n["id"] == node
                    and n["role"] == "spare"
                    and n.get("warm")
                    and n["progress"]
                    and all(w.get("state") == "parked" for w in n["progress"].values())
                ):
                    return True
            return False

        self.wait_for(parked, timeout, f"spare {node} to park", interval)

    def wait_step(self, step: int, timeout: float = 120) -> None:
        """Wait until some rank finished ``step`` (read from the script's step log)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if any(s >= step for s in self.steps_done().values()):
                return
            if self.nodes and all(n.proc.poll() is not None for n in self.nodes.values()):
                break
            time.sleep(0.05)
        raise TimeoutError(f"timed out waiting for step {step}\n{self.logs_tail()}")

    def worker_pids(self, node: str) -> list[int]:
        """The training processes under a node's agent (children of the agent process)."""
        agent = self.nodes[node].proc.pid
        out = subprocess.run(["pgrep", "-P", str(agent)], capture_output=True, text=True).stdout.split()
        return [int(p) for p in out]

    def kill_worker(self, node: str, sig: int = signal.SIGKILL) -> int:
        pids = self.worker_pids(node)
        if not pids:
            raise RuntimeError(f"node {node} has no workers to kill")
        os.kill(pids[0], sig)
        return pids[0]

    def kill_agent(self, node: str, sig: int = signal.SIGKILL) -> None:
        self.nodes[node].proc.send_signal(sig)

    def wait(self, timeout: float = 300) -> dict[str, int]:
        deadline = time.time() + timeout
        for node in self.nodes.values():
            try:
                node.proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                self.stop()
                raise TimeoutError(f"job did not finish in {timeout}s\n{self.logs_tail()}") from None
        return {name: n.proc.returncode for name, n in self.nodes.items()}

    def stop(self) -> None:
        for node in self.nodes.values():
            if node.proc.poll() is None:
                try:
                    os.killpg(node.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for node in self.nodes.values():
            try:
                node.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def logs_tail(self, lines: int = 25) -> str:
        out = []
        for name, node in self.nodes.items():
            tail = [l for l in node.log().splitlines() if "registry.py" not in l][-lines:]
            out.append(f"--- {name} (exit {node.proc.poll()}):\n" + "\n".join(tail))
        return "\n".join(out)

    def events(self) -> list[dict]:
        records = []
        for name in self.nodes:
            path = os.path.join(self.workdir, f"{name}.events.jsonl")
            if os.path.exists(path):
                with open(path) as f:
                    records += [json.loads(l) for l in f if l.strip()]
        return sorted(records, key=lambda r: r["time"])

    # -- reading the step log ------------------------------------------------------------------
    def step_records(self) -> list[tuple[float, int, int, int, int]]:
        if not os.path.exists(self.step_log):
            return []
        rows = []
        with open(self.step_log) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 5:
                    t, rank, step, gen, pid = parts
                    rows.append((float(t), int(rank), int(step), int(gen), int(pid)))
        return rows

    def steps_done(self) -> dict[int, int]:
        done: dict[int, int] = {}
        for _, rank, step, _, _ in self.step_records():
            done[rank] = max(done.get(rank, -1), step)
        return done


def downtime(records, fault_time: float) -> dict:
    """TrainMover's measure: from the last step every rank completed before the fault to the
    first step completed by every rank after it; plus the steps that were run twice.

    A step counts as completed before the fault when every rank completed it before the fault,
    even if it was run again afterwards (a restart from a checkpoint redoes steps)."""
    by_step = collections.defaultdict(list)
    for t, rank, step, _, _ in records:
        by_step[step].append((t, rank))
    ranks = {r for _, r, _, _, _ in records}
    before = [s for s, rows in by_step.items() if {r for t, r in rows if t < fault_time} >= ranks]
    last_step = max(before) if before else -1
    last_time = max(t for t, _ in by_step[last_step] if t < fault_time) if before else fault_time
    resumed = None
    for s in sorted(s for s in by_step if s > last_step):
        done = {r: t for t, r in by_step[s] if t > fault_time}
        if set(done) >= ranks:
            resumed = (s, max(done.values()))
            break
    redone = sum(1 for s in by_step if s <= last_step and any(t > fault_time for t, _ in by_step[s]))
    return {
        "last_step_before": last_step,
        "last_step_at": last_time,
        "first_step_after": resumed[0] if resumed else None,
        "downtime_s": (resumed[1] - last_time) if resumed else None,
        "steps_redone": redone,
    }
