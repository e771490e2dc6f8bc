"""The etcd-v3 torchrun backend (rendezvous/torch_handler.py) under real torchrun agents (the
handler's rounds in-process: tests/unit/rendezvous/test_torch_handler_rounds.py)."""

import os
import subprocess
import sys
import time
import uuid

import pytest
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))  # the repository root
BIN = os.path.dirname(sys.executable)


def _torchrun(endpoint, run, *args):
    return [
        os.path.join(BIN, "torchrun"),
        "--rdzv-backend",
        "etcd-v3",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        run,
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-conf",
        "lease_ttl=2",
        "--monitor-interval",
        "0.5",
        *args,
    ]


@pytest.mark.slow  # over ~12 s on 2 cores: the fast tier keeps near 10 minutes
def test_two_torchrun_agents_train(etcd_endpoint, tmp_path):
    """Two real `torchrun --rdzv-backend etcd-v3` agents run tests/scripts/train.py to the end."""
    run = f"torchrun-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "params.pt"
    cmd = _torchrun(etcd_endpoint, run, os.path.join(ROOT, "tests", "scripts", "train.py"), "--steps", "5", "--out", str(out))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "LOGLEVEL": "INFO"}
    logs = [tmp_path / f"agent{i}.log" for i in range(2)]
    procs = [subprocess.Popen(cmd, cwd=str(tmp_path), env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT) for log in logs]
    deadline = time.monotonic() + 120
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outputs = [log.read_text() for log in logs]
    for p, text in zip(procs, outputs):
        assert p.returncode == 0, text[-6000:]
    assert "finished 5 steps" in "".join(outputs)
    params = torch.load(out)
    assert params and all(torch.isfinite(v).all() for v in params.values())


@pytest.mark.slow
def test_spare_agent_replaces_killed_node(etcd_endpoint, tmp_path):
    """3 torchrun agents for --nnodes 2: one node is SIGKILLed mid-training and the spare takes its
    group rank; the survivor restarts its worker (torchrun's --max-restarts) and the job finishes."""
    import signal

    from rendezvous.kv import connect
    from rendezvous.membership import Membership
    from rendezvous.rdzv_conf import etcd_options

    run = f"spare-{uuid.uuid4().hex[:8]}"
    steps = tmp_path / "steps.log"
    cmd = _torchrun(
        etcd_endpoint,
        run,
        "--max-restarts",
        "3",
        os.path.join(ROOT, "tests", "scripts", "train.py"),
        "--steps",
        "30",
        "--step-sleep",
        "0.2",
        "--ckpt-dir",
        str(tmp_path / "ckpt"),
        "--ckpt-every",
        "5",
        "--step-log",
        str(steps),
        "--out",
        str(tmp_path / "params.pt"),
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "LOGLEVEL": "INFO"}
    logs = [tmp_path / f"agent{i}.log" for i in range(3)]

    def start(i):
        return subprocess.Popen(
            cmd, cwd=str(tmp_path), env=env, stdout=open(logs[i], "w"), stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_for(cond, seconds, what):
        deadline = time.monotonic() + seconds
        while not cond():
            assert time.monotonic() < deadline, what
            time.sleep(0.2)

    def steps_done():
        return len(steps.read_text().splitlines()) if steps.exists() else 0

    procs = [start(0), start(1)]
    try:
        wait_for(lambda: steps_done() >= 4, 90, "training never started")
        procs.append(start(2))  # beyond --nnodes 2: a spare
        m = Membership(connect("v3", etcd_options(etcd_endpoint, run, None)))
        wait_for(lambda: m.snapshot().spares_alive == 1, 60, "the spare never registered")
        os.killpg(procs[1].pid, signal.SIGKILL)  # the node: agent and worker
        wait_for(lambda: procs[0].poll() is not None and procs[2].poll() is not None, 150, "job did not finish")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    outputs = [log.read_text() for log in logs]
    assert procs[0].returncode == 0, outputs[0][-6000:]
    assert procs[2].returncode == 0, outputs[2][-6000:]
    history = m.operator_log.history()
    substituted = [p for p in history if p.replaced]
    assert substituted and "lease expired" in substituted[0].cause, [(p.generation, p.cause) for p in history]
    assert history[-1].state == "succeeded"
    assert torch.load(tmp_path / "params.pt")
