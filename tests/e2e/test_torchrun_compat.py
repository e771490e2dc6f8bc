"""The same scripts under `torchrun` and `tm-launch` (both --standalone, 2 workers): what a worker
sees must be the same: torchrun's env vars, argv (with torchrun's ``${local_rank}`` macro), a
working env:// gloo group, and, for tests/scripts/train.py, bitwise-equal final parameters; what the
user sees too: the failure report, the worker's traceback, the --log-dir/--redirects layout.

Each launcher start costs ~5-10 s here (torch imports on 2 cores): the fast suite starts each
launcher once per behaviour (script mode); other modes, training and multi-node are ``slow``.
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))  # the repository root
BIN = os.path.dirname(sys.executable)
sys.path.insert(0, ROOT)
from tests.scripts.env_dump import TORCHRUN_ENV  # noqa: E402

# Must be equal under both launchers. The rest of TORCHRUN_ENV must be present but may differ:
# MASTER_PORT (each picks its own), TORCHELASTIC_RUN_ID (random per --standalone),
# TORCHELASTIC_USE_AGENT_STORE (a launcher's choice; both work with env:// init),
# TORCHELASTIC_ERROR_FILE (same layout, checked by ERROR_FILE, in each launcher's own directory).
# TORCH_NCCL_ASYNC_ERROR_HANDLING is torchrun's 1 too: a live worker sets its own (2) when it
# starts live mode (tests/unit/worker/comms/test_communicators.py), and env_dump never calls tm_launch.init().
SAME = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "OMP_NUM_THREADS",
    "MASTER_ADDR",
    "TORCHELASTIC_SIGNALS_TO_HANDLE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)
SCRIPT_ARGS = ["--foo", "bar", "--tag", "${local_rank}"]  # torchrun substitutes ${local_rank} in worker args


def launch(launcher: str, args: list[str], timeout: float = 180, rc: int = 0, env: dict | None = None) -> str:
    """Run `<launcher> --standalone --nproc-per-node 2 ARGS` from the repo root; its output."""
    env = {**{k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS" and not k.startswith(("PET_", "TORCHELASTIC_"))}, **(env or {})}
    env["PYTHONPATH"] = ROOT  # tm_launch for tests/scripts/train.py under plain torchrun
    cmd = [os.path.join(BIN, launcher), "--standalone", "--nproc-per-node", "2", *args]
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{launcher} did not finish in {timeout} s: {' '.join(cmd)}\n{(e.output or '')[-4000:]}")
    assert done.returncode == rc, f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-4000:]}"
    return done.stdout


def error_file_pattern(rank: int, attempt: int = 0) -> str:
    """torchrun's TORCHELASTIC_ERROR_FILE: <log dir>/<run id>_<random>/attempt_<restart count>/<local rank>/error.json."""
    return rf".*/{{run_id}}_[^/]+/attempt_{attempt}/{rank}/error\.json"


def dump(launcher: str, mode: list[str], out) -> dict[int, dict]:
    """Run env_dump under ``launcher`` with ``mode`` (how the script is named); rank -> record."""
    launch(launcher, [*mode, "--out", str(out), *SCRIPT_ARGS])
    records = {}
    for rank in range(2):
        with open(out / f"rank{rank}.json") as f:
            records[rank] = json.load(f)
    return records


def assert_same_worker_view(ours: dict, theirs: dict, ours_out, theirs_out) -> None:
    for rank in range(2):
        a, b = ours[rank], theirs[rank]
        assert set(b["env"]) == set(TORCHRUN_ENV), f"torchrun itself lacks {set(TORCHRUN_ENV) - set(b['env'])}"
        assert set(a["env"]) == set(b["env"]), (
            f"rank {rank}: tm-launch env keys differ: "
            f"missing {sorted(set(b['env']) - set(a['env']))}, extra {sorted(set(a['env']) - set(b['env']))}"
        )
        assert {k: a["env"][k] for k in SAME} == {k: b["env"][k] for k in SAME}, f"rank {rank}"
        for record in (a, b):
            pattern = error_file_pattern(rank).format(run_id=re.escape(record["env"]["TORCHELASTIC_RUN_ID"]))
            assert re.fullmatch(pattern, record["env"]["TORCHELASTIC_ERROR_FILE"]), record["env"]["TORCHELASTIC_ERROR_FILE"]
        assert a["env"]["RANK"] == str(rank) and a["env"]["OMP_NUM_THREADS"] == "1"
        assert a["allreduce"] == b["allreduce"] == 3.0  # 1 + 2 over a real env:// gloo group
        assert a["local_ranks"] == b["local_ranks"] == ["0", "1"]
        norm_a = [x.replace(str(ours_out), "OUT") for x in a["argv"]]
        norm_b = [x.replace(str(theirs_out), "OUT") for x in b["argv"]]
        assert norm_a == norm_b, f"rank {rank}: argv differs"
        assert norm_a[-4:] == ["--foo", "bar", "--tag", a["env"]["LOCAL_RANK"]]  # macro substituted
        assert a["world_size"] == b["world_size"] == 2


def test_script_env_matches_torchrun(tmp_path):
    """The fast-suite proof of compatibility: one start of each launcher, script mode."""
    script = ["tests/scripts/env_dump.py"]
    theirs = dump("torchrun", script, tmp_path / "torchrun")
    ours = dump("tm-launch", script, tmp_path / "tm-launch")
    assert_same_worker_view(ours, theirs, tmp_path / "tm-launch", tmp_path / "torchrun")


@pytest.mark.slow  # over ~12 s on 2 cores: the fast tier keeps near 10 minutes
def test_failing_worker_restarts_and_report_match_torchrun(tmp_path):
    """Rank 1 raises in every attempt, one restart allowed: both launchers restart once with
    TORCHELASTIC_RESTART_COUNT 1, lay out --log-dir the same way (<run id>_<random>/attempt_N/
    <local rank>/error.json), fail with exit 1, and print the same root-cause block: the worker's
    traceback with the file:line that raised, from its @record error file. What the user reads is
    the same text: the block names the script (not tm-launch's worker wrapper), and the worker's
    own traceback on the console and in the error file has the script's frames only, with the
    absolute paths ``python SCRIPT`` gives (``__file__`` is absolute under both)."""
    blocks, layouts, names, consoles = {}, {}, {}, {}
    for launcher in ("torchrun", "tm-launch"):
        out, logs = tmp_path / launcher, tmp_path / f"{launcher}-logs"
        output = launch(
            launcher,
            ["--max-restarts", "1", "--log-dir", str(logs), "tests/scripts/env_dump.py", "--out", str(out), "--fail-rank", "1"],
            rc=1,
        )
        for attempt in (0, 1):
            for rank in (0, 1):
                path = out / f"attempt{attempt}" / f"rank{rank}.json"
                if rank == 0 and not path.exists():
                    continue  # rank 0 may be stopped before it wrote anything: rank 1 fails at once
                env = json.loads(path.read_text())["env"]
                assert env["TORCHELASTIC_RESTART_COUNT"] == str(attempt), (launcher, attempt, rank)
                pattern = error_file_pattern(rank, attempt).format(run_id=re.escape(env["TORCHELASTIC_RUN_ID"]))
                assert re.fullmatch(pattern, env["TORCHELASTIC_ERROR_FILE"]), (launcher, env["TORCHELASTIC_ERROR_FILE"])
                assert env["TORCHELASTIC_ERROR_FILE"].startswith(str(logs) + "/"), (launcher, env["TORCHELASTIC_ERROR_FILE"])
        [run_dir] = os.listdir(logs)  # one <run id>_<random> directory per agent
        layouts[launcher] = sorted(
            os.path.relpath(os.path.join(d, f), logs / run_dir) for d, _, files in os.walk(logs / run_dir) for f in files
        )
        start = output.rindex("Root Cause (first observed failure):")
        blocks[launcher] = output[start : output.index("=" * 20, start)]
        names[launcher] = re.findall(r"^(\S+) FAILED$", output, re.M)
        first = output.index("Traceback (most recent call last):")  # the worker's, printed by Python
        consoles[launcher] = output[first : output.index("ValueError: env_dump", first)]
    assert names["tm-launch"][-1] == names["torchrun"][-1] == "tests/scripts/env_dump.py", names
    assert consoles["tm-launch"] == consoles["torchrun"], consoles
    tracebacks = {launcher: block[block.index("traceback :") :] for launcher, block in blocks.items()}
    assert tracebacks["tm-launch"] == tracebacks["torchrun"], tracebacks
    assert layouts["tm-launch"] == layouts["torchrun"] == ["attempt_0/1/error.json", "attempt_1/1/error.json"], layouts
    for launcher, block in blocks.items():
        assert "rank      : 1 (local_rank: 1)" in block and "exitcode  : 1" in block, (launcher, block)
        assert re.search(r'File ".*tests/scripts/env_dump\.py", line \d+, in fail', block), (launcher, block)
        assert "ValueError: env_dump: rank 1 fails on purpose" in block, (launcher, block)
        assert re.search(r"error_file: .*/attempt_1/1/error\.json", block), (launcher, block)


def test_root_cause_without_record_is_read_from_stderr_log(tmp_path):
    """A script without torch's ``@record`` writes no error file: torchrun's block then has no
    traceback ("To enable traceback see ..."). When its stderr goes to a file, tm-launch still
    names the root cause in its failure line (the one etcd, the plan and every node repeat):
    the exception and the innermost file:line of the last traceback there."""
    script = tmp_path / "norecord.py"
    script.write_text("import os\ndef fail():\n    raise KeyError('no @record here')\nif os.environ['RANK'] == '1':\n    fail()\n")
    output = launch("tm-launch", ["--redirects", "2", "--log-dir", str(tmp_path / "logs"), str(script)], rc=1)
    assert "To enable traceback see" in output  # torchrun's block, as torch formats it
    assert re.search(
        rf"worker 1 \(pid \d+\) exited with code 1: KeyError: 'no @record here' \(at {re.escape(str(script))}:3\); "
        "reporting the failure",
        output,
    ), output


def test_log_dir_devnull_means_no_log_files(tmp_path):
    """``--log-dir /dev/null`` is torchrun's "no log files": --redirects/--tee are ignored and
    worker output stays on the console, unprefixed (tm-launch crashed making directories in it)."""
    script = tmp_path / "hello.py"
    # Each line in one write: both workers share the console, and a line printed in pieces
    # could interleave with the other worker's (seen once: "err-of 1out-of").
    script.write_text(
        "import os\nos.write(1, f\"out-of {os.environ['RANK']}\\n\".encode())\nos.write(2, f\"err-of {os.environ['RANK']}\\n\".encode())\n"
    )
    output = launch("tm-launch", ["--log-dir", os.devnull, "--redirects", "1", "--tee", "2", str(script)])
    lines = output.splitlines()
    assert {"out-of 0", "out-of 1", "err-of 0", "err-of 1"} <= set(lines), output


@pytest.mark.slow
def test_rdzv_conf_last_call_timeout_keeps_torchruns_meaning(local_job):
    """``--rdzv-conf last_call_timeout=S`` (torchrun's key; tm-launch's own is --last-call): with
    --nnodes 1:2 the first node waits S seconds for more before generation 0 forms, so a node
    that joins 3 s later is in it (with --last-call's 1 s it would have started alone)."""
    import time

    job = local_job(nnodes="1:2", launcher_args=["--rdzv-conf", "last_call_timeout=30"], script_args=["--steps", "3"])
    job.start("a")
    job.wait_for(lambda s: {n["id"] for n in s["nodes"]} == {"a"}, 60, "a to join")
    time.sleep(3)
    job.start("b")
    assert job.wait(timeout=120) == {"a": 0, "b": 0}, job.logs_tail()
    [first] = [e for e in job.events() if e["kind"] == "plan" and e.get("generation") == 0]
    assert sorted(first["nodes"]) == ["a", "b"], first


@pytest.mark.slow  # over ~12 s on 2 cores: the fast tier keeps near 10 minutes
def test_redirects_without_log_dir_go_to_files_like_torchrun(tmp_path):
    """``--redirects 3`` without ``--log-dir``: torchrun writes worker output to files under a
    temporary ``torchelastic_*`` directory it keeps (DefaultLogsSpecs), not to the console; so does
    tm-launch (it says where)."""
    script = tmp_path / "hello.py"
    script.write_text("import os, sys\nprint('out-of', os.environ['RANK'])\nprint('err-of', os.environ['RANK'], file=sys.stderr)\n")
    layouts = {}
    for launcher in ("torchrun", "tm-launch"):
        tmp = tmp_path / launcher
        tmp.mkdir()
        output = launch(launcher, ["--redirects", "3", str(script)], env={"TMPDIR": str(tmp)})
        assert "out-of" not in output and "err-of" not in output, (launcher, output)
        [logs] = [d for d in os.listdir(tmp) if d.startswith("torchelastic_")]
        [run_dir] = os.listdir(tmp / logs)
        layouts[launcher] = sorted(
            os.path.relpath(os.path.join(d, f), tmp / logs / run_dir) for d, _, files in os.walk(tmp / logs / run_dir) for f in files
        )
        for rank in (0, 1):
            assert (tmp / logs / run_dir / "attempt_0" / str(rank) / "stdout.log").read_text() == f"out-of {rank}\n"
            assert f"err-of {rank}\n" in (tmp / logs / run_dir / "attempt_0" / str(rank) / "stderr.log").read_text()
    assert layouts["tm-launch"] == layouts["torchrun"], layouts
    assert "worker output" in output and str(tmp_path / "tm-launch" / "torchelastic_") in output, output


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(["-m", "tests.scripts.env_dump"], id="module"),
        pytest.param(["--no-python", sys.executable, "tests/scripts/env_dump.py"], id="no-python"),
    ],
)
def test_modes_match_torchrun(tmp_path, mode):
    theirs = dump("torchrun", mode, tmp_path / "torchrun")
    ours = dump("tm-launch", mode, tmp_path / "tm-launch")
    assert_same_worker_view(ours, theirs, tmp_path / "tm-launch", tmp_path / "torchrun")
    if mode[0] == "-m":
        assert ours[0]["argv"][0] == os.path.join(ROOT, "tests", "scripts", "env_dump.py")


@pytest.mark.slow
def test_train_parameters_bitwise_equal(tmp_path):
    """tests/scripts/train.py (DDP, 2 workers, 10 steps) ends with identical parameters under both.
    Once the script called ``tm_launch.init()``, a live worker has set what torch reads for its
    groups (NCCL errors cleaned up; gloo keeps its default, the full mesh); under torchrun nothing changed."""
    params, seen = {}, {}
    for launcher in ("torchrun", "tm-launch"):
        out, env_out = tmp_path / f"{launcher}.pt", tmp_path / f"{launcher}.json"
        launch(launcher, ["tests/scripts/train.py", "--steps", "10", "--out", str(out), "--env-out", str(env_out)])
        params[launcher] = torch.load(out)
        seen[launcher] = json.loads(env_out.read_text())
    assert seen == {
        "torchrun": {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_GLOO_LAZY_INIT": None},
        "tm-launch": {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_GLOO_LAZY_INIT": None},
    }
    theirs, ours = params["torchrun"], params["tm-launch"]
    assert theirs.keys() == ours.keys() and len(theirs) > 0
    for name in theirs:
        assert torch.equal(theirs[name], ours[name]), f"{name} differs"


BOOM = """import sys
print(__file__, sys.argv, __name__, file=sys.stderr)
def fail():
    raise ValueError("boom")
fail()
"""


@pytest.mark.parametrize("mode", [["pkg/boom.py", "--x", "1"], ["-m", "pkg.boom", "--x", "1"]], ids=["script", "module"])
def test_worker_wrapper_is_invisible(tmp_path, mode):
    """Live mode starts Python workers as ``python -u -m tm_launch.worker SCRIPT``: the script must
    see and show what ``python -u SCRIPT`` (torchrun's command) gives: ``__file__`` (absolute),
    ``sys.argv`` as given, ``__main__``, and on an uncaught exception the same traceback on
    stderr, without the wrapper's or runpy's frames."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "boom.py").write_text(BOOM)
    env = {**os.environ, "PYTHONPATH": ROOT}
    runs = {
        how: subprocess.run([sys.executable, "-u", *prefix, *mode], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        for how, prefix in (("python", []), ("wrapper", ["-m", "tm_launch.worker"]))
    }
    assert runs["python"].returncode == runs["wrapper"].returncode == 1
    assert "Traceback" in runs["python"].stderr and "line 4, in fail" in runs["python"].stderr
    assert runs["wrapper"].stderr == runs["python"].stderr


RERUN = """import gc, sys, types, weakref
from tm_launch.worker.spare.sandbox import RankChanged
probe = sys.modules.setdefault("rerun_probe", types.ModuleType("rerun_probe"))  # outlives the runs
if hasattr(probe, "refs"):  # the second run, for the new ranks: the first run's objects are gone
    print("first run's objects alive:", [name for name, ref in probe.refs.items() if ref() is not None])
    sys.exit(0)
gc.freeze()  # as tm_launch.init() does in a sandbox: this namespace is frozen, the objects below are not
class Model:
    pass
model = Model()  # a global, held by a namespace its functions refer back to
model.me = model  # and in a cycle of its own
def use():
    return model
def main():
    local = Model()
    local.me = local
    probe.refs = {"global": weakref.ref(model), "local": weakref.ref(local)}
    raise RankChanged("promoted to rank 0")
main()
"""


@pytest.mark.parametrize("mode", [["pkg/rerun.py"], pytest.param(["-m", "pkg.rerun"], marks=pytest.mark.slow)], ids=["script", "module"])
def test_a_script_run_again_frees_the_first_run(tmp_path, mode):
    """A spare promoted to other ranks runs the script again in its process (``RankChanged``):
    what the first run built, in its globals or its frames, in cycles or not, must be freed
    before the second run builds its own (on a GPU the memory would be needed twice), also when
    the namespace holding it is older than ``tm_launch.init()``'s ``gc.freeze()``."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "rerun.py").write_text(RERUN)
    out = subprocess.run(
        [sys.executable, "-m", "tm_launch.worker", *mode],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "first run's objects alive: []" in out.stdout, out.stdout
