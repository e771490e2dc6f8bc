"""The real ``tm-launch`` command on bad input: one ``tm-launch: error: ...`` line, no traceback,
a non-zero exit, and never a hang.

Every tm-launch process imports torch (2-5 s here), so the pure usage errors are launched all
at once by one module fixture and each test checks its own case.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from rendezvous.kv import EtcdOptions, connect
from rendezvous.membership import run_prefix

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))  # the repository root
CLI = [sys.executable, "-m", "tm_launch.cli"]
ERROR = "tm-launch: error: "


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def launch(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        CLI + args,
        cwd=ROOT,
        env=_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"tm-launch {proc.args[3:]} still running after {timeout}s (a hang):\n{err[-2000:]}")
    return proc.returncode, out, err


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(ERROR)]


def assert_one_error(rc: int, stderr: str, *fragments: str) -> str:
    assert rc != 0, stderr
    assert "Traceback" not in stderr, stderr
    lines = error_lines(stderr)
    assert len(lines) == 1, stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------------------------------------------------------
# usage errors and an unreachable etcd, launched in parallel


@pytest.fixture(scope="module")
def blackhole():
    """A TCP port that accepts connections and never answers (a hung etcd)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    yield s.getsockname()[1]
    s.close()


USAGE = {
    "bad YAML key": (
        ["--config", "{tmp}/bad.yaml", "tests/scripts/train.py"],
        2,
        ["unknown key 'nproc_per_nod'", "did you mean 'nproc_per_node'"],
    ),
    "--nnodes 3:2": (["--nnodes", "3:2", "tests/scripts/train.py"], 2, ["--nnodes 3:2", "MIN (3) is larger than MAX (2)"]),
    "missing script": (["--nproc-per-node", "1", "no/such/train.py"], 2, ["training script 'no/such/train.py' not found"]),
    "bad --rdzv-conf": (
        ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-conf", "timeout=soon", "tests/scripts/train.py"],
        2,
        ["timeout=soon"],
    ),
    "bad last_call_timeout": (
        ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-conf", "last_call_timeout=soon", "tests/scripts/train.py"],
        2,
        ["last_call_timeout=soon"],
    ),
    "bad --nproc-per-node": (
        ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", "127.0.0.1:1", "--nproc-per-node", "abc", "tests/scripts/train.py"],
        2,
        ["nproc_per_node", "abc"],
    ),
    "torchrun's --nproc-per-node two": (
        ["--nproc-per-node", "two", "tests/scripts/train.py"],
        2,
        ["Unsupported nproc_per_node value: two"],
    ),
    "password on the command line": (
        ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-conf", "user=u,password=hunter2", "tests/scripts/train.py"],
        2,
        ["password_file=", "TM_ETCD_PASSWORD"],
    ),
    "YAML: TLS key without cert": (["--config", "{tmp}/tls.yaml", "tests/scripts/train.py"], 2, ["key= needs cert= too"]),
    "--node-id with a slash": (
        ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", "127.0.0.1:1", "--node-id", "a/b", "tests/scripts/train.py"],
        2,
        ["--node-id 'a/b'"],
    ),
    "--standalone --nnodes 2": (
        ["--standalone", "--nnodes", "2", "tests/scripts/train.py"],
        2,
        ["--standalone --nnodes 2", "no other node can ever join", "--rdzv-backend etcd-v3 --rdzv-endpoint HOST:2379"],
    ),
    "--standalone --nnodes 2:4": (
        ["--standalone", "--nnodes", "2:4", "tests/scripts/train.py"],
        2,
        ["--standalone --nnodes 2:4", "no other node can ever join", "--nnodes 2:4"],
    ),
    "etcd: nobody listens": (
        ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "nobody", "tests/scripts/train.py"],
        1,
        ["127.0.0.1:1", "connection refused"],
    ),
    "etcd: never answers": (
        ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", "127.0.0.1:{blackhole}", "--rdzv-id", "hung", "tests/scripts/train.py"],
        1,
        ["127.0.0.1:{blackhole}", "no answer"],
    ),
}


@pytest.fixture(scope="module")
def usage_results(tmp_path_factory, blackhole):
    tmp = tmp_path_factory.mktemp("bad-input")
    (tmp / "bad.yaml").write_text("nproc_per_nod: 2\n")
    (tmp / "tls.yaml").write_text(
        "rdzv_backend: etcd-v3\nrdzv_endpoint: 127.0.0.1:1\nrdzv_conf: {cacert: /etc/hostname, key: /etc/hostname}\n"
    )
    started = {}
    for name, (args, _, _) in USAGE.items():
        args = [a.format(tmp=tmp, blackhole=blackhole) for a in args]
        started[name] = (launch(args), time.monotonic())
    results = {}
    for name, (proc, t0) in started.items():
        rc, out, err = finish(proc, timeout=90)
        results[name] = (rc, err, time.monotonic() - t0)
    return results, blackhole


@pytest.mark.parametrize("case", list(USAGE))
def test_usage_error(usage_results, case):
    results, blackhole = usage_results
    rc, err, elapsed = results[case]
    _, want_rc, fragments = USAGE[case]
    assert_one_error(rc, err, *(f.format(blackhole=blackhole) for f in fragments))
    assert rc == want_rc, err
    assert "hunter2" not in err  # a password given by mistake is never echoed
    # Seven launchers import torch at once on two cores, which alone takes 5-15 s here.
    assert elapsed < 60, f"{case}: took {elapsed:.1f}s"
    if case.startswith("etcd:"):
        # The etcd part alone (beyond a launcher that fails right after parsing, started at the
        # same moment) stays within ~10 s: the connection check has a 5 s timeout, no retry loop.
        baseline = results["--nnodes 3:2"][2]
        assert elapsed - baseline < 12, f"{case}: {elapsed:.1f}s vs {baseline:.1f}s for a plain usage error"


CTL_USAGE = {
    "not YAML": (["--config", "{tmp}/broken.yaml", "status"], ["broken.yaml: not valid YAML"]),
    "YAML list": (["--config", "{tmp}/list.yaml", "status"], ["the top level must be a mapping"]),
    "node id with a slash": (["--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "r", "drain", "a/b"], ["node id 'a/b'"]),
    "run id inside another run": (["--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "job/state", "status"], ["without '/'"]),
    "run id escaping the prefix": (["--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "../x", "status"], ["'../x'"]),
    "password on the command line": (
        ["--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "r", "--rdzv-conf", "user=u,password=hunter2", "cordon", "a"],
        ["password_file="],
    ),
    "no run id": (["--rdzv-endpoint", "127.0.0.1:1", "status"], ["--rdzv-id"]),
}


def test_standalone_with_a_range_from_one_runs_alone(tmp_path):
    """``--standalone --nnodes 1:2`` is torchrun's spirit too: MIN nodes can form, so the job runs
    on this node alone (after --last-call) instead of being refused."""
    rc, _, err = finish(
        launch(["--standalone", "--nnodes", "1:2", "--nproc-per-node", "1", "tests/scripts/env_dump.py", "--out", str(tmp_path)]),
        timeout=120,
    )
    assert rc == 0 and "job finished successfully (generation 0)" in err, err
    assert (tmp_path / "rank0.json").exists()


def test_ctl_usage_errors(tmp_path):
    """``tm-launch ctl`` on bad input: one ``tm-launch ctl: error:`` line, exit 1, no traceback."""
    (tmp_path / "broken.yaml").write_text("rdzv_id: [x\n")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    procs = {name: launch(["ctl"] + [a.format(tmp=tmp_path) for a in args]) for name, (args, _) in CTL_USAGE.items()}
    for name, proc in procs.items():
        rc, out, err = finish(proc, timeout=60)
        lines = [ln for ln in err.splitlines() if ln.startswith("tm-launch ctl: error: ")]
        assert rc == 1 and "Traceback" not in err and len(lines) == 1, (name, err)
        for fragment in CTL_USAGE[name][1]:
            assert fragment in lines[0], (name, lines[0])
        assert "hunter2" not in err


# ------------------------------------------------------------------------------------------------
# against the real etcd


def _run_id() -> str:
    return f"bad-{uuid.uuid4().hex[:8]}"


def _etcd_args(endpoint: str, run_id: str) -> list[str]:
    return ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id]


@pytest.mark.slow  # over ~12 s on 2 cores: the fast tier keeps near 10 minutes
def test_finished_run_id_is_refused(etcd_endpoint):
    run_id = _run_id()
    job = _etcd_args(etcd_endpoint, run_id) + ["--nnodes", "1", "--nproc-per-node", "1"]
    rc, _, err = finish(launch(job + ["tests/scripts/train.py", "--steps", "2"]), timeout=120)
    assert rc == 0, err
    assert "job finished successfully (generation 0)" in err  # the generation that ran, not the end marker
    status = subprocess.run(
        CLI + ["ctl", "--rdzv-endpoint", etcd_endpoint, "--rdzv-id", run_id, "status"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stderr
    assert f"run {run_id}: generation 0, succeeded" in status.stdout, status.stdout
    [row] = [line.split() for line in status.stdout.splitlines()[1:] if not line.startswith(("NODE", "last change", "not live", "etcd"))]
    assert row[1] == "finished", status.stdout  # its agent exited after success: not "lost"
    t0 = time.monotonic()
    rc, _, err = finish(launch(job + ["tests/scripts/train.py", "--steps", "2"]), timeout=60)
    assert_one_error(rc, err, f"run id '{run_id}' already finished (succeeded)", "new --rdzv-id")
    assert time.monotonic() - t0 < 30
    assert "joined run" not in err  # refused before registering


def test_failed_run_status_says_what_happened(etcd_endpoint, tmp_path):
    """A job whose only worker fails with --max-restarts 0: the lines and `ctl status` name the
    generation that ran (0), no restart (none happened), and the node as failed, not lost (its
    agent was there to the end)."""
    run_id = _run_id()
    job = _etcd_args(etcd_endpoint, run_id) + ["--nnodes", "1", "--nproc-per-node", "1", "--max-restarts", "0"]
    rc, _, err = finish(launch(job + ["tests/scripts/env_dump.py", "--out", str(tmp_path), "--fail-rank", "0"]), timeout=120)
    assert rc == 1 and "generation 0: job failed: max restarts (0) exhausted" in err, err
    status = subprocess.run(
        CLI + ["ctl", "--rdzv-endpoint", etcd_endpoint, "--rdzv-id", run_id, "status"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stderr
    assert f"run {run_id}: generation 0, failed" in status.stdout and " 0 restart(s)" in status.stdout, status.stdout
    [row] = [line.split() for line in status.stdout.splitlines()[1:] if not line.startswith(("NODE", "last change", "not live", "etcd"))]
    assert row[1] == "failed", status.stdout


def test_duplicate_node_id_while_the_first_agent_is_alive(etcd_endpoint):
    run_id = _run_id()
    job = _etcd_args(etcd_endpoint, run_id) + ["--nnodes", "2", "--nproc-per-node", "1", "--node-id", "twin"]
    kv = connect("v3", EtcdOptions(endpoints=(etcd_endpoint,), prefix=run_prefix(run_id)))
    first = launch(job + ["tests/scripts/train.py"])  # waits for a second node that never comes
    try:
        deadline = time.monotonic() + 60
        while kv.get("state/nodes/twin") is None:
            assert first.poll() is None, first.communicate()[1]
            assert time.monotonic() < deadline, "first agent never registered"
            time.sleep(0.1)
        t0 = time.monotonic()
        rc, _, err = finish(launch(job + ["tests/scripts/train.py"]), timeout=60)
        assert_one_error(rc, err, "node id 'twin' is already registered", "--node-id")
        assert time.monotonic() - t0 < 30
        assert first.poll() is None, "the second agent disturbed the first"
        assert kv.get("state/plan") is None  # no generation formed with a phantom second node
    finally:
        first.send_signal(signal.SIGINT)
        try:
            first.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(first.pid, signal.SIGKILL)
            first.communicate()
        kv.close()


def test_script_crashing_at_import_fails_the_job(etcd_endpoint, tmp_path):
    script = tmp_path / "crash_at_import.py"
    script.write_text("raise RuntimeError('boom at import time')\n")
    t0 = time.monotonic()
    rc, _, err = finish(launch(_etcd_args(etcd_endpoint, _run_id()) + ["--max-restarts", "0", str(script)]), timeout=90)
    assert rc != 0, err
    assert time.monotonic() - t0 < 45
    assert "boom at import time" in err  # the worker's own traceback is shown ...
    assert "job failed: max restarts (0) exhausted" in err  # ... and why the launcher gave up
    assert "exited with code 1" in err
    tail = [line for line in err.splitlines() if line.strip()][-1]
    assert "job failed" in tail, tail


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_script_raising_inside_the_loop_fails_the_job(etcd_endpoint, tmp_path, nproc):
    """Every rank raises in the body of ``for step in job.steps()`` (the mistake seen on a GPU:
    AdamW's foreach path refusing a mix of tensors and DTensors in the first step). Python closes
    the steps() generator only at interpreter teardown, as it does after a ``break``: the worker
    must count as failed, not as "finished its steps, then exited with code 1 while exiting"."""
    script = tmp_path / "raise_in_loop.py"
    script.write_text(
        "import tm_launch\n"
        "job = tm_launch.init()\n"
        "for step in job.steps(10):\n"
        "    if step == 3:\n"
        "        raise RuntimeError('boom in step 3')\n"
    )
    args = _etcd_args(etcd_endpoint, _run_id()) + ["--nnodes", "1", "--nproc-per-node", str(nproc), "--max-restarts", "0"]
    rc, _, err = finish(launch(args + [str(script)]), timeout=90)
    assert rc != 0, err
    assert "boom in step 3" in err and "job failed" in err, err
    assert "counting it as done" not in err and "finished successfully" not in err, err


@pytest.mark.slow  # over ~12 s on 2 cores: the fast tier keeps near 10 minutes
def test_a_generation_nobody_can_enter_fails_the_job_instead_of_waiting(etcd_endpoint, tmp_path):
    """Every worker fails to set up its communicator at generation 0 (here: ``GLOO_SOCKET_IFNAME``
    names no interface of this machine; on a GPU machine it was NCCL refusing two ranks on one
    GPU). No peer was lost, so no new generation comes by itself: the agent must report its node
    with the worker's reason, and the job end, not wait forever."""
    script = tmp_path / "loop.py"
    script.write_text("import tm_launch\njob = tm_launch.init()\nfor step in job.steps(5):\n    pass\n")
    args = _etcd_args(etcd_endpoint, _run_id()) + ["--nnodes", "1", "--nproc-per-node", "1", "--max-restarts", "0"]
    proc = subprocess.Popen(
        CLI + args + [str(script)],
        cwd=ROOT,
        env={**_env(), "GLOO_SOCKET_IFNAME": "nosuchif0"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    rc, _, err = finish(proc, timeout=120)
    assert rc != 0, err
    assert "job failed: max restarts (0) exhausted" in err, err
    assert "entering generation 0 failed" in err and "Unable to find address for: nosuchif0" in err, err
    assert "finished successfully" not in err, err


ENDING = r"""
import sys
from tm_launch import cli
how = sys.argv[1]

def main():
    print("said on stdout")  # buffered: stdout is a pipe and PYTHONUNBUFFERED is unset
    print("said on stderr", file=sys.stderr)
    if how == "message":
        raise SystemExit("tm-launch: error: a message")
    if how == "code":
        raise SystemExit(3)
    return 0

cli.main = main
cli.entry()
print("never", flush=True)
"""


@pytest.mark.parametrize(
    "how, code, last", [("return", 0, "said on stderr"), ("message", 1, "tm-launch: error: a message"), ("code", 3, "said on stderr")]
)
def test_the_command_ends_as_sys_exit_would(how, code, last):
    """``tm-launch`` ends its process without the interpreter's teardown (``cli.entry``): what
    ``main()`` printed still arrives through a pipe, a ``SystemExit`` gives its code or its
    message and 1, and nothing runs after it."""
    env = {k: v for k, v in _env().items() if k != "PYTHONUNBUFFERED"}
    env["PYTHONPATH"] = ROOT
    out = subprocess.run([sys.executable, "-c", ENDING, how], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == code, out.stderr
    assert out.stdout.splitlines() == ["said on stdout"]
    assert out.stderr.splitlines()[-1] == last
