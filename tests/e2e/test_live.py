"""Live in-place substitution, end to end: real agents, real etcd, real gloo, real signals.

Every test ends with the bitwise check: the job that lost a worker, a node or was drained ends
with exactly the parameters of the same job without the fault.
"""

import json
import os
import signal
import time

import pytest
import torch

from tm_launch.joblog import PHASES
from tm_launch.local.localjob import downtime

STEPS = 80
SCRIPT = ["--steps", str(STEPS), "--step-sleep", "0.02"]
PAUSE = 20  # faulty runs hold every rank at this step until the spare is parked


def run_job(local_job, nodes, spares=1, nproc=2, script=(), launcher=(), fault=None, parked=True):
    """Start len(nodes) agents (the last ``spares`` are spares), apply ``fault(job, release)``,
    wait. ``parked``: the last spare has parked before the fault (else the fault waits as it needs)."""
    active = len(nodes) - spares
    job = local_job(nnodes=str(active), nproc=nproc, launcher_args=["--max-restarts", "3", *launcher])
    out = os.path.join(job.workdir, "params.pt")
    trigger = os.path.join(job.workdir, "trigger")
    marker = os.path.join(job.workdir, "killed")
    sublog = os.path.join(job.workdir, "sublog")
    script = [{"TRIGGER": trigger, "MARKER": marker, "SUBLOG": sublog}.get(a, a) for a in script]
    job.script_args = [*SCRIPT, "--out", out, "--step-log", job.step_log, "--pause-step", str(PAUSE), "--pause-file", trigger, *script]
    job.start_all(nodes[:active])
    job.wait_for(lambda s: s["generation"] is not None, 120, "generation 0")
    job.start_all(nodes[active:])
    if spares and parked:
        job.wait_parked(nodes[-1], timeout=300)  # a spare's 2 workers import torch in its sandbox: 120 s ran out at load 20

    def release():
        open(trigger, "w").close()

    info = (fault(job, release) or {}) if fault else {}
    release()
    codes = job.wait(timeout=240)
    return job, codes, torch.load(out), info


@pytest.fixture(scope="module")
def reference(tmp_path_factory, etcd_server):
    """Fault-free final parameters per (nodes, workers per node, steps), computed once per module."""
    return fault_free_reference(tmp_path_factory, etcd_server)


def fault_free_reference(tmp_path_factory, etcd_server):
    """``get(nodes, nproc, steps=STEPS, extra=()) -> params``: a fault-free live run, cached."""
    from tm_launch.local.localjob import LocalJob

    cache = {}

    def get(nodes: int, nproc: int, steps: int = STEPS, extra: tuple = ()):
        key = (nodes, nproc, steps, extra)
        if key not in cache:
            workdir = str(tmp_path_factory.mktemp(f"ref{nodes}x{nproc}x{steps}"))
            job = LocalJob(
                endpoint=etcd_server.endpoint,
                run_id=f"ref-{nodes}x{nproc}-{time.time_ns()}",
                workdir=workdir,
                nnodes=str(nodes),
                nproc=nproc,
                script_args=["--steps", str(steps), "--out", os.path.join(workdir, "p.pt"), *extra],
            )
            job.start_all([f"r{i}" for i in range(nodes)])
            codes = job.wait(timeout=240)
            assert set(codes.values()) == {0}, job.logs_tail()
            cache[key] = torch.load(os.path.join(workdir, "p.pt"))
        return cache[key]

    return get


def assert_bitwise(params, ref):
    assert params.keys() == ref.keys()
    diff = {k: (params[k] - ref[k]).abs().max().item() for k in ref if not torch.equal(params[k], ref[k])}
    assert not diff, f"parameters differ from the fault-free run: {diff}"


@pytest.mark.parametrize(
    "phase",
    [
        pytest.param("forward", marks=pytest.mark.slow),
        pytest.param("allreduce", marks=pytest.mark.slow),
        "vote",
        pytest.param("optimizer", marks=pytest.mark.slow),
        pytest.param("logging", marks=pytest.mark.slow),  # the fast tier's framework tests kill after a commit
        pytest.param("logged", marks=pytest.mark.slow),
    ],
)
def test_worker_killed_spare_takes_over_bitwise(local_job, reference, phase):
    """The worker of rank 2 SIGKILLs itself at one point of a step (the loss is all-reduced after
    the optimizer step, as loops log it), once the spare is parked: whatever the point, every
    rank's update of that step is applied exactly once or not at all, job-wide."""
    script = [
        "--log-loss",
        "--kill-rank",
        "2",
        "--kill-step",
        str(PAUSE + 5),
        "--kill-phase",
        phase,
        "--kill-trigger",
        "TRIGGER",
        "--kill-marker",
        "MARKER",
    ]
    job, codes, params, _ = run_job(local_job, ["a", "b", "c"], script=script)
    victim = next(e["node"] for e in job.events() if e["kind"] == "worker_failed")  # whoever held rank 2
    survivor = ({"a", "b"} - {victim}).pop()
    assert codes["c"] == 0 and codes[survivor] == 0, job.logs_tail()
    assert codes[victim] != 0  # the node that lost its worker was replaced and says so
    assert_bitwise(params, reference(2, 2))
    entered = {e["node"]: e for e in job.events() if e["kind"] == "entered" and e.get("generation") == 1}
    assert entered[survivor]["store_connects"] == 0, entered  # its connections were ready (tm_launch.worker.comms.store_clients)
    plans = [e for e in job.events() if e["kind"] == "plan" and e.get("generation") == 1]
    assert plans and plans[0]["replaced"] == {"c": victim} and plans[0]["live"], job.events()


def connects_its_world_once(e: dict, world: int) -> bool:
    """A worker's ``entered`` record shows one communicator rebuilt (its world group: the
    subgroups were kept) and the full mesh of it connected (tm_launch.worker.comms.communicators),
    plus at most a connection to a store or holder the change needed."""
    return e["groups_rebuilt"] == 1 and world - 1 <= e["tcp_opened"] <= world


@pytest.mark.slow
def test_a_lost_worker_whose_sockets_outlive_it_holds_no_survivor(local_job, reference):
    """Rank 2 dies inside the gradient allreduce while a process it forked keeps its sockets
    open (as a data-loader worker that inherited them does): its peers' gloo collective would
    wait for those sockets until the collective timeout (120 s). Each survivor gives up the
    communicators the new generation changes when its directive arrives (their connections
    shut down), and leaves the collective at once."""
    script = ["--kill-rank", "2", "--kill-step", str(PAUSE + 5), "--kill-phase", "allreduce"]
    script += ["--kill-trigger", "TRIGGER", "--kill-marker", "MARKER", "--kill-keeps-sockets", "SUBLOG"]
    job = None
    try:
        job, codes, params, _ = run_job(local_job, ["a", "b", "c"], script=script)
        victim = next(e["node"] for e in job.events() if e["kind"] == "worker_failed")
        survivor = ({"a", "b"} - {victim}).pop()
        assert codes["c"] == 0 and codes[survivor] == 0, job.logs_tail()
        assert "communicator(s) it changes" in job.nodes[survivor].log(), job.logs_tail()
        fault_time = os.path.getmtime(os.path.join(job.workdir, "killed"))
        assert downtime(job.step_records(), fault_time)["downtime_s"] < 30, job.logs_tail()  # not the 120 s collective timeout
        assert_bitwise(params, reference(2, 2))
    finally:
        if job is not None:
            _kill_pid_in(os.path.join(job.workdir, "sublog"))


def _kill_pid_in(path: str) -> None:
    try:
        with open(path) as f:
            os.kill(int(f.read()), signal.SIGKILL)
    except (OSError, ValueError):
        pass


@pytest.mark.slow
def test_a_change_at_8_ranks_rebuilds_one_communicator(local_job, reference):
    """4 nodes x 2 workers and a spare; rank 2's worker dies at the vote. Every worker that
    enters generation 1 rebuilds its world group only, connecting its full mesh (7 peers), and
    the job ends bitwise."""
    script = ["--log-loss", "--kill-rank", "2", "--kill-step", str(PAUSE + 5), "--kill-phase", "vote"]
    script += ["--kill-trigger", "TRIGGER", "--kill-marker", "MARKER"]
    job, codes, params, _ = run_job(local_job, ["a", "b", "c", "d", "e"], script=script)
    victim = next(e["node"] for e in job.events() if e["kind"] == "worker_failed")
    assert all(code == 0 for node, code in codes.items() if node != victim), job.logs_tail()
    assert_bitwise(params, reference(4, 2))
    entered = {e["node"]: e for e in job.events() if e["kind"] == "entered" and e.get("generation") == 1}
    assert len(entered) == 4, entered
    assert all(connects_its_world_once(e, 8) for e in entered.values()), entered


@pytest.mark.slow  # the fast tier's kills promote a spare into the ranks it warmed up for
def test_spare_runs_the_script_again_for_the_ranks_of_another_node_bitwise(local_job, reference):
    """The worker of rank 0 SIGKILLs itself: the spare, warmed up as the last node's ranks, runs
    the script again for ranks 0 and 1 with one warm-up step and DDP's bucket rebuild done
    without peers (``tm_launch.worker.spare.ddp_rebuild``; without it the joiners' DDP would broadcast its
    bucket order in their second step while the survivors all-reduce gradients). Ranks 0 and 1
    have per-rank state (``--random``) whose mirrors are in generation 0's store, on the victim
    node's agent: it keeps serving them after it left until the joiners are in
    (``PlanExecutor._keep_store_for_joiners``; an agent that exited at once took them along and
    the job restarted from its checkpoint)."""
    script = [
        "--random",
        "--log-loss",
        "--kill-rank",
        "0",
        "--kill-step",
        str(PAUSE + 5),
        "--kill-phase",
        "vote",
        "--kill-trigger",
        "TRIGGER",
        "--kill-marker",
        "MARKER",
    ]
    job, codes, params, _ = run_job(local_job, ["a", "b", "c"], script=script)
    victim = next(e["node"] for e in job.events() if e["kind"] == "worker_failed")
    survivor = ({"a", "b"} - {victim}).pop()
    assert codes["c"] == 0 and codes[survivor] == 0, job.logs_tail()
    assert not [e for e in job.events() if e["kind"] == "state_lost"], job.logs_tail()
    assert_bitwise(params, reference(2, 2, extra=("--random",)))
    # Rank 0's node hosted the store: generation 1's is the standby, to which the survivor's
    # workers and the parked spare's held connections ready (tm_launch.worker.comms.store_clients).
    entered = {e["node"]: e for e in job.events() if e["kind"] == "entered" and e.get("generation") == 1}
    assert entered[survivor]["store_connects"] == 0 and entered["c"]["store_connects"] == 0, entered
    # One communicator rebuilt, its full mesh connected (test_a_change_at_8_ranks_rebuilds_one_communicator).
    assert all(connects_its_world_once(e, 4) for e in entered.values()), {
        n: (e["tcp_opened"], e["groups_rebuilt"]) for n, e in entered.items()
    }
    spare = job.nodes["c"].log()
    assert "promoted to rank 0 (warmed up as rank 2)" in spare and "promoted to rank 1 (warmed up as rank 3)" in spare, spare
    plans = [e for e in job.events() if e["kind"] == "plan" and e.get("generation", 0) >= 1]
    assert len(plans) == 1 and plans[0]["live"], [p["cause"] for p in plans]


@pytest.mark.slow
def test_survivors_wait_for_a_cold_spare_that_warms_up_longer_than_their_patience(local_job, reference, tmp_path):
    """The only spare is still warming up when rank 3's worker is SIGKILLed: its first
    sandbox step sleeps 20 s (a big model's imports and build, say), longer than the 10 s the
    survivors wait in a failed generation before they restart their own workers (2 x the default
    5 s lease). The spare's agent shows it alive and warming up, so the survivors keep waiting
    and keep their state: the recovery is live, one generation change, bitwise."""
    chaos = tmp_path / "chaos"
    chaos.mkdir()
    slow = chaos / "slow.s1"
    slow.touch()  # s1's workers sleep 1000 x --step-sleep (20 s) per step while it exists
    script = ["--chaos-dir", str(chaos), "--slow-factor", "1000", "--kill-rank", "3", "--kill-step", str(PAUSE + 2)]
    script += ["--kill-phase", "forward", "--kill-trigger", "TRIGGER", "--kill-marker", "MARKER"]

    def kill_while_s1_warms_up(job, release):
        def warming(s):
            spare = next((n for n in s["nodes"] if n["id"] == "s1"), None)
            return spare is not None and any(w.get("state") in ("sandbox", "warmup") for w in spare["progress"].values())

        job.wait_for(warming, 120, "s1 warming up")
        time.sleep(1.0)  # inside its first sandbox step
        release()
        job.wait_for(lambda s: s["generation"] == 1, 60, "the plan that promotes s1")
        slow.unlink()  # the step it sleeps in ends as planned; the next ones are fast

    job, codes, params, _ = run_job(local_job, ["a", "b", "s1"], script=script, fault=kill_while_s1_warms_up, parked=False)
    victim = next(e["node"] for e in job.events() if e["kind"] == "worker_failed")  # whoever holds rank 3
    survivor = ({"a", "b"} - {victim}).pop()
    assert codes[survivor] == 0 and codes["s1"] == 0 and codes[victim] != 0, job.logs_tail()
    plans = [e for e in job.events() if e["kind"] == "plan" and e.get("generation", 0) >= 1]
    assert [(p["replaced"], p["live"]) for p in plans] == [({"s1": victim}, True)], [p["cause"] for p in plans]
    assert_bitwise(params, reference(2, 2))


@pytest.mark.slow
def test_a_warm_spare_is_promoted_before_a_cold_one_that_joined_first(local_job, reference, tmp_path):
    """Two spares: s1 joins first but its warm-up is slow (its sandbox steps sleep 10 s: a node
    that came back after a fault, say), s2 joins after it and parks. Its agent marks it warm in
    etcd (``state/warm/s2``), ``ctl status`` says so, and when rank 3's worker is SIGKILLed
    the plan promotes s2, not s1 (join order alone took s1 and waited for its warm-up).
    Every rank ends bitwise equal to the fault-free run."""
    chaos = tmp_path / "chaos"
    chaos.mkdir()
    (chaos / "slow.s1").touch()  # s1's workers sleep 500 x --step-sleep per step: its sandbox too
    script = [
        "--chaos-dir",
        str(chaos),
        "--slow-factor",
        "500",
        "--kill-rank",
        "3",
        "--kill-step",
        str(PAUSE + 5),
        "--kill-phase",
        "forward",
        "--kill-trigger",
        "TRIGGER",
        "--kill-marker",
        "MARKER",
    ]

    def check_warmth(job, release):
        spares = {n["id"]: n for n in job.status()["nodes"] if n["role"] == "spare"}
        assert spares["s2"]["warm"] and not spares["s1"]["warm"], spares
        assert not all(w.get("state") == "parked" for w in spares["s1"]["progress"].values()), spares["s1"]
        assert "(warm)" in job.ctl("status").stdout

    job, codes, params, _ = run_job(local_job, ["a", "b", "s1", "s2"], spares=2, script=script, fault=check_warmth)
    victim = next(e["node"] for e in job.events() if e["kind"] == "worker_failed")  # whoever holds rank 3
    survivor = ({"a", "b"} - {victim}).pop()
    plans = [e for e in job.events() if e["kind"] == "plan" and e.get("generation", 0) >= 1]
    assert [p["replaced"] for p in plans] == [{"s2": victim}], [(p["cause"], p["replaced"]) for p in plans]
    assert plans[0]["live"]
    assert codes[survivor] == 0 and codes["s2"] == 0 and codes[victim] != 0, job.logs_tail()
    assert_bitwise(params, reference(2, 2))


@pytest.mark.parametrize(
    "phase",
    [
        pytest.param("forward", marks=pytest.mark.slow),  # the fast tier's framework tests (dropout) cover per-rank RNG
        pytest.param("logging", marks=pytest.mark.slow),
    ],
)
def test_per_rank_rng_and_data_position_survive_bitwise(local_job, reference, phase):
    """Dropout masks and batches come from per-rank random state (registered per_rank): the
    survivors re-run the interrupted step with the state it started with, and the joiner gets
    the dead rank's own state from its mirror (written with each commit vote)."""
    script = [
        "--random",
        "--log-loss",
        "--kill-rank",
        "2",
        "--kill-step",
        str(PAUSE + 5),
        "--kill-phase",
        phase,
        "--kill-trigger",
        "TRIGGER",
        "--kill-marker",
        "MARKER",
    ]
    job, codes, params, _ = run_job(local_job, ["a", "b", "c"], script=script)
    assert codes["c"] == 0 and sorted(codes.values()) == [0, 0, 1], job.logs_tail()
    assert not [e for e in job.events() if e["kind"] == "state_lost"], job.logs_tail()
    assert_bitwise(params, reference(2, 2, extra=("--random",)))


def _kill_at_step(step, action, victim="b"):
    def fault(job, release):
        ranks = {n["id"]: n["ranks"] for n in job.status()["nodes"]}  # join order decides them
        release()
        job.wait_step(step)
        t = time.time()
        action(job)
        return {"fault_time": t, "victim_ranks": set(ranks[victim]), "kept_ranks": set(ranks["a"])}

    return fault


@pytest.mark.slow
def test_external_worker_sigkill_survivors_keep_processes(local_job, reference):
    job, codes, params, info = run_job(local_job, ["a", "b", "c"], fault=_kill_at_step(PAUSE + 5, lambda j: j.kill_worker("b")))
    assert_bitwise(params, reference(2, 2))
    rows = job.step_records()
    kept = info["kept_ranks"]
    pids_before = {r: pid for t, r, s, g, pid in rows if t < info["fault_time"] and r in kept}
    pids_after = {r: pid for t, r, s, g, pid in rows if t > info["fault_time"] + 1 and r in kept}
    assert pids_before == pids_after, "survivors on node a must keep their processes"
    d = downtime(rows, info["fault_time"])
    assert d["steps_redone"] == 0, d


@pytest.mark.slow  # over ~12 s on 2 cores: the fast tier keeps near 10 minutes
def test_node_loss_agent_sigkill(local_job, reference):
    job, codes, params, info = run_job(local_job, ["a", "b", "c"], fault=_kill_at_step(PAUSE + 5, lambda j: j.kill_agent("b")))
    assert codes["a"] == 0 and codes["c"] == 0, job.logs_tail()
    assert_bitwise(params, reference(2, 2))
    # Detected by probing: a survivor's collective with the dead node fails, or its commit vote
    # waits long (test_node_lost_while_the_others_wait_in_the_vote), and its agent probes.
    assert any(e["kind"] == "node_lost" for e in job.events()), "node loss should be detected by probing, not the lease"
    assert_breakdown_is_the_downtime(job, fault_took_effect(job, info), {"a", "c"})


def fault_took_effect(job, info) -> float:
    """When the victim's workers stopped: the agent's SIGKILL reaches them once the kernel has torn
    the agent down (PR_SET_PDEATHSIG), which on a loaded machine took long enough for them to
    log two more steps; the step log's downtime starts at the last step every rank completed
    before that, as the agents' breakdown does."""
    victim_rows = [t for t, r, s, g, pid in job.step_records() if r in info["victim_ranks"] and g == 0]
    return max([info["fault_time"], *victim_rows]) + 1e-6


def lose_node_while_stopped(job, victim: str, stopped: str) -> dict:
    """SIGKILL ``victim``'s agent (its workers die with it) while the workers of the nodes in
    ``stopped`` are SIGSTOPped (a long compute phase: no collective of theirs can fail, they report
    nothing); the first ``node_lost`` event within 30 s, or {}. The workers go on afterwards."""
    survivors = [pid for node in stopped for pid in job.worker_pids(node)]
    found = {}
    for pid in survivors:
        os.kill(pid, signal.SIGSTOP)
    try:
        job.kill_agent(victim)
        deadline = time.time() + 30
        while time.time() < deadline and not found:
            found.update(next((e for e in job.events() if e["kind"] == "node_lost"), {}))
            time.sleep(0.05)
    finally:
        for pid in survivors:
            os.kill(pid, signal.SIGCONT)
    return found


@pytest.mark.slow  # ~45 s; the link itself is tested on real sockets in test_peer_link.py
def test_node_loss_found_while_the_survivors_compute(local_job, reference):
    """Node b's agent and workers are SIGKILLed while node a's workers are stopped (SIGSTOP: a
    long compute phase, in which no collective of theirs can fail and they report nothing). a's
    agent finds the loss anyway, at once: its kept-open connection to b's agent ends
    (``tm_launch.launcher.peer_link``) and b's port refuses, where it used to wait for its workers'
    next collective, or for b's lease. Then a's workers go on, and the job ends bitwise."""
    found = {}

    def fault(job, release):
        release()
        job.wait_step(PAUSE + 5)
        found.update(lose_node_while_stopped(job, "b", stopped="a"))

    job, codes, params, _ = run_job(local_job, ["a", "b", "c"], fault=fault)
    assert found.get("node") == "a" and found.get("lost") == "b", (
        f"a's agent must find b lost while its workers are stopped: {found}\n{job.logs_tail()}"
    )
    assert codes["a"] == 0 and codes["c"] == 0, job.logs_tail()
    assert_bitwise(params, reference(2, 2))


@pytest.mark.slow  # ~60 s: six agents
def test_a_node_that_joined_after_the_planners_finds_its_successor_lost(local_job, reference):
    """Five active nodes and a spare; d and e start once a, b and c have named themselves the
    planners, so they read no node's record while generation 0 forms (they take it from its
    delta: ``Membership._join``) and afterwards only their peers' (``Membership.with_records``).
    With every survivor's workers stopped, e's agent and workers are SIGKILLed: d's agent, e's
    only watcher in the ring, must find the loss through its kept-open link to e, at the address
    it read for that link. The job ends bitwise."""
    from rendezvous.kv import EtcdOptions, connect
    from rendezvous.membership import run_prefix

    job = local_job(nnodes="5", nproc=1, launcher_args=["--max-restarts", "3"])
    out, trigger = os.path.join(job.workdir, "params.pt"), os.path.join(job.workdir, "trigger")
    job.script_args = [*SCRIPT, "--out", out, "--step-log", job.step_log, "--pause-step", str(PAUSE), "--pause-file", trigger]
    kv = connect("v3", EtcdOptions(endpoints=(job.endpoint,), prefix=run_prefix(job.run_id)))
    job.start_all(["a", "b", "c"])
    deadline = time.time() + 60
    while {e.key.rsplit("/", 1)[-1] for e in kv.get_prefix("state/plan-feed/planners/")} != {"a", "b", "c"}:
        assert time.time() < deadline, "a, b and c never named themselves planners\n" + job.logs_tail()
        time.sleep(0.1)
    job.start_all(["d", "e"])
    job.wait_for(lambda s: s["generation"] is not None, 120, "generation 0")
    job.start_all(["s"])
    job.wait_parked("s")
    open(trigger, "w").close()
    job.wait_step(PAUSE + 5)
    found = lose_node_while_stopped(job, "e", stopped="abcd")
    codes = job.wait(timeout=240)
    assert found.get("node") == "d" and found.get("lost") == "e", f"d's agent must find e lost through the ring: {found}\n{job.logs_tail()}"
    assert all(codes[n] == 0 for n in "abcds"), job.logs_tail()
    assert_bitwise(torch.load(out), reference(5, 1))


@pytest.mark.slow
def test_node_lost_while_the_others_wait_in_the_vote(local_job, reference):
    """Rank 2's vote completes the count and its node dies (agent and workers) before it writes
    the decision: every other rank waits in the vote, and no collective of theirs fails. The
    wait itself tells their agents, which probe the peers: the loss is found in milliseconds,
    not at the lease's expiry; the step is aborted everywhere and run again."""
    script = ["--kill-rank", "2", "--kill-step", str(PAUSE + 5), "--kill-phase", "last-vote-node", "--kill-marker", "MARKER"]
    job, codes, params, _ = run_job(local_job, ["a", "b", "c"], script=script)
    lost = [e for e in job.events() if e["kind"] == "node_lost"]
    assert lost, "the loss must be found by probing, not by the lease\n" + job.logs_tail()
    dead = lost[0]["lost"]
    assert codes["c"] == 0 and codes[({"a", "b"} - {dead}).pop()] == 0, job.logs_tail()
    survivor_log = job.nodes[({"a", "b"} - {dead}).pop()].log()
    assert "failpoint last-vote/node" in job.nodes[dead].log() and "a peer failed before voting" in survivor_log, job.logs_tail()
    assert_bitwise(params, reference(2, 2))


def assert_breakdown_is_the_downtime(job, fault_time, nodes):
    """`ctl timeline --json` names every phase of generation 1's change for every node, in order
    (no phase negative: each stamp follows the one before), the slowest node's phases add up to
    the total, and the total is the step log's downtime. The step log may count one step more:
    a rank that dies after its step committed but before logging it leaves the survivors' copy
    of that step out of 'every rank completed it'."""
    out = job.ctl("timeline", "--json")
    assert out.returncode == 0, out.stderr
    g1 = next(g for g in json.loads(out.stdout)["generations"] if g["generation"] == 1)
    b = g1["breakdown"]
    assert b is not None and [p["phase"] for p in b["phases"]] == list(PHASES) and set(b["nodes"]) == nodes, g1
    for node, v in b["nodes"].items():
        assert all(v["phases"][p] is not None and v["phases"][p] >= 0 for p in PHASES), (node, b)
    assert sum(b["nodes"][b["critical_node"]]["phases"].values()) == pytest.approx(b["total_s"], abs=0.005), b
    rows = job.step_records()
    d = downtime(rows, fault_time)
    times = sorted(t for t, r, s, g, pid in rows if r == 0 and t < fault_time)[-6:]
    step = max(b - a for a, b in zip(times, times[1:]))
    assert -0.05 <= d["downtime_s"] - b["total_s"] <= step + 0.1, (b, d, step)


@pytest.mark.slow  # a planned migration: test_health_e2e's straggler case too (slow tier)
def test_planned_drain(local_job, reference):
    def drain(job, release):
        # Requested while training is held at the pause step: the switch happens in the steps after.
        out = job.ctl("drain", "a")
        assert out.returncode == 0, out.stderr
        job.wait_for(lambda s: s["generation"] == 1, 60, "the drain plan")
        t = time.time()
        release()
        return {"fault_time": t}

    job, codes, params, info = run_job(local_job, ["a", "b", "c"], fault=drain)
    assert codes == {"a": 0, "b": 0, "c": 0}, job.logs_tail()
    assert_bitwise(params, reference(2, 2))
    d = downtime(job.step_records(), info["fault_time"])
    assert d["steps_redone"] == 0, d
    plan = [e for e in job.events() if e["kind"] == "plan" and e.get("generation") == 1][0]
    assert plan["planned"] and plan["replaced"] == {"c": "a"}


@pytest.mark.slow
def test_drain_at_the_last_step_finishes_without_the_joiner(local_job, reference):
    """A drain agreed at the last step switches 'after' it: the keepers finish in the old
    communicator, and the promoted spare (that never got in) is released at once instead of
    waiting out the setup timeout."""

    def drain(job, release):
        out = job.ctl("drain", "b")
        assert out.returncode == 0, out.stderr
        job.wait_for(lambda s: s["generation"] == 1, 60, "the drain plan")
        release()

    t0 = time.time()
    job, codes, params, _ = run_job(local_job, ["a", "b", "c"], script=("--pause-step", str(STEPS - 1)), fault=drain)
    assert codes == {"a": 0, "b": 0, "c": 0}, job.logs_tail()
    assert_bitwise(params, reference(2, 2))
    assert "nothing left for them to do" in job.nodes["c"].log(), job.logs_tail()
    assert time.time() - t0 < 200


@pytest.mark.slow  # the fast tier's hang test is test_restart_mode's (the same watchdog)
def test_hung_worker_is_killed_and_replaced(local_job, reference):
    job, codes, params, info = run_job(
        local_job,
        ["a", "b", "c"],
        launcher=["--health-hang-timeout", "2", "--health-hang-warmup-steps", "0"],
        fault=_kill_at_step(PAUSE + 5, lambda j: j.kill_worker("b", signal.SIGSTOP)),
    )
    assert codes["a"] == 0 and codes["c"] == 0, job.logs_tail()
    assert any(e["kind"] == "hang" for e in job.events()), job.events()
    assert_bitwise(params, reference(2, 2))


@pytest.mark.slow  # ctl status --json is also read by every fast end-to-end test (LocalJob.status)
def test_status_json_lists_nodes_roles_ranks(local_job):
    job = local_job(nnodes="2", nproc=1)
    trigger = os.path.join(job.workdir, "trigger")
    job.script_args = ["--steps", "30", "--pause-step", "5", "--pause-file", trigger]
    job.start_all(["a", "b"])
    job.wait_for(lambda s: s["generation"] is not None, 120, "generation 0")
    job.start("c")
    job.wait_parked("c")

    def settled(status):
        roles = {n["id"]: (n["role"], n["ranks"]) for n in status["nodes"]}
        actives = sorted(ranks for role, ranks in (roles["a"], roles["b"])) if {"a", "b"} <= set(roles) else None
        return (
            roles.get("a", ("",))[0] == roles.get("b", ("",))[0] == "active"
            and actives == [[0], [1]]
            and roles.get("c") == ("spare", [])
            and status["spares_left"] == 1
            and status["live"]
            and status["world_size"] == 2
        )

    job.wait_for(settled, 30, "ctl status --json: a and b active with ranks 0 and 1, c a spare, live mode")
    open(trigger, "w").close()
    assert job.wait(timeout=120) == {"a": 0, "b": 0, "c": 0}  # the parked spare leaves cleanly too


def subgroup_communicators(job) -> dict:
    """{(rank, generation): the ids of the communicators its subgroup used} from the script's
    ``--subgroup-log``."""
    comms: dict = {}
    with open(os.path.join(job.workdir, "sublog")) as f:
        for line in f:
            rank, step, gen, comm = line.split()
            comms.setdefault((int(rank), int(gen)), set()).add(comm)
    return comms


@pytest.mark.slow  # over ~12 s on 2 cores: the fast tier keeps near 10 minutes
def test_delta_setup_keeps_subgroups_without_replaced_ranks(local_job, reference):
    """TP-style subgroups of 2 ranks, one per node; rank 2's worker dies in its forward: the
    spare rebuilds the victim node's subgroup (and the world group) while the other node keeps
    its subgroup's communicator object.

    The kill is at a fixed point of the step, before its gradient all-reduce, so that no
    survivor completes the step. A kill after that all-reduce (an external SIGKILL at a random
    moment did this about one run in five) lets survivors commit the step and meet the new
    generation at a healthy boundary; they then release their subgroups by design
    (``Generations._enter_once``, ``late``: a peer may already wait for them in the next step's
    subgroup collective) and rebuild them, which is correct but not what this test checks."""
    script = ["--subgroups", "2", "--subgroup-log", "SUBLOG", "--kill-rank", "2", "--kill-step", str(PAUSE + 5)]
    script += ["--kill-phase", "forward", "--kill-trigger", "TRIGGER", "--kill-marker", "MARKER"]
    job, codes, params, _ = run_job(local_job, ["a", "b", "c"], script=script)
    victim = next(e["node"] for e in job.events() if e["kind"] == "worker_failed")  # whoever held rank 2
    survivor = ({"a", "b"} - {victim}).pop()
    assert codes[survivor] == 0 and codes["c"] == 0, job.logs_tail()
    assert_bitwise(params, reference(2, 2))
    comms = subgroup_communicators(job)
    for r in (0, 1):
        assert comms[(r, 0)] == comms[(r, 1)], comms  # the survivor's subgroup: the same communicator
    for r in (2, 3):
        assert comms[(r, 0)] != comms[(r, 1)], comms  # the victim's: rebuilt by the spare


@pytest.mark.slow  # the fast tier keeps the subgroup case above; unit tests cover in-process groups
def test_groups_of_one_rank_and_fake_groups_are_never_connected(local_job, reference):
    """A group of one rank per rank and a group of every rank made with torch's "fake" backend
    (torchtitan makes both for its mesh dimensions of degree 1); b's worker dies. No such group
    gets a communicator, before or after the substitution: each process builds the world group
    alone (``groups_rebuilt``), and their all-reduces give what torch's give (the script checks)."""
    sublog = "SUBLOG"
    job, codes, params, info = run_job(
        local_job,
        ["a", "b", "c"],
        script=["--subgroups", "1", "--fake-group", "--subgroup-log", sublog],
        fault=_kill_at_step(PAUSE + 5, lambda j: j.kill_worker("b")),
    )
    assert codes["a"] == 0 and codes["c"] == 0, job.logs_tail()
    assert_bitwise(params, reference(2, 2))
    entered = {e["node"]: e for e in job.events() if e["kind"] == "entered" and e.get("generation") == 1}
    assert set(entered) == {"a", "c"} and all(e["groups_rebuilt"] == 1 for e in entered.values()), entered
    comms = subgroup_communicators(job)
    for r in info["kept_ranks"]:
        assert len(comms[(r, 0)] | comms[(r, 1)]) == 1, comms  # node a's: one object all along
    for r in info["victim_ranks"]:
        assert comms[(r, 0)] != comms[(r, 1)], comms  # node b's: the spare's own


@pytest.mark.slow
def test_v2_backend_live_failover(local_job, reference):
    """The same live failover over etcd's v2 API (--rdzv-backend etcd-v2, python-etcd)."""
    original = local_job

    def v2_job(**options):
        return original(backend="etcd-v2", **options)

    job, codes, params, info = run_job(v2_job, ["a", "b", "c"], fault=_kill_at_step(PAUSE + 5, lambda j: j.kill_worker("b")))
    assert codes["a"] == 0 and codes["c"] == 0, job.logs_tail()
    assert_bitwise(params, reference(2, 2))


@pytest.mark.slow
def test_collective_failure_without_a_lost_node_regroups_instead_of_hanging(local_job):
    """A worker stopped for longer than the collective timeout, then continued: every rank's
    collective failed, no node was lost, no new generation comes by itself. The agents report
    their nodes after a while and the job restarts its workers instead of waiting forever."""
    job = local_job(nnodes="2", nproc=1, launcher_args=["--max-restarts", "3", "--collective-timeout", "2"])
    trigger = os.path.join(job.workdir, "trigger")
    job.script_args = ["--steps", "200", "--step-sleep", "0.02", "--step-log", job.step_log, "--pause-step", "10", "--pause-file", trigger]
    job.start_all(["a", "b"])
    job.wait_for(lambda s: s["generation"] is not None, 120, "generation 0")
    open(trigger, "w").close()
    job.wait_step(15)
    pid = job.worker_pids("b")[0]
    os.kill(pid, signal.SIGSTOP)
    time.sleep(4)
    os.kill(pid, signal.SIGCONT)
    codes = job.wait(timeout=240)
    assert codes == {"a": 0, "b": 0}, job.logs_tail()
    assert any("no peer node was lost" in e.get("message", "") for e in job.events()), job.events()
