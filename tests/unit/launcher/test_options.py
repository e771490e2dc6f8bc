"""Table tests for the command line and the YAML config (``tm_launch.launcher.options.parse_args``).

torchrun's options keep their meaning, the YAML file may set any option by its destination name,
precedence is command line > PET_* variable > YAML > default, and every mistake is a UsageError
whose text is one line saying what to fix.
"""

from __future__ import annotations

import os
import textwrap

import pytest

from health.config import HealthConfig
from tm_launch.launcher.options import UsageError, parse_args

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))  # the repository root
SCRIPT = os.path.join(ROOT, "tests", "scripts", "train.py")


@pytest.fixture
def parse(tmp_path, monkeypatch):
    """``parse(argv, yaml=None, env=None)``: parse_args in a clean environment (no PET_* set).

    ``yaml`` is written to a file and passed as ``--config FILE`` in front of ``argv``; the
    string "SCRIPT" in argv is replaced by the path of tests/scripts/train.py."""
    for name in list(os.environ):
        if name.startswith("PET_"):
            monkeypatch.delenv(name)

    def run(argv, yaml: str | None = None, env: dict | None = None):
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        argv = [SCRIPT if a == "SCRIPT" else a for a in argv]
        if yaml is not None:
            path = tmp_path / "tm.yaml"
            path.write_text(textwrap.dedent(yaml))
            argv = ["--config", str(path)] + argv
        return parse_args(argv)

    return run


def one_line_error(excinfo) -> str:
    text = str(excinfo.value)
    assert text and "\n" not in text, repr(text)
    assert "Traceback" not in text
    return text


# ------------------------------------------------------------------------------------------------
# torchrun's options keep their meaning

TORCHRUN = [
    pytest.param(
        ["SCRIPT"],
        {
            "nnodes": "1:1",
            "nproc_per_node": "1",
            "rdzv_backend": "static",
            "max_restarts": 0,
            "module": False,
            "no_python": False,
            "standalone": False,
            "spares": 0,
            "lease_ttl": 5.0,
            "no_live": False,
            "config": None,
        },
        id="defaults are torchrun's",
    ),
    pytest.param(["--nnodes", "1:2", "SCRIPT"], {"nnodes": "1:2"}, id="--nnodes MIN:MAX"),
    pytest.param(["--nnodes=3", "SCRIPT"], {"nnodes": "3"}, id="--nnodes=N"),
    pytest.param(["--nproc-per-node", "4", "SCRIPT"], {"nproc_per_node": "4"}, id="--nproc-per-node"),
    pytest.param(["--nproc_per_node", "2", "SCRIPT"], {"nproc_per_node": "2"}, id="--nproc_per_node (underscore spelling)"),
    pytest.param(
        [
            "--rdzv-backend",
            "etcd-v3",
            "--rdzv-endpoint",
            "etcd-0:2379,etcd-1:2379",
            "--rdzv-id",
            "job-7",
            "--rdzv-conf",
            "timeout=3,cacert=/ca.pem",
            "SCRIPT",
        ],
        {
            "rdzv_backend": "etcd-v3",
            "rdzv_endpoint": "etcd-0:2379,etcd-1:2379",
            "rdzv_id": "job-7",
            "rdzv_conf": "timeout=3,cacert=/ca.pem",
        },
        id="--rdzv-backend/-endpoint/-id/-conf",
    ),
    pytest.param(
        ["--rdzv_backend=c10d", "--rdzv_endpoint=h:29400", "SCRIPT"],
        {"rdzv_backend": "c10d", "rdzv_endpoint": "h:29400"},
        id="torchrun's own backend passes through",
    ),
    pytest.param(["--max-restarts", "3", "SCRIPT"], {"max_restarts": 3}, id="--max-restarts is an int"),
    pytest.param(
        ["-m", "some.package.module", "--lr", "0.1"],
        {"module": True, "training_script": "some.package.module", "training_script_args": ["--lr", "0.1"]},
        id="-m MODULE (need not be a file)",
    ),
    pytest.param(
        ["--no-python", "true", "a", "b"],
        {"no_python": True, "training_script": "true", "training_script_args": ["a", "b"]},
        id="--no-python PROGRAM from PATH",
    ),
    pytest.param(["--standalone", "SCRIPT"], {"standalone": True}, id="--standalone"),
    pytest.param(
        ["SCRIPT", "--steps", "3", "--nproc-per-node", "9"],
        {"nproc_per_node": "1", "training_script_args": ["--steps", "3", "--nproc-per-node", "9"]},
        id="options after the script belong to the script",
    ),
    pytest.param(
        ["SCRIPT", "--config", "model.yaml"],
        {"config": None, "training_script_args": ["--config", "model.yaml"]},
        id="the script's own --config is not tm-launch's",
    ),
    pytest.param(
        ["--spares", "2", "--lease-ttl", "1.5", "--node-id", "gpu-07", "--no-live", "SCRIPT"],
        {"spares": 2, "lease_ttl": 1.5, "node_id": "gpu-07", "no_live": True},
        id="tm-launch's own options",
    ),
]


@pytest.mark.parametrize("argv, want", TORCHRUN)
def test_command_line(parse, argv, want):
    args = parse(argv)
    assert {k: getattr(args, k) for k in want} == want
    if "training_script" not in want:
        assert args.training_script == SCRIPT


@pytest.mark.parametrize(
    "env, want",
    [
        pytest.param({"PET_NPROC_PER_NODE": "3"}, {"nproc_per_node": "3"}, id="PET_NPROC_PER_NODE"),
        pytest.param({"PET_MAX_RESTARTS": "2"}, {"max_restarts": 2}, id="PET_MAX_RESTARTS (typed)"),
        pytest.param(
            {"PET_RDZV_BACKEND": "etcd-v3", "PET_RDZV_ID": "job9"}, {"rdzv_backend": "etcd-v3", "rdzv_id": "job9"}, id="PET_RDZV_*"
        ),
        pytest.param({"PET_STANDALONE": "1"}, {"standalone": True}, id="PET_STANDALONE flag"),
    ],
)
def test_pet_environment(parse, env, want):
    args = parse(["SCRIPT"], env=env)
    assert {k: getattr(args, k) for k in want} == want


# ------------------------------------------------------------------------------------------------
# YAML

YAML = [
    pytest.param("nproc_per_node: 2\n", {"nproc_per_node": "2"}, id="nproc_per_node (int -> torchrun's str)"),
    pytest.param("nproc-per-node: 2\n", {"nproc_per_node": "2"}, id="dashes in keys work too"),
    pytest.param("nnodes: 1:2\n", {"nnodes": "1:2"}, id="nnodes 1:2 unquoted stays '1:2' (not YAML 1.1 base 60)"),
    pytest.param("nnodes: '2:4'\n", {"nnodes": "2:4"}, id="nnodes quoted"),
    pytest.param("nnodes: 3\n", {"nnodes": "3"}, id="nnodes as a number"),
    pytest.param(
        "rdzv_backend: etcd-v3\nrdzv_endpoint: etcd:2379\nrdzv_id: job-1\n",
        {"rdzv_backend": "etcd-v3", "rdzv_endpoint": "etcd:2379", "rdzv_id": "job-1"},
        id="rdzv_*",
    ),
    pytest.param(
        "rdzv_conf:\n  timeout: 3\n  cacert: /etc/ca.pem\n", {"rdzv_conf": "timeout=3,cacert=/etc/ca.pem"}, id="rdzv_conf as a mapping"
    ),
    pytest.param(
        "max_restarts: 4\nspares: 1\nlease_ttl: 2.5\nsandbox_steps: 3\n",
        {"max_restarts": 4, "spares": 1, "lease_ttl": 2.5, "sandbox_steps": 3},
        id="typed options",
    ),
    pytest.param("max_restarts: 2.0\nlease_ttl: 3\n", {"max_restarts": 2, "lease_ttl": 3.0}, id="whole float for an int, int for a float"),
    pytest.param("max_restarts: '5'\n", {"max_restarts": 5}, id="quoted number for an int"),
    pytest.param("no_live: true\nstandalone: true\n", {"no_live": True, "standalone": True}, id="flags"),
    pytest.param("snapshot_send: overlap\n", {"snapshot_send": "overlap"}, id="a choice"),
    pytest.param("snapshot_parity: 3\n", {"snapshot_parity": 3}, id="an int: parity groups"),
    pytest.param(
        "node_id: gpu-node-3\nevent_log: /tmp/ev.jsonl\n", {"node_id": "gpu-node-3", "event_log": "/tmp/ev.jsonl"}, id="free text options"
    ),
    pytest.param("", {"nproc_per_node": "1"}, id="empty file = defaults"),
    pytest.param("# only a comment\n", {"max_restarts": 0}, id="comment-only file = defaults"),
]


@pytest.mark.parametrize("yaml, want", YAML)
def test_yaml_sets_options_by_dest(parse, yaml, want):
    args = parse(["SCRIPT"], yaml=yaml)
    assert {k: getattr(args, k) for k in want} == want


# precedence: command line > PET_* > YAML > default, for an int option and a str option
PRECEDENCE = [
    pytest.param(None, None, None, 0, "1", id="default"),
    pytest.param("yaml", None, None, 4, "4", id="YAML beats default"),
    pytest.param("yaml", "env", None, 2, "2", id="PET_ beats YAML"),
    pytest.param("yaml", "env", "cli", 7, "7", id="command line beats PET_ and YAML"),
    pytest.param("yaml", None, "cli", 7, "7", id="command line beats YAML"),
    pytest.param(None, "env", None, 2, "2", id="PET_ beats default"),
]


@pytest.mark.parametrize("yaml_on, env_on, cli_on, restarts, nproc", PRECEDENCE)
def test_precedence(parse, yaml_on, env_on, cli_on, restarts, nproc):
    yaml = "max_restarts: 4\nnproc_per_node: 4\n" if yaml_on else None
    env = {"PET_MAX_RESTARTS": "2", "PET_NPROC_PER_NODE": "2"} if env_on else None
    argv = (["--max-restarts", "7", "--nproc-per-node", "7"] if cli_on else []) + ["SCRIPT"]
    args = parse(argv, yaml=yaml, env=env)
    assert (args.max_restarts, args.nproc_per_node) == (restarts, nproc)


def test_yaml_does_not_override_unrelated_options(parse):
    args = parse(["--spares", "3", "SCRIPT"], yaml="max_restarts: 1\n")
    assert (args.spares, args.max_restarts) == (3, 1)


# ------------------------------------------------------------------------------------------------
# health

HEALTH = [
    pytest.param(None, [], {}, id="no health config -> defaults"),
    pytest.param(
        "health:\n  hang_timeout: 30\n  fatal_xids: [79, 48]\n  nvml: false\n",
        [],
        {"hang_timeout": 30.0, "fatal_xids": [79, 48], "nvml": False},
        id="YAML health section",
    ),
    pytest.param(None, ["--health-hang-timeout", "3"], {"hang_timeout": 3.0}, id="--health-hang-timeout 3"),
    pytest.param(
        None,
        ["--health-fatal-xids", "79,48", "--health-nvml", "false", "--health-straggler-window", "10"],
        {"fatal_xids": [79, 48], "nvml": False, "straggler_window": 10},
        id="list, bool and int flags",
    ),
    pytest.param(
        "health:\n  hang_timeout: 30\n  poll_interval: 7\n",
        ["--health-hang-timeout", "3"],
        {"hang_timeout": 3.0, "poll_interval": 7.0},
        id="flag beats YAML, other YAML health values kept",
    ),
]


@pytest.mark.parametrize("yaml, flags, want", HEALTH)
def test_health(parse, yaml, flags, want):
    args = parse(flags + ["SCRIPT"], yaml=yaml)
    assert isinstance(args.health, HealthConfig)
    expected = {**HealthConfig().to_dict(), **want}
    assert args.health.to_dict() == expected
    assert not any(k.startswith("health__") for k in vars(args))


# ------------------------------------------------------------------------------------------------
# mistakes: one line, UsageError, says what to fix

YAML_ERRORS = [
    pytest.param(
        "nproc_per_nod: 2\n", ["unknown key 'nproc_per_nod'", "did you mean 'nproc_per_node'"], id="unknown key with a suggestion"
    ),
    pytest.param("sparez: 1\n", ["unknown key 'sparez'", "did you mean 'spares'"], id="unknown tm-launch key"),
    pytest.param("helth:\n  nvml: false\n", ["unknown key 'helth'", "did you mean 'health'"], id="misspelt health"),
    pytest.param("completely_unrelated: 1\n", ["unknown key 'completely_unrelated'"], id="unknown key, no suggestion"),
    pytest.param("training_script: train.py\n", ["unknown key 'training_script'"], id="the script cannot come from YAML"),
    pytest.param("spares: two\n", ["'spares' has the wrong type", "'two'"], id="text for an int"),
    pytest.param("max_restarts: 2.5\n", ["'max_restarts' has the wrong type", "2.5"], id="fraction for an int"),
    pytest.param("spares: true\n", ["'spares' has the wrong type", "True"], id="bool for an int"),
    pytest.param("lease_ttl: soon\n", ["'lease_ttl' has the wrong type"], id="text for a float"),
    pytest.param("rdzv_id: yes\n", ["'rdzv_id' has the wrong type"], id="YAML 1.1 bool for a text option"),
    pytest.param("no_live: 'yes'\n", ["'no_live' must be true or false"], id="text for a flag"),
    pytest.param("rdzv_backend: [etcd, c10d]\n", ["'rdzv_backend' must be a single value, not list"], id="list for a value"),
    pytest.param("- nproc_per_node\n- 2\n", ["top level must be a mapping"], id="non-mapping YAML (list)"),
    pytest.param("just some text\n", ["top level must be a mapping"], id="non-mapping YAML (scalar)"),
    pytest.param("spares: 1\nnproc_per_node: [2\nmax_restarts: 1\n", ["not valid YAML at line 3"], id="invalid YAML with its line number"),
    pytest.param("spares: 1\n  bad indent: 2\n", ["not valid YAML at line 2"], id="bad indentation"),
    pytest.param("health: 5\n", ["'health' must be a mapping"], id="health not a mapping"),
    pytest.param(
        "health:\n  hang_timout: 3\n", ["health.hang_timout: unknown key", "did you mean 'hang_timeout'"], id="unknown health key"
    ),
    pytest.param("health:\n  hang_timeout: soon\n", ["health.hang_timeout: expected a number"], id="health wrong type"),
    pytest.param("health:\n  poll_interval: 0\n", ["health.poll_interval: must be > 0"], id="health out of range"),
    pytest.param("nnodes: 3:2\n", ["MIN (3) is larger than MAX (2)"], id="nnodes 3:2 from YAML"),
    pytest.param("spares: -1\n", ["--spares -1: must be 0 or more"], id="negative spares from YAML"),
    pytest.param("snapshot_send: later\n", ["'snapshot_send' must be one of commit, overlap, not 'later'"], id="not a choice"),
]


@pytest.mark.parametrize("yaml, fragments", YAML_ERRORS)
def test_yaml_errors(parse, yaml, fragments):
    with pytest.raises(UsageError) as e:
        parse(["SCRIPT"], yaml=yaml)
    text = one_line_error(e)
    for fragment in fragments:
        assert fragment in text, text


CLI_ERRORS = [
    pytest.param(["--nnodes", "3:2", "SCRIPT"], ["--nnodes 3:2", "MIN (3) is larger than MAX (2)"], id="--nnodes 3:2"),
    pytest.param(["--nnodes", "0:2", "SCRIPT"], ["minimum must be at least 1"], id="--nnodes 0:2"),
    pytest.param(["--nnodes", "two", "SCRIPT"], ["expected N or MIN:MAX"], id="--nnodes two"),
    pytest.param(["--nnodes", "1:2:3", "SCRIPT"], ["expected N or MIN:MAX"], id="--nnodes 1:2:3"),
    pytest.param(["no/such/train.py"], ["training script 'no/such/train.py' not found"], id="missing script"),
    pytest.param(
        ["--no-python", "no-such-program-xyz"], ["--no-python: program 'no-such-program-xyz' not found"], id="--no-python missing program"
    ),
    pytest.param(
        ["--rdzv-backend", "etcd-v3", "--rdzv-id", "my job/1", "SCRIPT"], ["--rdzv-id 'my job/1'"], id="bad run id (space, slash)"
    ),
    pytest.param(["--rdzv-backend", "etcd", "--rdzv-id", "x" * 129, "SCRIPT"], ["at most 128"], id="run id too long"),
    pytest.param(["--standalone", "--rdzv-id", "../other", "SCRIPT"], ["--rdzv-id '../other'"], id="run id escaping the prefix"),
    pytest.param(["--rdzv-backend", "etcd-v3", "--node-id", "a/b", "SCRIPT"], ["--node-id 'a/b'"], id="node id with a slash"),
    pytest.param(["--rdzv-backend", "etcd-v3", "--node-id", "_x", "SCRIPT"], ["--node-id '_x'"], id="node id etcd v2 would hide"),
    pytest.param(["--spares", "-1", "SCRIPT"], ["--spares -1: must be 0 or more"], id="negative spares"),
    pytest.param(["--lease-ttl", "0", "SCRIPT"], ["--lease-ttl 0.0: must be positive"], id="zero lease ttl"),
    pytest.param(["--sandbox-steps", "0", "SCRIPT"], ["--sandbox-steps 0: must be at least 1"], id="zero sandbox steps"),
    pytest.param(
        ["--snapshot-parity", "1", "SCRIPT"], ["--snapshot-parity 1: must be 0 (a whole copy) or a group of 2"], id="parity of one"
    ),
    pytest.param(["--max-restarts", "-1", "SCRIPT"], ["--max-restarts -1: must be 0 or more"], id="negative restarts"),
    pytest.param(["--health-hang-timeout", "-1", "SCRIPT"], ["health.hang_timeout: must be >= 0"], id="health flag range"),
    pytest.param(["--health-nvml", "maybe", "SCRIPT"], ["health.nvml: expected true or false"], id="health flag type"),
    pytest.param(["--config", "/no/such/tm.yaml", "SCRIPT"], ["--config /no/such/tm.yaml: no such file"], id="missing config file"),
]


@pytest.mark.parametrize("argv, fragments", CLI_ERRORS)
def test_command_line_errors(parse, argv, fragments):
    with pytest.raises(UsageError) as e:
        parse(argv)
    text = one_line_error(e)
    for fragment in fragments:
        assert fragment in text, text


def test_run_id_is_torchruns_business_under_its_own_backends(parse):
    args = parse(["--rdzv-backend", "c10d", "--rdzv-id", "any thing/goes", "SCRIPT"])
    assert args.rdzv_id == "any thing/goes"


def test_yaml_error_names_the_file(parse, tmp_path):
    with pytest.raises(UsageError) as e:
        parse(["SCRIPT"], yaml="bogus: 1\n")
    assert str(tmp_path / "tm.yaml") in one_line_error(e)


# ------------------------------------------------------------------------------------------------
# --rdzv-conf -> EtcdOptions (rendezvous.rdzv_conf.etcd_options)


def test_rdzv_conf_to_etcd_options(tmp_path):
    from rendezvous.rdzv_conf import etcd_options

    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    # torchrun's meaning: timeout is the rendezvous timeout; read_timeout is the etcd request timeout
    o = etcd_options("etcd-0:2379, etcd-1:2379", "job-1", f"timeout=600,read_timeout=2.5,user=alice,password_file={pw}")
    assert o.endpoints == ("etcd-0:2379", "etcd-1:2379")
    assert o.prefix == "/tm-launch/job-1/"
    assert (o.timeout, o.user, o.password) == (2.5, "alice", "s3cret")
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    tls = etcd_options("etcd-0:2379", "job-1", {"cacert": str(ca)})
    assert tls.endpoints == ("https://etcd-0:2379",) and tls.cacert == str(ca)
    assert "s3cret" not in repr(o)  # the password never shows in a repr (logs, tracebacks)
    assert etcd_options(None, "j", "").endpoints == ("localhost:2379",)


@pytest.mark.parametrize(
    "conf, fragment",
    [
        pytest.param("timeot=3", "--rdzv-conf: unknown key 'timeot'", id="unknown key"),
        pytest.param("timeout", "must have a value", id="key without value"),
        pytest.param("read_timeout=0", "read_timeout=0: must be a positive number", id="read timeout zero"),
        pytest.param("=3", "--rdzv-conf =3", id="value without key"),
        pytest.param("timeout=soon", "timeout=soon: must be a positive number", id="timeout not a number"),
        pytest.param("timeout=0", "timeout=0: must be a positive number", id="timeout zero"),
        pytest.param("password_file=/no/such/pw", "cannot read /no/such/pw", id="unreadable password file"),
        pytest.param("user=u,password=hunter2", "use password_file=FILE or the TM_ETCD_PASSWORD", id="password on the command line"),
        pytest.param(
            {"user": "u", "password": "hunter2"}, "use password_file=FILE or the TM_ETCD_PASSWORD", id="password in YAML rdzv_conf"
        ),
        pytest.param("key=/etc/hostname", "key= needs cert= too", id="key without cert"),
        pytest.param("cacert=/no/such/ca.pem", "cacert=/no/such/ca.pem: no such file", id="missing CA file"),
    ],
)
def test_rdzv_conf_errors(conf, fragment):
    from rendezvous.rdzv_conf import etcd_options

    with pytest.raises(UsageError) as e:
        etcd_options("127.0.0.1:2379", "job-1", conf)
    assert fragment in one_line_error(e)


@pytest.mark.parametrize("conf", ["password=hunter2", "user=u,password=hunter2,timeout", "password=hunter2,=3"])
def test_rdzv_conf_errors_never_echo_a_password(conf):
    from rendezvous.rdzv_conf import etcd_options

    with pytest.raises(UsageError) as e:
        etcd_options("127.0.0.1:2379", "job-1", conf)
    assert "hunter2" not in str(e.value)
