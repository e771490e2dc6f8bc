"""torch's own pipeline stages recover live (``tests/scripts/pipelining.py``).

``torch.distributed.pipelining``'s ``PipelineStage`` under torch's schedules, built without
``input_args``: each stage infers its neighbours' shapes on its first step. 2 nodes of 1 worker
(one stage per rank, no data-parallel replica: the lost stage comes from its snapshot on the
next node) and a warm spare; real agents, etcd, gloo and SIGKILLs. Each run: one new
generation, the survivor keeps its process, and every rank's whole state (its stage modules'
state_dict, the optimizer's and the scheduler's) is bitwise equal to the same script's fault-free
run under plain torchrun.
"""

import glob
import os
import signal
import threading
import time

import pytest
import torch
from test_live_ddp_options import assert_bitwise, assert_one_live_generation
from torchrun_reference import run_torchrun

from tm_launch.local.localjob import REPO

SCRIPT = os.path.join(REPO, "tests", "scripts", "pipelining.py")
STEPS = 24
PAUSE = 8  # faulty runs hold every rank at this step until the spare is parked
KILL = 12
pytestmark = pytest.mark.timeout(900)  # whole jobs (a torchrun reference and a live run) on a loaded 2-core machine


def script(schedule: str, workdir: str, *extra: str) -> list[str]:
    return ["--schedule", schedule, "--steps", str(STEPS), "--out", os.path.join(workdir, "out"), *extra]


def load(workdir: str) -> dict:
    return {os.path.basename(p).rsplit(".", 1)[1]: torch.load(p) for p in glob.glob(os.path.join(workdir, "out.rank*"))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Each schedule's fault-free final state per rank under plain torchrun (computed once)."""
    cache = {}

    def get(schedule: str, nodes: int = 2, extra: tuple = ()) -> dict:
        key = (schedule, nodes, extra)
        if key not in cache:
            workdir = str(tmp_path_factory.mktemp(f"ref-{schedule}-{nodes}"))
            run_torchrun(SCRIPT, script(schedule, workdir, *extra), nproc=nodes, timeout=600)
            cache[key] = load(workdir)
            assert sorted(cache[key]) == [f"rank{r}" for r in range(nodes)]
        return cache[key]

    return get


def run(local_job, schedule: str, rank: int, phase: str, nodes: int = 2, spares: int = 1, fault=None, extra: tuple = (), start_spares=None):
    """``nodes`` nodes of 1 worker plus ``spares`` spares; the worker holding ``rank`` SIGKILLs
    itself at ``phase`` of step KILL, once the spares have parked; ``fault(job)`` runs then.
    ``start_spares(job)``: in place of starting the spares and waiting for them to park.
    ``{workdir}`` in ``extra`` is the job's working directory."""
    job = local_job(nnodes=str(nodes), nproc=1, script=SCRIPT, launcher_args=["--max-restarts", "3"])
    job.env = {"OMP_NUM_THREADS": "1"}
    trigger = os.path.join(job.workdir, "trigger")
    job.script_args = script(
        schedule,
        job.workdir,
        "--step-log",
        job.step_log,
        "--pause-step",
        str(PAUSE),
        "--pause-file",
        trigger,
        "--kill-rank",
        str(rank),
        "--kill-step",
        str(KILL),
        "--kill-phase",
        phase,
        "--kill-trigger",
        trigger,
        "--kill-marker",
        os.path.join(job.workdir, "killed"),
        *(arg.format(workdir=job.workdir) for arg in extra),
    )
    job.start_all([f"n{i}" for i in range(nodes)])
    job.wait_for(lambda s: s["generation"] is not None, 120, "generation 0")
    if start_spares is not None:
        start_spares(job)
    else:
        names = ["spare"] if spares == 1 else [f"spare{i}" for i in range(spares)]
        for name in names:
            job.start(name)
        for name in names:
            job.wait_parked(name, timeout=300)  # a loaded machine: its sandbox imports torch and builds the stage
    if fault:
        fault(job)
    open(trigger, "w").close()
    codes = job.wait(timeout=300)
    return job, codes, load(job.workdir)


def received(job) -> list[str]:
    return [line for n in job.nodes.values() for line in n.log().splitlines() if "received" in line and "worker" in line]


@pytest.mark.parametrize(
    "schedule, rank, phase",
    [
        pytest.param("gpipe", 1, "backward", marks=pytest.mark.slow),
        pytest.param("gpipe", 0, "microbatch", marks=pytest.mark.slow),
        pytest.param("interleaved", 1, "backward", marks=pytest.mark.slow),
        pytest.param("1f1b", 1, "microbatch", marks=pytest.mark.slow),
        pytest.param("1f1b", 0, "backward", marks=pytest.mark.slow),
        pytest.param("zero-bubble", 1, "microbatch", marks=pytest.mark.slow),
        pytest.param("looped-bfs", 1, "backward", marks=pytest.mark.slow),
        pytest.param("zbv", 0, "microbatch", marks=pytest.mark.slow),
        pytest.param("dualpipev", 1, "backward", marks=pytest.mark.slow),
    ],
)
def test_pipeline_stage_recovers_live_in_one_generation(local_job, reference, schedule, rank, phase):
    """Pure pipeline, 2 stages (interleaved and zero-bubble: 4, two per rank): the lost stage comes from its
    snapshot on the survivor; a spare promoted to rank 0 (it warmed up as rank 1) runs the script
    again for it; the survivor sets its stage up again with the joiner, in the step that runs again."""
    job, codes, got = run(local_job, schedule, rank, phase)
    assert_one_live_generation(job, codes, survivor=1 - rank)
    assert_bitwise(got, reference(schedule))
    assert any("snapshot of step" in line for line in received(job)), received(job)
    survivor = next(name for name, code in codes.items() if name != "spare" and code == 0)  # a node's group rank is not its name's
    assert "set up again with their neighbours" in job.nodes[survivor].log()


@pytest.mark.slow
def test_pipeline_by_data_parallel_joiner_takes_its_stage_from_its_replica(local_job, reference):
    """2 stages x 2 data-parallel replicas on 4 nodes: rank 1 (stage 1 of replica 0) is lost, the
    spare (warmed up as rank 3) runs the script again as rank 1 and receives the stage from rank 3,
    its dp peer; the pipeline group of ranks 2 and 3 is kept (its stages set up again with the others)."""
    job, codes, got = run(local_job, "gpipe", 1, "backward", nodes=4)
    plans = [e for e in job.events() if e["kind"] == "plan" and e.get("generation", 0) >= 1]
    assert len(plans) == 1 and plans[0]["live"], job.logs_tail()
    victim = plans[0]["replaced"]["spare"]
    assert codes[victim] != 0 and all(c == 0 for n, c in codes.items() if n != victim), job.logs_tail()
    assert_bitwise(got, reference("gpipe", 4))
    assert any("from rank 3" in line for line in received(job)), received(job)
    assert "promoted to rank 1 (warmed up as rank 3)" in job.nodes["spare"].log()


def step_pids(job) -> dict:
    """rank -> the pids that logged its steps, per generation."""
    pids: dict = {}
    for _, rank, _, generation, pid in job.step_records():
        pids.setdefault(rank, {}).setdefault(generation, set()).add(pid)
    return pids


@pytest.mark.slow
def test_pipeline_by_fsdp2_replicas_joiner_takes_its_stage_from_its_replica(local_job, reference):
    """2 stages x 2 FSDP2 replicas on 4 nodes (``--fsdp replicas``: each stage in ``fully_shard`` over its
    ``(dp, shard)`` sub-mesh, ``pp`` outermost, as torchtitan's ``dp_replicate``): rank 1 (stage 0
    of the second pipeline) is SIGKILLed in a backward microbatch, while its neighbour rank 3 is
    part-way through its backward (FSDP's unsharded parameters and training state mid-step) and
    FSDP's gradient reduction over each stage's replicas is still ahead, inside the schedule. The
    spare runs the script again as rank 1 and receives the stage from rank 0, its replica; the
    step runs again on every rank (rank 3 drops its poisoned step with FSDP's per-step state put
    back); one generation, the three survivors keep their processes, and every rank's local
    shards, optimizer and scheduler state are bitwise equal to torchrun's fault-free run."""
    job, codes, got = run(local_job, "gpipe", 1, "backward", nodes=4, extra=("--fsdp", "replicas"))
    plans = [e for e in job.events() if e["kind"] == "plan" and e.get("generation", 0) >= 1]
    assert len(plans) == 1 and plans[0]["live"], job.logs_tail()
    victim = plans[0]["replaced"]["spare"]
    assert codes[victim] != 0 and all(c == 0 for n, c in codes.items() if n != victim), job.logs_tail()
    assert_bitwise(got, reference("gpipe", 4, ("--fsdp", "replicas")))
    assert any("worker 1]" in line and "from rank 0" in line for line in received(job)), received(job)
    pids = step_pids(job)
    for survivor in (0, 2, 3):
        assert set(pids[survivor]) == {0, 1} and len(pids[survivor][0] | pids[survivor][1]) == 1, pids
    survivors = [name for name, code in codes.items() if code == 0 and name != "spare"]
    assert all("set up again with their neighbours" in job.nodes[n].log() for n in survivors), job.logs_tail()  # kept pipelines too


@pytest.mark.slow
def test_pipeline_by_fsdp2_shards_joiner_takes_its_shard_from_its_snapshot(local_job, reference):
    """2 stages, each sharded by FSDP2 over 2 ranks (``--fsdp shards``: ``fully_shard`` over ``dp``
    of a ``(pp, dp)`` mesh), on 4 nodes: no rank holds a copy of another's shard, so rank 1's
    comes from its snapshot on the next node (the ranks of its stage's pipeline peer hold other
    stages: not replicas). Rank 1 is SIGKILLed in a backward microbatch; one generation, the
    survivors keep their processes, every rank's shards, optimizer and scheduler bitwise."""
    job, codes, got = run(local_job, "gpipe", 1, "backward", nodes=4, extra=("--fsdp", "shards"))
    plans = [e for e in job.events() if e["kind"] == "plan" and e.get("generation", 0) >= 1]
    assert len(plans) == 1 and plans[0]["live"], job.logs_tail()
    victim = plans[0]["replaced"]["spare"]
    assert codes[victim] != 0 and all(c == 0 for n, c in codes.items() if n != victim), job.logs_tail()
    assert_bitwise(got, reference("gpipe", 4, ("--fsdp", "shards")))
    assert any("worker 1]" in line and "snapshot" in line for line in received(job)), received(job)
    pids = step_pids(job)
    for survivor in (0, 2, 3):
        assert set(pids[survivor]) == {0, 1} and len(pids[survivor][0] | pids[survivor][1]) == 1, pids


@pytest.mark.slow
def test_two_faults_in_a_row(local_job, reference):
    """GPipe on 2 nodes and 2 spares: rank 1 dies in a backward microbatch and a spare takes it;
    once the job trains again, rank 0's worker is SIGKILLed from outside and the second spare
    takes it (running the script again as rank 0). Two live generations, each stage set up again
    with its new neighbour; every rank bitwise."""
    box: dict = {}

    def second_kill(job):
        node = next(n["id"] for n in job.status()["nodes"] if n["ranks"] == [0])  # the first failover keeps it

        def wait_then_kill():
            job.wait_step(KILL + 2, timeout=300)  # reached only once the first failover trains again
            job.kill_worker(node)

        box["thread"] = threading.Thread(target=wait_then_kill, daemon=True)
        box["thread"].start()

    # 0.5 s steps: the second kill, seen from outside, must land before the last step
    job, codes, got = run(local_job, "gpipe", 1, "backward", spares=2, fault=second_kill, extra=("--step-sleep", "0.5"))
    box["thread"].join(timeout=10)
    plans = [e for e in job.events() if e["kind"] == "plan" and e.get("generation", 0) >= 1]
    assert len(plans) == 2 and all(p["live"] for p in plans), [p.get("cause") for p in plans]
    assert sum(1 for c in codes.values() if c != 0) == 2, codes
    assert_bitwise(got, reference("gpipe"))


def wait_for_file(path: str, timeout: float) -> int:
    deadline = time.time() + timeout
    while not os.path.exists(path):
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    with open(path) as f:
        return int(f.read())


@pytest.mark.slow
@pytest.mark.parametrize("killed", ["agent", "worker"])
def test_a_spare_killed_while_it_warms_up_its_stage_leaves_the_job_untouched(local_job, reference, killed):
    """A spare's sandboxed worker holds in its first warm-up step, its pipeline stage built
    (``--sandbox-hold``), while the job is in its step 8; then its agent (``agent``) or that
    worker (``worker``) is SIGKILLed, before it ever parked. Nothing happens to the job: no plan,
    no generation, both active ranks keep their processes. The job then loses rank 1 in a backward
    microbatch and recovers live in one generation: ``agent``, from a second spare that warms up
    after the first is gone; ``worker``, from the same spare, whose agent started its worker again
    (its warm-up done in full this time). Every rank ends bitwise equal to torchrun's run."""
    box = {}

    def start_spares(job):
        held = os.path.join(job.workdir, "held")
        job.start("spare0")
        pid = wait_for_file(held, timeout=300)
        assert pid in job.worker_pids("spare0"), (pid, job.worker_pids("spare0"))
        if killed == "agent":
            job.kill_agent("spare0")
            job.nodes["spare0"].proc.wait(timeout=30)
            job.wait_for(lambda s: all(n["id"] != "spare0" or n["role"] != "spare" for n in s["nodes"]), 120, "spare0 gone")
            job.start("spare1")
            box["taker"] = "spare1"
        else:
            os.kill(pid, signal.SIGKILL)
            box["taker"] = "spare0"
        job.wait_parked(box["taker"], timeout=300)
        box["plans_before_the_fault"] = [e for e in job.events() if e["kind"] == "plan" and e.get("generation", 0) >= 1]
        box["steps_before_the_fault"] = job.step_records()

    job, codes, got = run(local_job, "gpipe", 1, "backward", start_spares=start_spares, extra=("--sandbox-hold", "{workdir}/held"))
    assert box["plans_before_the_fault"] == [], box["plans_before_the_fault"]
    assert {rank for _, rank, _, _, _ in box["steps_before_the_fault"]} == {0, 1}, box["steps_before_the_fault"]
    early = {rank: {pid for _, r, _, _, pid in box["steps_before_the_fault"] if r == rank} for rank in (0, 1)}
    assert all(len(pids) == 1 for pids in early.values()), early  # no active rank restarted by the spare's loss
    plans = [e for e in job.events() if e["kind"] == "plan" and e.get("generation", 0) >= 1]
    assert len(plans) == 1 and plans[0]["live"] and box["taker"] in plans[0]["replaced"], (plans, job.logs_tail())
    victim = plans[0]["replaced"][box["taker"]]
    assert codes[victim] != 0 and codes[box["taker"]] == 0, job.logs_tail()
    records = job.step_records()
    assert {pid for _, r, _, _, pid in records if r == 0} == early[0], "rank 0 kept its process through both"
    assert_bitwise(got, reference("gpipe"))
    if killed == "worker":
        assert "spare: sandbox worker 0" in job.nodes["spare0"].log() and "it will be started again" in job.nodes["spare0"].log()
