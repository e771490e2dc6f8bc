"""Layouts no live rank replicates recover live, from in-memory snapshots (``tests/scripts/hybrid.py``).

Pure FSDP2, FSDP2 x TP, a 2-stage pipeline without data-parallel peers and DDP with
``ZeroRedundancyOptimizer``: real agents, real etcd, real gloo, real SIGKILLs (a worker, or a
whole node: its agent), at every phase of a step, including while a snapshot is on its way to
its holder. Every test ends with every rank's parameters and optimizer state bitwise equal to the
same script's fault-free run under plain torchrun; the survivors keep their processes (their
nodes exit 0, nobody but the victim is replaced). Where both copies of a snapshot are gone (two
neighbouring nodes lost at once) the job restarts from its checkpoint, loudly, naming the ranks
and the step.
"""

import os
import re
import subprocess
import sys
import threading

import pytest
from test_live_layouts import HYBRID, assert_bitwise, load, script

from tm_launch.local.localjob import REPO, downtime

STEPS = 24
PAUSE = 10  # every rank holds at this step until the spares are parked
KILL = 14  # the kill happens at the first step >= KILL once released (checkpoints every 10 steps)
PARITY = ("--snapshot-parity", "2")  # 4 nodes: groups {0, 1} and {2, 3}, each one's parity in stripes on the other


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return torchrun_reference(tmp_path_factory)


def torchrun_reference(tmp_path_factory):
    """``get(layout, world, extra) -> {rank: state}``: plain torchrun's fault-free run, cached."""
    cache = {}

    def get(layout: str, world: int = 4, extra: tuple = ()) -> dict:
        key = (layout, world, extra)
        if key not in cache:
            workdir = str(tmp_path_factory.mktemp(f"ref-{layout}-{world}"))
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), HYBRID]
            cmd += script(layout, workdir, "--steps", str(STEPS), *extra)
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, cwd=REPO)
            assert out.returncode == 0, out.stderr[-3000:]
            cache[key] = load(workdir)
            assert sorted(cache[key]) == [f"rank{r}" for r in range(world)]
        return cache[key]

    return get


def run(local_job, layout, world=4, nproc=1, spares=1, kill=None, fault=None, extra=(), launcher=()):
    """``world`` ranks on ``world / nproc`` nodes plus ``spares`` spare nodes; ``kill = (rank,
    phase)`` SIGKILLs the worker holding that rank at that point of step KILL; ``fault(job)``
    runs once the spares parked (training held at PAUSE until it returns)."""
    nodes = world // nproc
    job = local_job(nnodes=str(nodes), nproc=nproc, script=HYBRID, launcher_args=["--max-restarts", "3", *launcher])
    job.env = {"OMP_NUM_THREADS": "1"}
    trigger = os.path.join(job.workdir, "trigger")
    args = [*extra, "--steps", str(STEPS), "--step-log", job.step_log, "--pause-step", str(PAUSE), "--pause-file", trigger]
    if kill:
        args += ["--kill-rank", str(kill[0]), "--kill-step", str(KILL), "--kill-phase", kill[1], "--kill-trigger", trigger,
                 "--kill-marker", os.path.join(job.workdir, "killed")]  # fmt: skip
    job.script_args = script(layout, job.workdir, *args)
    job.start_all([f"n{i}" for i in range(nodes)])
    job.wait_for(lambda s: s["generation"] is not None, 120, "generation 0")
    for i in range(spares):
        job.start(f"spare{i}")
    for i in range(spares):
        job.wait_parked(f"spare{i}")
    if fault:
        fault(job)
    open(trigger, "w").close()
    codes = job.wait(timeout=300)
    return job, codes, load(job.workdir)


def plans(job) -> list[dict]:
    return [e for e in job.events() if e["kind"] == "plan" and e.get("generation", 0) >= 1]


def assert_live(job, codes, changes: int = 1) -> None:
    """``changes`` live generation changes, each replacing one node by a spare; only the
    replaced nodes exit non-zero; no state was lost."""
    got = plans(job)
    assert len(got) == changes, f"generation changes: {[p['cause'] for p in got]}\n{job.logs_tail()}"
    assert all(p["live"] and len(p["replaced"]) == 1 for p in got), job.logs_tail()
    victims = {old for p in got for old in p["replaced"].values()}
    assert all((c != 0) == (n in victims) for n, c in codes.items()), (codes, job.logs_tail())
    assert not [e for e in job.events() if e["kind"] == "state_lost"]


def logs(job) -> str:
    return "\n".join(n.log() for n in job.nodes.values())


def node_of(job, rank: int) -> str:
    return next(n["id"] for n in job.status()["nodes"] if rank in n["ranks"])


def later(job, box: dict, second_fault) -> None:
    """``second_fault(job)`` on a thread beside the job, once the first failover trains again
    (generation 1 at step KILL + 4); ``box["thread"]`` is the thread to join."""

    def wait_then_fault():
        job.wait_for(lambda s: s["generation"] == 1, 120, "the first failover")
        job.wait_step(KILL + 4)
        second_fault(job)

    box["thread"] = threading.Thread(target=wait_then_fault, daemon=True)
    box["thread"].start()


@pytest.mark.slow  # over ~12 s on 2 cores: the fast tier keeps near 10 minutes
@pytest.mark.parametrize(
    "layout, world, rank, phase, launcher",
    [
        ("fsdp-tp", 4, 0, "backward", ()),
        pytest.param("zero", 4, 1, "backward", (), marks=pytest.mark.slow),
        pytest.param("fsdp", 4, 2, "vote", (), marks=pytest.mark.slow),
        pytest.param("fsdp", 4, 2, "vote", ("--snapshot-send", "overlap"), marks=pytest.mark.slow),
        pytest.param("fsdp", 4, 3, "logging", (), marks=pytest.mark.slow),
        pytest.param("fsdp", 4, 0, "forward", (), marks=pytest.mark.slow),
        pytest.param("fsdp-tp", 4, 1, "forward", (), marks=pytest.mark.slow),
        pytest.param("fsdp-tp", 4, 2, "optimizer", (), marks=pytest.mark.slow),
        pytest.param("fsdp-tp", 4, 3, "logged", (), marks=pytest.mark.slow),
        pytest.param("pp", 2, 0, "backward", (), marks=pytest.mark.slow),
        pytest.param("pp", 2, 1, "vote", (), marks=pytest.mark.slow),
        pytest.param("zero", 4, 0, "logging", (), marks=pytest.mark.slow),
    ],
)
def test_a_lost_shard_comes_back_from_its_snapshot(local_job, reference, layout, world, rank, phase, launcher):
    """The worker holding ``rank`` is SIGKILLed at ``phase`` of a step; nobody else holds its
    shard. The spare (warmed up as the last rank) takes ``rank`` and receives its snapshot from
    the next node's rank; the survivors keep their processes. (``pp`` on 2 ranks: two stages,
    no data-parallel peer; ``zero``: the parameters come from a live replica, the optimizer
    partition from the snapshot.)"""
    job, codes, got = run(local_job, layout, world, kill=(rank, phase), launcher=launcher)
    assert_live(job, codes)
    assert_bitwise(got, reference(layout, world))
    holder = (rank + 1) % world
    text = logs(job)
    assert "received this rank's snapshot of step" in text and f"from rank {holder} in" in text, text[-3000:]


@pytest.mark.parametrize("layout", [pytest.param("fsdp-tp", marks=pytest.mark.slow), pytest.param("hsdp", marks=pytest.mark.slow)])
def test_a_rank_late_to_its_boundary_frees_the_peers_already_in_the_next_step(local_job, reference, layout):
    """Rank 2 is still finishing step KILL - 1 (after its commit) when rank 3 dies at the start
    of step KILL; ranks 0 and 1 are already in step KILL, rank 0 waiting for rank 2 in their
    data-parallel group, which the substitution does not change. Rank 2 sees the new
    generation at its boundary and enters it without running step KILL: it closes its
    communicators as it goes (rank 0's wait fails now, not at the collective timeout), and
    every member of a group that any member closed builds it again (had rank 0 rebuilt it
    alone, it would wait for rank 2 in that setup)."""
    lag = ("--lag-rank", "2", "--lag-step", str(KILL - 1), "--lag-seconds", "1.5")
    job, codes, got = run(local_job, layout, kill=(3, "forward"), extra=lag, launcher=("--collective-timeout", "30"))
    assert_live(job, codes)
    assert_bitwise(got, reference(layout))
    assert "entering generation" not in logs(job), logs(job)[-3000:]


@pytest.mark.slow  # over ~12 s on 2 cores: the fast tier keeps near 10 minutes
@pytest.mark.parametrize(
    "layout, rank, phase, launcher",
    [
        ("fsdp", 1, "snapshot", ()),
        pytest.param("fsdp-tp", 2, "snapshot-node", (), marks=pytest.mark.slow),
        pytest.param("zero", 0, "snapshot", (), marks=pytest.mark.slow),
        pytest.param("fsdp", 1, "snapshot", ("--snapshot-send", "overlap"), marks=pytest.mark.slow),
        pytest.param("fsdp-tp", 2, "snapshot-node", ("--snapshot-send", "overlap"), marks=pytest.mark.slow),
    ],
)
def test_a_kill_while_the_snapshot_is_on_its_way_returns_every_rank_one_step(local_job, reference, layout, rank, phase, launcher):
    """The victim dies (``snapshot-node``: its whole node) after taking the step's snapshot and
    before its holder got it: the newest snapshot of that rank is the step before. Every
    survivor returns to that step from its own snapshot, the joiner receives the victim's, and
    the job runs one step again (with ``--snapshot-send overlap``, where the send overlaps the
    next step, two): still bitwise."""
    job, codes, got = run(local_job, layout, kill=(rank, phase), launcher=launcher)
    assert_live(job, codes)
    assert_bitwise(got, reference(layout))
    text = logs(job)
    when = "overlapping the next step" if "overlap" in launcher else "before each step commits"
    assert re.search(rf"snapshots every 1 step\(s\): .* to rank \d+ {when}, everything registered kept locally", text), text[-3000:]
    assert "returned to step" in text and "from this rank's own snapshot" in text, text[-3000:]
    assert "step(s) run again" in text, text[-3000:]


@pytest.mark.slow
def test_a_node_lost_with_the_generation_store_keeps_its_per_rank_state(local_job, reference):
    """Dropout on every rank (per-rank RNG state, registered). The node holding rank 0 also
    hosts the generation's store (the first node of generation 0); its agent is SIGKILLed.
    Rank 0's RNG comes back with its snapshot from rank 1's node, not from the store."""

    def kill_store_node(job):
        job.kill_agent(node_of(job, 0))

    job, codes, got = run(local_job, "fsdp", fault=kill_store_node, extra=("--dropout", "0.1"))
    assert_live(job, codes)
    assert_bitwise(got, reference("fsdp", extra=("--dropout", "0.1")))


@pytest.mark.slow
def test_node_loss_of_a_zero_rank(local_job, reference):
    """ZeRO: the parameters come from a live replica, the lost partition from its snapshot."""
    job, codes, got = run(local_job, "zero", fault=lambda job: job.kill_agent(node_of(job, 2)))
    assert_live(job, codes)
    assert_bitwise(got, reference("zero"))
    text = logs(job)
    assert "received the training state of step" in text and "received this rank's snapshot of step" in text, text[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1])
def test_node_loss_of_a_pipeline_stage(local_job, reference, stage):
    """Two pipeline stages, one per node, no data-parallel peer: a stage's node is lost (its
    agent SIGKILLed, the worker with it) while training is held at a step boundary; the other
    stage meets the loss in the schedule's first send or receive. The spare takes the stage
    from its snapshot on the other node; the other stage keeps its process."""
    job, codes, got = run(local_job, "pp", 2, fault=lambda job: job.kill_agent(node_of(job, stage)))
    assert_live(job, codes)
    assert_bitwise(got, reference("pp", 2))
    assert "received this rank's snapshot of step" in logs(job), logs(job)[-3000:]


@pytest.mark.slow
def test_two_faults_in_a_row(local_job, reference):
    """Rank 1's worker dies at step KILL and a spare takes it; once the job trains again, rank
    2's worker dies (its holder, rank 3, kept its snapshot) and the second spare takes it."""

    box: dict = {}

    def fault(job):
        later(job, box, lambda job: job.kill_worker(node_of(job, 2)))

    # 100 ms steps: the second kill, seen from outside, must land before the last step; no DCP
    # checkpoint in the way (a kill inside its collectives is another test's subject).
    extra = ("--step-sleep", "0.1", "--ckpt-every", "1000")
    job, codes, got = run(local_job, "fsdp", spares=2, kill=(1, "backward"), fault=fault, extra=extra)
    box["thread"].join(timeout=10)
    assert_live(job, codes, changes=2)
    assert_bitwise(got, reference("fsdp", extra=("--ckpt-every", "1000")))


@pytest.mark.slow
@pytest.mark.parametrize("launcher", [(), PARITY], ids=["copy", "parity"])
def test_a_drain_hands_an_unreplicated_shard_to_the_spare(local_job, reference, launcher):
    """``ctl drain`` of the node holding rank 1 of a pure FSDP2 job: at the switch step the
    leaving rank's snapshot reaches its holder (with parity too: a whole copy on the ring's
    holder, as the switch step is in nobody's parity yet), the spare receives it from there;
    nothing runs again, every node exits 0."""

    def drain(job):
        assert job.ctl("drain", node_of(job, 1)).returncode == 0
        job.wait_for(lambda s: s["generation"] == 1, 60, "the drain plan")

    job, codes, got = run(local_job, "fsdp", fault=drain, extra=("--step-sleep", "0.05"), launcher=launcher)
    assert all(c == 0 for c in codes.values()), job.logs_tail()
    assert "step(s) run again" not in logs(job), logs(job)[-3000:]
    assert_bitwise(got, reference("fsdp"))
    assert "received this rank's snapshot of step" in logs(job), logs(job)[-3000:]


@pytest.mark.slow
def test_two_neighbouring_nodes_lost_at_once_fall_back_to_the_checkpoint_loudly(local_job, reference):
    """Ranks 1 and 2 lose their nodes together: rank 1's snapshot lived on rank 2's node. The
    job cannot continue live; it restarts every worker from its checkpoint and says which rank
    and which step were lost."""

    def lose_two(job):
        a, b = node_of(job, 1), node_of(job, 2)
        job.kill_agent(a)
        job.kill_agent(b)

    job, codes, got = run(local_job, "fsdp", spares=2, fault=lose_two)
    assert_bitwise(got, reference("fsdp"))  # = the fault-free run, which resumes from the same checkpoint
    lost = [e for e in job.events() if e["kind"] == "state_lost"]
    assert lost and lost[0]["lost_ranks"] == [1], [e.get("cause") for e in plans(job)]
    assert "no live rank and no snapshot holds the state of rank(s) [1]" in logs(job)
    assert "resumed from the checkpoint of step" in logs(job)


def test_snapshots_that_do_not_fit_are_refused_at_start(local_job):
    """``--snapshot-memory-limit`` below what the snapshots need: the job stops when training
    starts, with one line saying how much they need, and is not restarted."""
    job = local_job(nnodes="2", nproc=1, script=HYBRID, launcher_args=["--max-restarts", "3", "--snapshot-memory-limit", "1KB"])
    job.env = {"OMP_NUM_THREADS": "1"}
    job.script_args = ["--layout", "fsdp", "--steps", str(STEPS)]
    job.start_all(["n0", "n1"])
    codes = job.wait(timeout=240)
    assert all(c != 0 for c in codes.values()), codes
    text = logs(job)
    assert "snapshots need" in text and "over --snapshot-memory-limit 1.0 KiB" in text, text[-3000:]
    failed = [e for e in job.events() if e["kind"] == "job_failed"]
    assert failed and "over --snapshot-memory-limit" in failed[0]["message"], job.events()
    assert not plans(job), [p["cause"] for p in plans(job)]  # failed at once: no restart
    assert not [e for e in job.events() if e["kind"] == "state_lost"]


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["optimizer", "vote"])
def test_a_zero_rank_lost_after_its_step_committed_recovers_live(local_job, reference, phase):
    """Killed once its step committed (inside ZeroRedundancyOptimizer's step, before its
    parameter broadcast; or in the vote, its vote counted): the survivors are in ZeRO's
    broadcasts, some waiting on the dead rank, some on a survivor. Each leaves at once (its end
    of the dead rank's connections shut down; a survivor that fails closes its communicator's
    sockets, which fails the ones waiting on it), the job returns to the step's snapshot and
    goes on live, bitwise. It used to wait out --collective-timeout (120 s) and replace a
    survivor too."""
    job, codes, got = run(local_job, "zero", kill=(3, phase))
    assert_live(job, codes)
    fault_time = os.path.getmtime(os.path.join(job.workdir, "killed"))
    assert downtime(job.step_records(), fault_time)["downtime_s"] < 30, job.logs_tail()
    assert_bitwise(got, reference("zero"))


@pytest.mark.parametrize(
    "rank, phase",
    [
        pytest.param(1, "backward", marks=pytest.mark.slow),  # the fast tier: a snapshot copy, not parity
        pytest.param(2, "vote", marks=pytest.mark.slow),
        pytest.param(0, "snapshot", marks=pytest.mark.slow),
    ],
)
def test_with_parity_a_lost_shard_is_rebuilt_from_its_groups_parity(local_job, reference, rank, phase):
    """``--snapshot-parity 2``: no rank keeps a whole copy of another's snapshot; the group of
    ranks 0 and 1 keeps its parity in two stripes on ranks 2 and 3, and the other way round.
    The worker holding ``rank`` is SIGKILLed at ``phase``; the spare rebuilds its snapshot from
    both stripes and the other member's own snapshot (``snapshot``: the stripe was on its way,
    every rank returns one step), the survivors keep their processes, every rank bitwise."""
    job, codes, got = run(local_job, "fsdp", kill=(rank, phase), launcher=PARITY)
    assert_live(job, codes)
    assert_bitwise(got, reference("fsdp"))
    text = logs(job)
    group, holders = ([0, 1], [2, 3]) if rank < 2 else ([2, 3], [0, 1])
    assert f"into the parity of ranks {group}, in 2 stripe(s) kept by rank(s) {holders}" in text, text[-3000:]
    other = [m for m in group if m != rank]
    assert f"from its group's parity on rank(s) {holders} and the snapshots of rank(s) {other}" in text, text[-3000:]
    assert "received this rank's snapshot" not in text


@pytest.mark.slow
def test_with_parity_a_node_loss_then_a_kill_in_the_group_it_kept_a_stripe_for(local_job, reference):
    """Rank 2's node is lost (its agent SIGKILLed): rank 2 is rebuilt from the parity on ranks 0
    and 1, and the stripe of group {0, 1} it kept is gone; the members send their snapshot
    again to the new process. Once the job trains again rank 0's worker dies: it is rebuilt from
    that new stripe, the other one and rank 1's snapshot. Bitwise at the end."""

    box: dict = {}

    def fault(job):
        job.kill_agent(node_of(job, 2))
        later(job, box, lambda job: job.kill_worker(node_of(job, 0)))

    extra = ("--step-sleep", "0.1", "--ckpt-every", "1000")
    job, codes, got = run(local_job, "fsdp", spares=2, fault=fault, extra=extra, launcher=PARITY)
    box["thread"].join(timeout=10)
    assert_live(job, codes, changes=2)
    assert_bitwise(got, reference("fsdp", extra=("--ckpt-every", "1000")))
    text = logs(job)
    assert "from its group's parity on rank(s) [0, 1] and the snapshots of rank(s) [3]" in text, text[-3000:]
    assert "from its group's parity on rank(s) [2, 3] and the snapshots of rank(s) [1]" in text, text[-3000:]


@pytest.mark.slow
def test_with_parity_two_members_of_one_group_lost_at_once_fall_back_to_the_checkpoint_loudly(local_job, reference):
    """Ranks 0 and 1 lose their nodes together: one parity rebuilds one member, not two. The
    job restarts from its checkpoint and names both ranks."""

    def lose_two(job):
        a, b = node_of(job, 0), node_of(job, 1)
        job.kill_agent(a)
        job.kill_agent(b)

    job, codes, got = run(local_job, "fsdp", spares=2, fault=lose_two, launcher=PARITY)
    assert_bitwise(got, reference("fsdp"))
    lost = [e for e in job.events() if e["kind"] == "state_lost"]
    assert lost and lost[0]["lost_ranks"] == [0, 1], [e.get("cause") for e in plans(job)]
    assert "resumed from the checkpoint of step" in logs(job)
