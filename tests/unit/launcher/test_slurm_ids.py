"""What tm-launch takes from Slurm's environment (tm_launch.launcher.slurm): table tests, and
through the parser (explicit options win, torchrun's backends untouched)."""

import os

import pytest

from rendezvous.rdzv_conf import UsageError
from tm_launch.launcher.options import parse_args
from tm_launch.launcher.slurm import SlurmJob, describe, slurm_job, spares_in_allocation, tasks_per_node

# An srun task's environment as Slurm 22.05 set it on this machine (tests/e2e/test_slurm.py's cluster).
STEP = {
    "SLURM_JOB_ID": "41",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "1",
    "SLURMD_NODENAME": "n2",
    "SLURM_STEP_NUM_NODES": "3",
    "SLURM_NNODES": "3",
    "SLURM_STEP_TASKS_PER_NODE": "1(x3)",
    "SLURM_TASKS_PER_NODE": "1(x3)",
    "SLURM_NTASKS_PER_NODE": "1",
}


def without(env: dict, *names: str) -> dict:
    return {k: v for k, v in env.items() if k not in names}


@pytest.mark.parametrize(
    "env, rdzv_id, node_id, expected",
    [
        ({}, None, None, None),  # not Slurm
        (without(STEP, "SLURM_STEP_ID"), None, None, None),  # the batch script itself, not an srun task
        (STEP, None, None, SlurmJob("slurm-41", "n2", 3)),
        (STEP, "none", None, SlurmJob("slurm-41", "n2", 3)),  # torchrun's default --rdzv-id
        (STEP, "slurm-41", None, SlurmJob("slurm-41", "n2", 3)),  # the job's own id, given: still one allocation
        (STEP, None, "gpu7", SlurmJob("slurm-41", "gpu7", 3)),  # --node-id wins
        (STEP, "job42", None, SlurmJob("job42", "n2-41", 3, True)),  # a second sbatch joining job42: its own node ids
        (STEP, "job42", "x", SlurmJob("job42", "x", 3, True)),
        ({**STEP, "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "1"}, None, None, SlurmJob("slurm-40", "n2-41", 3, True)),
        (without(STEP, "SLURMD_NODENAME"), None, None, SlurmJob("slurm-41", "task1", 3)),
        (without(STEP, "SLURM_STEP_NUM_NODES", "SLURM_NNODES"), None, None, SlurmJob("slurm-41", "n2", 0)),
        ({**without(STEP, "SLURM_STEP_ID"), "SLURM_STEPID": "0", "SLURM_JOBID": "41"}, None, None, SlurmJob("slurm-41", "n2", 3)),
    ],
)
def test_slurm_job(env, rdzv_id, node_id, expected):
    assert slurm_job(env, rdzv_id, node_id) == expected


@pytest.mark.parametrize(
    "env, problem",
    [
        ({**STEP, "SLURM_STEP_TASKS_PER_NODE": "2(x3)"}, "srun started 2 tasks on one node (SLURM_STEP_TASKS_PER_NODE=2(x3))"),
        ({**STEP, "SLURM_STEP_TASKS_PER_NODE": "1,8"}, "srun started 8 tasks on one node"),
        (
            {**without(STEP, "SLURM_STEP_TASKS_PER_NODE"), "SLURM_TASKS_PER_NODE": "4(x2)"},
            "srun started 4 tasks on one node (SLURM_TASKS_PER_NODE=4(x2))",
        ),
        ({**STEP, "SLURM_STEP_TASKS_PER_NODE": "one"}, "SLURM_TASKS_PER_NODE='one': not Slurm's form"),
        ({**STEP, "SLURMD_NODENAME": "bad name"}, "the Slurm node name 'bad name' cannot name"),
    ],
)
def test_slurm_job_refuses(env, problem):
    with pytest.raises(UsageError, match=None) as e:
        slurm_job(env, None, None)
    assert problem in str(e.value)
    assert "\n" not in str(e.value)


def test_the_job_script_count_does_not_override_the_step_count():
    """sbatch --ntasks-per-node=8 (for other steps) with srun --ntasks-per-node=1: the step says 1."""
    env = {**STEP, "SLURM_TASKS_PER_NODE": "8(x3)", "SLURM_NTASKS_PER_NODE": "8"}
    assert slurm_job(env, None, None).node_id == "n2"


@pytest.mark.parametrize("text, counts", [("1", [1]), ("1(x3)", [1, 1, 1]), ("2(x2),1", [2, 2, 1]), ("", [])])
def test_tasks_per_node(text, counts):
    assert tasks_per_node(text) == counts


@pytest.mark.parametrize("nodes, max_nodes, spares", [(3, 2, 1), (2, 2, 0), (1, 2, 0), (0, 2, 0), (12, 8, 4)])
def test_spares_in_allocation(nodes, max_nodes, spares):
    assert spares_in_allocation(SlurmJob("r", "n", nodes), max_nodes) == spares


@pytest.mark.parametrize(
    "job, max_nodes, line",
    [
        (SlurmJob("slurm-41", "n2", 3), 2, "Slurm: run slurm-41, node n2; 3 node(s) in this step for --nnodes 2: 1 spare(s)"),
        (SlurmJob("slurm-41", "n2", 2), 2, "Slurm: run slurm-41, node n2; 2 node(s) in this step for --nnodes 2: 0 spare(s)"),
        (
            SlurmJob("slurm-40", "n2-41", 1, True),
            2,
            "Slurm: run slurm-40, node n2-41; 1 node(s) in this allocation, joining a run of several allocations "
            "(nodes beyond --nnodes 2 are spares)",
        ),
    ],
)
def test_describe(job, max_nodes, line):
    assert describe(job, max_nodes) == line


@pytest.fixture
def script(tmp_path, monkeypatch):
    for k in list(os.environ):
        if k.startswith(("SLURM", "PET_")):
            monkeypatch.delenv(k)
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


def test_parser_takes_slurm_ids_and_explicit_options_win(script, monkeypatch):
    for k, v in STEP.items():
        monkeypatch.setenv(k, v)
    args = parse_args(["--nnodes", "2", "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", "e:2379", script])
    assert (args.rdzv_id, args.node_id, args.slurm.nodes) == ("slurm-41", "n2", 3)
    args = parse_args(["--rdzv-backend", "etcd-v3", "--rdzv-id", "mine", "--node-id", "me", script])
    assert (args.rdzv_id, args.node_id) == ("mine", "me")
    monkeypatch.setenv("PET_RDZV_ID", "frompet")
    assert parse_args(["--rdzv-backend", "etcd-v3", script]).rdzv_id == "frompet"


def test_parser_leaves_torchrun_backends_alone(script, monkeypatch):
    for k, v in {**STEP, "SLURM_STEP_TASKS_PER_NODE": "4(x3)"}.items():
        monkeypatch.setenv(k, v)
    args = parse_args(["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29400", script])
    assert args.rdzv_id == "none" and args.node_id is None and args.slurm is None
    with pytest.raises(UsageError, match="srun started 4 tasks on one node"):
        parse_args(["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", "e:2379", script])
