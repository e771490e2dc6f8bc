"""etcd over TLS with client certificates, and etcd users limited to one run's keys, end to end.

Real agents and ``tm-launch ctl`` as processes against two private etcd servers per module:
one that requires client certificates (``--client-cert-auth``, a CA made by the test), and one
with auth enabled: a root user, and a user ``trainer`` whose role may read and write only
``/tm-launch/<run>/``. What must hold:

* a job runs over TLS (``--rdzv-conf cacert=,cert=,key=`` or the same in YAML); without a client
  certificate, or with one from another CA, agent and ctl stop with one line and a non-zero exit;
* the trainer's credentials run their own job and its ctl commands; another run id gets one
  "permission denied for run X" line; a wrong or missing password one line;
* the password (given by TM_ETCD_PASSWORD or password_file=) never appears in the agent's
  output, its --event-log, any etcd value of the job, ctl output, any argv, or the workers'
  environment.

etcd's auth is v3-only (the v2 API has its own, deprecated auth), so the auth tests use etcd-v3.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
from test_bad_input import assert_one_error, finish

from rendezvous.etcd_server import EtcdServer, find_etcd_binary
from rendezvous.kv import EtcdOptions, KVError, connect
from tests.unit.rendezvous.test_kv import _make_certs

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))  # the repository root
CLI = [sys.executable, "-m", "tm_launch.cli"]
ENV_DUMP = "tests/scripts/env_dump.py"
PASSWORD = f"pw-{uuid.uuid4().hex}"  # unique: grep for it anywhere it must not be
ROOT_PASSWORD = f"root-{uuid.uuid4().hex}"
RUN = f"sec-{uuid.uuid4().hex[:8]}"  # the run the trainer's role may touch


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "TM_"))}
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=ROOT, **extra)
    return env


def launch(args: list[str], **env) -> subprocess.Popen:
    return subprocess.Popen(
        CLI + args,
        cwd=ROOT,
        env=_env(**env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def job_args(endpoint: str, run: str, conf: str | None, *rest: str) -> list[str]:
    args = ["--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", endpoint, "--rdzv-id", run]
    return args + (["--rdzv-conf", conf] if conf else []) + list(rest)


def ctl_args(endpoint: str, run: str, conf: str | None, *rest: str) -> list[str]:
    return ["ctl", "--rdzv-endpoint", endpoint, "--rdzv-id", run] + (["--rdzv-conf", conf] if conf else []) + list(rest)


# ------------------------------------------------------------------------------------------------
# TLS


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    good = tmp_path_factory.mktemp("ca")
    other = tmp_path_factory.mktemp("other-ca")
    return _make_certs(good), _make_certs(other)


@pytest.fixture(scope="module")
def tls_server(certs):
    c, _ = certs
    args = ["--cert-file", c["server.crt"], "--key-file", c["server.key"], "--trusted-ca-file", c["ca.crt"], "--client-cert-auth"]
    with EtcdServer(extra_args=args) as server:
        yield server


def test_tls_job_from_the_command_line_and_from_yaml(tls_server, certs, tmp_path):
    c, _ = certs
    conf = f"cacert={c['ca.crt']},cert={c['client.crt']},key={c['client.key']}"
    (tmp_path / "job.yaml").write_text(
        json.dumps(
            {
                "nnodes": "1",
                "nproc_per_node": 1,
                "rdzv_backend": "etcd-v3",
                "rdzv_endpoint": f"127.0.0.1:{tls_server.port}",  # no scheme: https because cacert is given
                "rdzv_id": "tls-yaml",
                "rdzv_conf": {"cacert": c["ca.crt"], "cert": c["client.crt"], "key": c["client.key"]},
            }
        )
    )
    cli = launch(job_args(tls_server.endpoint, "tls-cli", conf, ENV_DUMP, "--out", str(tmp_path / "cli")))
    yml = launch(["--config", str(tmp_path / "job.yaml"), ENV_DUMP, "--out", str(tmp_path / "yaml")])
    for proc, out in ((cli, "cli"), (yml, "yaml")):
        rc, _, err = finish(proc, timeout=120)
        assert rc == 0 and "job finished successfully" in err, err[-3000:]
        assert json.loads((tmp_path / out / "rank0.json").read_text())["allreduce"] == 1.0
    # ctl over TLS, with the connection settings from the same YAML file
    rc, out, err = finish(launch(["ctl", "--config", str(tmp_path / "job.yaml"), "status", "--json"]), timeout=60)
    assert rc == 0, err
    assert json.loads(out)["state"] == "succeeded"


def test_tls_refusals_are_one_line(tls_server, certs):
    c, other = certs
    cases = {
        "no client certificate": f"cacert={c['ca.crt']}",
        "certificate from another CA": f"cacert={c['ca.crt']},cert={other['client.crt']},key={other['client.key']}",
        "server not trusted": f"cacert={other['ca.crt']},cert={c['client.crt']},key={c['client.key']}",
    }
    started = {}
    for name, conf in cases.items():
        started[name] = launch(job_args(tls_server.endpoint, f"tls-{uuid.uuid4().hex[:6]}", conf, ENV_DUMP, "--out", "/nonexistent"))
        started["ctl: " + name] = launch(ctl_args(tls_server.endpoint, "tls-cli", conf, "status"))
    started["plain http"] = launch(job_args(f"http://127.0.0.1:{tls_server.port}", "tls-plain", None, ENV_DUMP, "--out", "/x"))
    for name, proc in started.items():
        rc, _, err = finish(proc, timeout=90)
        assert rc != 0, (name, err)
        assert "Traceback" not in err, (name, err)
        if name.startswith("ctl: "):
            lines = [ln for ln in err.splitlines() if ln.startswith("tm-launch ctl: error: ")]
            assert len(lines) == 1, (name, err)
            line = lines[0]
        else:
            line = assert_one_error(rc, err)
        assert f"127.0.0.1:{tls_server.port}" in line, (name, line)
        if name.endswith("plain http"):
            assert "https://" in line and "cacert=" in line, (name, line)
        else:
            assert "TLS" in line and "cacert=" in line and "cert=/key=" in line, (name, line)
        assert "joined run" not in err, (name, err)


# ------------------------------------------------------------------------------------------------
# etcd users and roles


def _etcdctl(endpoint: str, *args: str, user: str | None = None) -> str:
    cmd = [find_etcd_binary() + "ctl", f"--endpoints={endpoint}", *([f"--user={user}"] if user else []), *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=20).stdout


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    """Auth on; ``trainer`` may read and write ``/tm-launch/<RUN>/`` and nothing else."""
    with EtcdServer() as server:
        e = server.endpoint
        _etcdctl(e, "user", "add", f"root:{ROOT_PASSWORD}")
        _etcdctl(e, "role", "add", "trainer")
        _etcdctl(e, "role", "grant-permission", "trainer", "--prefix=true", "readwrite", f"/tm-launch/{RUN}/")
        _etcdctl(e, "user", "add", f"trainer:{PASSWORD}")
        _etcdctl(e, "user", "grant-role", "trainer", "trainer")
        _etcdctl(e, "auth", "enable")
        pw = tmp_path_factory.mktemp("secrets") / "etcd-password"
        pw.write_text(PASSWORD + "\n")
        pw.chmod(0o600)
        server.password_file = str(pw)
        yield server


def _no_password(where: str, text: str) -> None:
    assert PASSWORD not in text, f"the password leaked into {where}"


@pytest.mark.slow  # over ~12 s on 2 cores: the fast tier keeps near 10 minutes
def test_credentials_run_their_job_and_ctl_and_never_leak(auth_server, local_job, tmp_path):
    job = local_job(nnodes="1", nproc=1, run_id=RUN, launcher_args=["--rdzv-conf", "user=trainer"], env={"TM_ETCD_PASSWORD": PASSWORD})
    job.endpoint = auth_server.endpoint
    trigger = os.path.join(job.workdir, "go")
    job.script_args = ["--steps", "6", "--step-log", job.step_log, "--pause-step", "3", "--pause-file", trigger]
    job.start("a")
    job.wait_step(2, timeout=120)
    agent = job.nodes["a"].proc.pid
    (worker,) = job.worker_pids("a")
    # argv of agent and worker; the worker's environment (the agent's own is its launcher's business)
    for pid, what in ((agent, "agent"), (worker, "worker")):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            _no_password(f"the {what}'s argv", f.read().decode(errors="replace"))
    with open(f"/proc/{worker}/environ", "rb") as f:
        environ = f.read().decode(errors="replace")
    _no_password("the worker's environment", environ)
    assert "TM_ETCD_PASSWORD" not in environ

    creds = f"user=trainer,password_file={auth_server.password_file}"
    ok = {}
    for args in (("status", "--json"), ("events",), ("drain", "nobody"), ("cordon", "nobody"), ("uncordon", "nobody")):
        ok[args] = launch(ctl_args(auth_server.endpoint, RUN, creds, *args))
    refused = {args: launch(ctl_args(auth_server.endpoint, RUN, None, *args)) for args in (("status",), ("drain", "a"), ("cordon", "a"))}
    refused[("wrong user",)] = launch(ctl_args(auth_server.endpoint, RUN, "user=root", "cordon", "a"), TM_ETCD_PASSWORD="nope")
    for args, proc in ok.items():
        rc, out, err = finish(proc, timeout=60)
        assert rc == 0, (args, err)
        _no_password(f"ctl {args}", out + err)
        if args[0] == "status":
            s = json.loads(out)
            assert s["generation"] == 0 and [n["id"] for n in s["nodes"] if n["role"] == "active"] == ["a"], s
    for args, proc in refused.items():
        rc, out, err = finish(proc, timeout=60)
        assert rc == 1 and "Traceback" not in err, (args, err)
        lines = [ln for ln in err.splitlines() if ln.startswith("tm-launch ctl: error: ")]
        assert len(lines) == 1, (args, err)
        assert "requires authentication" in lines[0] or "rejected user 'root'" in lines[0], (args, lines[0])
        _no_password(f"ctl {args}", out + err)

    open(trigger, "w").close()
    assert job.wait(timeout=120) == {"a": 0}, job.logs_tail()
    assert "job finished successfully" in job.nodes["a"].log()
    assert "node nobody" not in job.nodes["a"].log()  # the drain/cordon of a stranger changed nothing
    _no_password("the agent's output", job.nodes["a"].log())
    with open(os.path.join(job.workdir, "a.events.jsonl")) as f:
        _no_password("the event log", f.read())
    with connect(
        "v3", EtcdOptions(endpoints=(auth_server.endpoint,), prefix=f"/tm-launch/{RUN}/", user="root", password=ROOT_PASSWORD)
    ) as kv:
        values = kv.get_prefix("")
    assert any(e.key.startswith("log/events/") for e in values)
    for e in values:
        _no_password(f"etcd key {e.key}", e.key + e.value)


def test_auth_refusals_are_one_line_and_never_echo_the_password(auth_server, tmp_path):
    e = auth_server.endpoint
    pw_file = f"password_file={auth_server.password_file}"
    other = f"other-{uuid.uuid4().hex[:6]}"
    cases = {
        # name: (process, fragments of its one error line)
        "another run id": (
            launch(job_args(e, other, "user=trainer", ENV_DUMP, "--out", "/x"), TM_ETCD_PASSWORD=PASSWORD),
            [f"permission denied for run {other}:", "trainer", f"/tm-launch/{other}/"],
        ),
        "another run id, ctl": (
            launch(ctl_args(e, other, f"user=trainer,{pw_file}", "drain", "a")),
            [f"permission denied for run {other}:", f"/tm-launch/{other}/"],
        ),
        "wrong password": (
            launch(job_args(e, RUN, "user=trainer", ENV_DUMP, "--out", "/x"), TM_ETCD_PASSWORD="wrong-" + PASSWORD[:8]),
            ["rejected user 'trainer'", "password"],
        ),
        "no credentials": (launch(job_args(e, RUN, None, ENV_DUMP, "--out", "/x")), ["requires authentication", "user and password"]),
        "password on the command line": (
            launch(job_args(e, RUN, f"user=trainer,password={PASSWORD}", ENV_DUMP)),
            ["password_file=", "TM_ETCD_PASSWORD"],
        ),
    }
    for name, (proc, fragments) in cases.items():
        rc, out, err = finish(proc, timeout=90)
        if "ctl" in name:
            lines = [ln for ln in err.splitlines() if ln.startswith("tm-launch ctl: error: ")]
            assert rc == 1 and len(lines) == 1 and "Traceback" not in err, (name, err)
            line = lines[0]
        else:
            line = assert_one_error(rc, err)
        for fragment in fragments:
            assert fragment in line, (name, line)
        assert "joined run" not in err, (name, err)
        _no_password(name, out + err)
    # The KV layer's own exception text does not carry the password either.
    with pytest.raises(KVError) as err:
        connect("v3", EtcdOptions(endpoints=(e,), prefix=f"/tm-launch/{RUN}/", user="trainer", password=PASSWORD + "x"))
    assert PASSWORD not in str(err.value) and PASSWORD not in repr(err.value)
