"""tm-launch under a real Slurm, as its users write it: ``sbatch examples/slurm/train.sbatch``.

A three-node Slurm on this machine (``slurm_cluster.py``: munged, slurmctld, ``slurmd -N n1..n3``
on loopback), the example job script with 2 active nodes + 1 spare, no ``--rdzv-id`` nor
``--node-id`` given (tm-launch reads them from srun's environment). While the job trains, one
active node's task (its tm-launch agent, and with it its workers) is SIGKILLed: the spare takes
its rank live, every rank's whole state at the end equals the same script's fault-free run under
plain torchrun bit for bit, and Slurm records the batch job as COMPLETED with exit code 0.
"""

import json
import os
import signal
import sys
import time

import pytest
from slurm_cluster import SlurmCluster, missing
from test_exactness import ORDINARY, differences, load
from torchrun_reference import run_torchrun

from tm_launch.local.localjob import REPO, LocalJob

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SBATCH = os.path.join(REPO, "examples", "slurm", "train.sbatch")
STEPS = 24
PAUSE = 8  # every rank holds at this step until the test says go (the spare has parked, the node is lost)
CASE = ("--bn", "--dropout", "0.3", "--counter", "--log-loss")  # per-rank buffers, RNG, a counter


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = missing()
    if why:
        pytest.skip(why)
    with SlurmCluster(str(tmp_path_factory.mktemp("slurm"))) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Every rank's state after the same script's fault-free run under plain torchrun."""
    ref_dir = str(tmp_path_factory.mktemp("ref"))
    run_torchrun(ORDINARY, ["--steps", str(STEPS), "--out", ref_dir, *CASE], nproc=2)
    return load(ref_dir)


def agent_of(job_id: str, node: str) -> int:
    """The pid of the tm-launch agent Slurm runs for ``job_id`` (a job, or a job array) on node
    ``node`` (its srun task)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if (
            len(cmd) > 2
            and cmd[1].endswith(b"/tm-launch")
            and cmd[2] != b"ctl"
            and job_id.encode() in (env.get(b"SLURM_JOB_ID"), env.get(b"SLURM_ARRAY_JOB_ID"))
            and env.get(b"SLURMD_NODENAME") == node.encode()
        ):
            return int(pid)
    raise LookupError(f"no tm-launch agent of Slurm job {job_id} on {node}")


@pytest.mark.parametrize(
    "allocation",
    [
        ["--nodes=3"],  # one allocation of 3 nodes: 2 train, 1 spare
        ["--array=0-2", "--nodes=1", "--exclusive"],  # a job array of 3 one-node tasks, one run: the third to join is the spare
    ],
    ids=["one-allocation", "job-array"],
)
def test_sbatch_example_two_active_one_spare_a_node_task_killed(slurm, etcd_server, tmp_path, reference, allocation):
    out, trigger = str(tmp_path / "out"), str(tmp_path / "go")
    env = {
        "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
        "ETCD_ENDPOINTS": etcd_server.endpoint,
        "ACTIVE": "2",
        "GPUS_PER_NODE": "1",
        "MAX_RESTARTS": "3",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": REPO,
    }
    script = [ORDINARY, "--steps", str(STEPS), "--out", out, *CASE, "--pause-step", str(PAUSE), "--pause-file", trigger]
    job_id = slurm.sbatch(SBATCH, [*allocation, f"--output={tmp_path}/slurm-%A_%a.out"], script, cwd=str(tmp_path), env=env)
    array = any(a.startswith("--array") for a in allocation)
    run = LocalJob(endpoint=etcd_server.endpoint, run_id=f"slurm-{job_id}", workdir=str(tmp_path))

    def says() -> str:
        outputs = sorted(tmp_path.glob("slurm-*.out"))
        text = "".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-4000:] for p in outputs) or "(no job output)"
        return text + slurm.logs_tail(5)

    def formed(s) -> bool:
        states = {f.get("JobState") for f in slurm.jobs(job_id)}
        assert states <= {"PENDING", "CONFIGURING", "RUNNING"}, f"the Slurm job is {states} before the fault"
        return s["generation"] is not None and len(s["nodes"]) == 3

    def node_name(node_id: str) -> str:  # an array task's node id is NODENAME-JOBID
        return node_id.rsplit("-", 1)[0] if array else node_id

    try:
        run.wait_for(formed, 300, "generation 0 and the spare")
        status = run.status()
        assert sorted(node_name(n["id"]) for n in status["nodes"]) == slurm.names, status  # node ids from Slurm's names
        spare = next(n["id"] for n in status["nodes"] if n["role"] == "spare")
        run.wait_parked(spare, timeout=300)
        victim = next(n["id"] for n in run.status()["nodes"] if n["role"] == "active")
        os.kill(agent_of(job_id, node_name(victim)), signal.SIGKILL)  # the node's srun task; its workers die with it
        time.sleep(0.5)
        open(trigger, "w").close()
        tasks = slurm.wait_job(job_id, 480)
    except BaseException:
        print(says())
        raise
    # One allocation: srun waits for every node's task, then the run succeeded: COMPLETED. A job
    # array: each task is a job of its own; the lost node's task ends when its srun does, the run
    # still going (`ctl result` says so: exit 3), so that task alone is FAILED, the others COMPLETED.
    lost_task = victim.rsplit("-", 1)[1] if array else None
    expected = {t["JobId"]: ("FAILED", "3:0") if t["JobId"] == lost_task else ("COMPLETED", "0:0") for t in tasks}
    assert {t["JobId"]: (t["JobState"], t["ExitCode"]) for t in tasks} == expected, says()
    assert len(tasks) == (3 if array else 1)
    roles = {n["id"]: n["role"] for n in run.status()["nodes"]}
    assert roles[victim] == "replaced" and roles[spare] == "finished", (roles, says())
    events = [json.loads(line) for line in run.ctl("events", "--json").stdout.splitlines() if line.strip()]
    plans = [e for e in events if e["kind"] == "plan" and e.get("generation", 0) >= 1]
    assert plans and all(p["live"] for p in plans), says()  # the survivor kept its process
    assert not [e for e in events if e["kind"] == "state_lost"], says()
    got = load(out)
    assert sorted(got) == sorted(reference) == ["rank0", "rank1"], says()
    assert differences(got, reference) == {}, says()


def test_two_tasks_per_node_is_one_error_line(slurm, etcd_server, tmp_path):
    """srun starting 2 agents per node (the job asked for 2 tasks per node, the step inherits it):
    each says what to write instead, in one line, and exits 2."""
    (tmp_path / "train.py").write_text("")
    job_script = tmp_path / "two.sbatch"
    job_script.write_text(
        f"#!/bin/bash\nsrun tm-launch --nnodes 1 --rdzv-backend etcd-v3 --rdzv-endpoint {etcd_server.endpoint} train.py\n"
    )
    env = {"PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}", "PYTHONPATH": REPO}
    job_id = slurm.sbatch(
        str(job_script), ["--nodes=1", "--ntasks-per-node=2", f"--output={tmp_path}/out-%j.txt"], [], cwd=str(tmp_path), env=env
    )
    (fields,) = slurm.wait_job(job_id, 240)
    said = (tmp_path / f"out-{job_id}.txt").read_text()
    errors = [line for line in said.splitlines() if line.startswith("tm-launch: error:")]
    assert len(errors) == 2 and all("srun started 2 tasks on one node" in e and "--ntasks-per-node=1" in e for e in errors), said
    assert "Traceback" not in said, said
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] == "2:0", (fields, said)
