"""Replicas found, not assumed (issue 57, part 0; ``tm_launch.worker.generation.replica_survey``).

A 2 (dp) x 2 (tp-style) job whose tp positions hold different plain tensors (``hybrid.py
--layout tp-plain``) and whose script registers model, optimizer and scheduler without
``replicas=``, as scripts written before that rule do. Plain torchrun runs it to the end; so
must tm-launch: each rank killed in turn recovers live (the joiner receives from its dp peer,
rank ^ 2, found by the survey) and bitwise; two nodes holding both copies of one tp position lost
at once restart every worker from the script's checkpoint, loudly, and the job finishes, equal
to the fault-free run (the audit never fails a fresh restart). Real agents, etcd, gloo, SIGKILL.
"""

import os

import pytest
from test_live_layouts import HYBRID, PAUSE, STEPS, assert_bitwise, assert_live, load, received, script, torchrun_reference
from test_live_layouts import run as run_live
from test_snapshots import logs, node_of

LAYOUT = "tp-plain"


def run_with_two_spares(local_job, fault):
    """4 nodes of 1 worker and two parked spares (a loaded machine warms two up slowly);
    ``fault(job)`` runs once both parked, while every rank holds at step PAUSE."""
    job = local_job(nnodes="4", nproc=1, script=HYBRID, launcher_args=["--max-restarts", "3"])
    job.env = {"OMP_NUM_THREADS": "1"}
    trigger = os.path.join(job.workdir, "trigger")
    job.script_args = script(LAYOUT, job.workdir, "--step-log", job.step_log, "--pause-step", str(PAUSE), "--pause-file", trigger)
    job.start_all([f"n{i}" for i in range(4)])
    job.wait_for(lambda s: s["generation"] is not None, 180, "generation 0")
    for name in ("spare0", "spare1"):
        job.start(name)
    for name in ("spare0", "spare1"):
        job.wait_parked(name, timeout=300)
    fault(job)
    open(trigger, "w").close()
    codes = job.wait(timeout=400)
    assert STEPS > PAUSE
    return job, codes, load(job.workdir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return torchrun_reference(tmp_path_factory)


@pytest.mark.slow  # over ~12 s on 2 cores: the fast tier keeps near 10 minutes
@pytest.mark.parametrize(
    "rank, phase",
    [
        (3, "backward"),
        pytest.param(0, "optimizer", marks=pytest.mark.slow),
        pytest.param(1, "logging", marks=pytest.mark.slow),
        pytest.param(2, "vote", marks=pytest.mark.slow),
    ],
)
@pytest.mark.timeout(900)  # a live run and a torchrun run (> 300 s on a loaded 2-core machine)
def test_a_tp_position_with_nothing_declared_recovers_live_from_its_found_replica(local_job, reference, rank, phase):
    job, codes, got = run_live(local_job, LAYOUT, kill=(rank, phase))
    assert_live(job, codes, rank)
    assert_bitwise(got, reference(LAYOUT))
    assert any(f"from rank {rank ^ 2}" in line and f"worker {rank}]" in line for line in received(job)), received(job)
    text = logs(job)
    assert "replicas found: model+optimizer: [0, 2] [1, 3]" in text, text[-3000:]
    assert "every replica agrees" in text, text[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_both_copies_of_a_tp_position_lost_restart_from_the_checkpoint_and_the_job_finishes(local_job, reference):
    """Ranks 0 and 2 (tp position 0's only two copies, found replicated: no snapshot of them)
    lose their nodes together: the state is lost, every worker restarts from the script's
    checkpoint (a fresh start: surveyed again, never audited) and the job runs to its end."""

    def lose_two(job):
        a, b = node_of(job, 0), node_of(job, 2)
        job.kill_agent(a)
        job.kill_agent(b)

    job, codes, got = run_with_two_spares(local_job, lose_two)
    assert_bitwise(got, reference(LAYOUT))
    events = job.events()
    lost = [e for e in events if e["kind"] == "state_lost"]  # one per survivor, all of one generation
    assert lost and {(e["generation"], tuple(e["lost_ranks"])) for e in lost} == {(lost[0]["generation"], (0, 2))}, lost
    text = logs(job)
    assert "resumed from the checkpoint of step 10" in text, text[-3000:]
    assert "replicas diverged" not in text and "max restarts" not in text, text[-3000:]
