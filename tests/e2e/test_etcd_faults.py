"""etcd faults under a live job: a 3-member cluster loses a follower, then the leader, then all
of its members for longer than the lease TTL. Training never stops for it, no node is replaced,
and the result is bitwise the fault-free one. Real etcd members (SIGKILL), real agents, real gloo.
"""

import os
import time
import uuid

import pytest
from test_live import assert_bitwise, reference, run_job  # noqa: F401 - reference is a fixture

from rendezvous.etcd_server import EtcdCluster

STEPS = 1200  # long enough (>= 36 s at 0.03 s a step) to train through all three outages
TTL = 3.0


@pytest.fixture(params=["etcd-v3", "etcd-v2"])
def cluster_job(tmp_path, request):
    """``make(**options) -> LocalJob`` whose agents get all three members as --rdzv-endpoint."""
    from tm_launch.local.localjob import LocalJob

    cluster = EtcdCluster().start()
    jobs = []

    def make(**options):
        run_id = f"t-{uuid.uuid4().hex[:10]}"
        job = LocalJob(
            endpoint=",".join(cluster.endpoints), run_id=run_id, workdir=str(tmp_path / run_id), backend=request.param, **options
        )
        jobs.append(job)
        return job

    make.cluster = cluster
    yield make
    for job in jobs:
        job.stop()
    cluster.stop()


def _rank0_steps(job):
    return sorted((t, s) for t, r, s, g, p in job.step_records() if r == 0)


def _steps_between(job, t0, t1):
    return [s for t, s in _rank0_steps(job) if t0 <= t <= t1]


def _max_gap(job, t0, t1):
    times = [t for t, s in _rank0_steps(job) if t0 - 1 <= t <= t1 + 1]
    return max((b - a for a, b in zip(times, times[1:])), default=None)


@pytest.mark.slow
@pytest.mark.timeout(900)  # the faulty run, then the fault-free reference: 300 s ran out under load
def test_etcd_member_and_full_outage_training_goes_on(cluster_job, reference):
    cluster = cluster_job.cluster
    phases = {}

    def fault(job, release):
        release()
        job.wait_step(30)
        # 1. a follower, then the leader (the survivors elect a new one), each SIGKILLed
        for what in ("follower", "leader"):
            victim = cluster.follower() if what == "follower" else cluster.leader()
            t = time.time()
            cluster.kill(victim)
            time.sleep(2 * TTL)
            phases[what] = (t, time.time())
        cluster.restart()
        time.sleep(1)
        # 2. every member down for longer than the lease TTL, then back on the same data dirs
        t = time.time()
        for i in range(len(cluster.members)):
            cluster.kill(i)
        time.sleep(2 * TTL)
        t_up = time.time()
        cluster.restart()
        phases["all"] = (t, t_up)
        return {}

    job, codes, params, _ = run_job(
        cluster_job,
        ["a", "b", "c"],
        script=["--steps", str(STEPS), "--step-sleep", "0.03"],
        launcher=["--lease-ttl", str(TTL)],
        fault=fault,
    )
    assert codes == {"a": 0, "b": 0, "c": 0}, job.logs_tail()
    assert_bitwise(params, reference(2, 2, STEPS))
    # no failover storm: one generation from start to finish, nobody replaced
    assert {g for _, _, _, g, _ in job.step_records()} == {0}, "training moved to a new generation"
    storm = [
        e
        for e in job.events()
        if e["kind"] in ("node_lost", "fenced", "worker_failed", "left") or (e["kind"] == "plan" and e.get("generation", 0) > 0)
    ]
    assert not storm, storm
    # v3 renews every lease when a leader takes over, so nobody even loses it; v2 TTLs run on
    # wall-clock time and expire during the outage: those nodes rejoin (same id, same ranks)
    rejoined = sorted(e["node"] for e in job.events() if e["kind"] == "rejoined")
    if job.backend == "etcd-v3":
        assert not rejoined, rejoined
    # training went on while etcd was down, in every phase
    for what, (t0, t1) in phases.items():
        assert len(_steps_between(job, t0 + 0.5, t1)) >= 3, f"no progress while the etcd {what} was down"
    # each agent said once that etcd was gone during the full outage and once that it was back
    t0, t1 = phases["all"]
    for node in ("a", "b", "c"):
        mine = [e for e in job.events() if e["node"] == node and t0 <= e["time"] and e["kind"] in ("etcd_down", "etcd_back")]
        assert [e["kind"] for e in mine] == ["etcd_down", "etcd_back"], (node, mine)
    report = {what: {"max_step_gap_s": round(_max_gap(job, *span), 3)} for what, span in phases.items()}
    backs = [e for e in job.events() if e["kind"] == "etcd_back" and e["time"] >= t1]
    report["all"]["agents_back_after_restart_s"] = round(max(e["time"] for e in backs) - t1, 3)
    report["all"]["outage_s"] = round(t1 - t0, 3)
    report["rejoined"] = rejoined
    print("ETCD-FAULTS", job.backend, report)
    with open(os.path.join(job.workdir, "etcd_faults.json"), "w") as f:
        f.write(repr(report))
