"""Chaos: a long live run with >= 20 random real faults ends bitwise equal to the fault-free run
(bench/chaos.py), the DDP job and each layout no live rank replicates (FSDP2, FSDP2 x TP, ZeRO:
every recovery live, from the in-memory snapshots); its fault triggers (tests/scripts/
faults.ChaosDir); and a fault that no spare can cover ends the job cleanly, never a hang."""

import os
import random
import signal
import sys
import time
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

import chaos  # noqa: E402  (bench/chaos.py)
from faults import ChaosDir  # noqa: E402  (tests/scripts/faults.py)


@pytest.mark.parametrize("seed, faults", [(1, 12), (1, 24), (7, 30)])
def test_schedule_covers_every_kind_and_is_seeded(seed, faults):
    kinds = chaos.schedule(seed, faults)
    assert len(kinds) == faults and set(kinds) == set(chaos.KINDS)
    assert kinds == chaos.schedule(seed, faults) and kinds != chaos.schedule(seed + 1, faults)


@pytest.mark.parametrize("layout", chaos.LAYOUTS)
@pytest.mark.parametrize("seed, faults", [(1, 20), (7, 30)])
def test_a_layout_schedule_covers_its_kinds_and_is_seeded(layout, seed, faults):
    kinds = chaos.schedule(seed, faults, layout)
    assert len(kinds) == faults and set(kinds) == set(chaos.kinds_of(layout))
    assert kinds == chaos.schedule(seed, faults, layout) and kinds != chaos.schedule(seed + 1, faults, layout)
    assert {"kill-backward", "agent-kill", "spare-killed-promotion", "double-failure"} <= set(kinds)
    assert ("kill-snapshot" in kinds) == (layout in chaos.SNAPSHOT_LAYOUTS)  # a replica layout sends no snapshot
    assert "kill-allreduce" not in kinds and "kill-checkpoint" not in kinds  # train.py's points
    assert {"kill-optimizer", "kill-vote"} <= set(kinds)  # after the commit too (ZeRO's parameter broadcast)


def test_schedule_refuses_too_few_faults():
    with pytest.raises(ValueError, match="at least 12"):
        chaos.schedule(1, 5)
    with pytest.raises(ValueError, match=f"at least {len(chaos.LAYOUT_KINDS)}"):
        chaos.schedule(1, 5, "fsdp")
    with pytest.raises(ValueError, match="unknown layout"):
        chaos.schedule(1, 30, "pp")


def test_summary_counts_per_kind():
    results = [
        {"kind": "hang", "recovered": True, "downtime_s": 3.0},
        {"kind": "hang", "recovered": True, "downtime_s": 5.0},
        {"kind": "hang", "recovered": False},
        {"kind": "drain", "recovered": True, "downtime_s": 0.5},
    ]
    rows = {r["kind"]: r for r in chaos.summarize(results)}
    assert rows["hang"] == {"kind": "hang", "injected": 3, "recovered": 2, "median_downtime_s": 4.0, "max_downtime_s": 5.0}
    assert rows["drain"]["injected"] == 1 and rows["drain"]["max_downtime_s"] == 0.5
    assert rows["all"]["injected"] == 4 and rows["all"]["recovered"] == 3
    assert "| hang | 3 | 2 | 4.00 | 5.00 |" in chaos.markdown(chaos.summarize(results))
    rows = [r["kind"] for r in chaos.summarize([{"kind": "kill-snapshot", "recovered": True, "downtime_s": 1.0}, *results])]
    assert rows == ["hang", "drain", "kill-snapshot", "all"]  # a layout's kinds after the DDP job's


def test_generations_count_restarts_and_lost_state_per_fault():
    events = [
        {"kind": "plan", "generation": 0, "live": False},
        {"kind": "plan", "generation": 1, "live": True, "cause": "a"},
        {"kind": "plan", "generation": 2, "live": True, "cause": "b"},
        {"kind": "plan", "generation": 3, "live": False, "cause": "c"},
        {"kind": "state_lost", "time": 5.0, "node": "n1", "message": "m", "lost_ranks": [1], "lost_step": 7},
    ]
    results = [
        {"kind": "hang", "recovered": True, "generation_before": 0, "generation_after": 2},
        {"kind": "agent-kill", "recovered": True, "generation_before": 2, "generation_after": 3},
        {"kind": "spare-killed-parked", "recovered": True, "generation_before": 3, "generation_after": 3},
        {"kind": "drain", "recovered": False, "generation_before": 3},
    ]
    got = chaos.generations(events, results)
    assert got["generation_changes"] == 3 and got["restarts"] == [{"generation": 3, "cause": "c"}]
    assert got["unexplained"] == []
    assert got["state_lost"] == [{"time": 5.0, "node": "n1", "message": "m", "lost_ranks": [1], "lost_step": 7}]
    assert [r.get("live") for r in results] == [True, False, True, None]
    # A generation between one fault's recovery and the next fault: nothing explains it.
    results = [
        {"kind": "hang", "recovered": True, "generation_before": 0, "generation_after": 1},
        {"kind": "xid", "recovered": True, "generation_before": 2, "generation_after": 3},
    ]
    assert chaos.generations(events, results)["unexplained"] == [{"generation": 2, "cause": "b"}]


def test_in_generation_needs_every_rank():
    records = [(1.0, 0, 5, 1, 10), (1.0, 1, 5, 1, 11), (2.0, 0, 6, 2, 10)]
    assert chaos.in_generation(records, 1) and not chaos.in_generation(records, 2) and not chaos.in_generation([], 0)


def test_bitwise_diff_per_rank():
    a = {"rank0": {"w": torch.ones(2)}, "rank1": {"w": torch.zeros(2)}}
    assert chaos.bitwise_diff(a, {k: {n: t.clone() for n, t in v.items()} for k, v in a.items()}) == {}
    assert chaos.bitwise_diff(a, {"rank0": {"w": torch.ones(2)}, "rank1": {"w": torch.full((2,), 0.5)}}) == {"rank1": {"w": 0.5}}
    assert chaos.bitwise_diff(a, {"rank0": a["rank0"]}) == {"keys": ["rank1"]}


def job_of(rank: int, sandbox: bool = False):
    return SimpleNamespace(rank=rank, in_sandbox=sandbox)


def test_chaos_dir_fires_a_script_phase_once(tmp_path, monkeypatch):
    """``kill.<rank>`` fires at its phase of the first step >= its step, renamed before the
    SIGKILL: a second process of the rank never fires it again; a spare's sandbox never does."""
    kills = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: kills.append((pid, sig)))
    d = ChaosDir(str(tmp_path))
    (tmp_path / "kill.2").write_text("backward 10\n")
    for job, step, phase in [
        (job_of(1), 12, "backward"),
        (job_of(2), 9, "backward"),
        (job_of(2), 12, "forward"),
        (job_of(2, True), 12, "backward"),
    ]:
        d.kill(job, step, phase)
    assert not kills
    d.kill(job_of(2), 11, "backward")
    assert kills == [(os.getpid(), signal.SIGKILL)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"kill.2.fired.{os.getpid()}"]
    d.kill(job_of(2), 12, "backward")  # the next process of rank 2: nothing armed any more
    assert len(kills) == 1


def test_chaos_dir_arms_a_runtime_point_for_the_process_that_takes_it(tmp_path, monkeypatch):
    """``kill.<rank>`` holding a runtime point (snapshot, vote) is taken at a step's start by one
    process, which arms ``TM_FAILPOINT`` with the marker the driver waits for."""
    monkeypatch.delenv("TM_FAILPOINT", raising=False)
    d = ChaosDir(str(tmp_path))
    (tmp_path / "kill.3").write_text("snapshot 40\n")
    d.start_step(job_of(3, sandbox=True), 41)
    d.start_step(job_of(1), 41)
    assert "TM_FAILPOINT" not in os.environ
    d.start_step(job_of(3), 38)  # taken before its step: the runtime fires at the first step >= 40
    marker = tmp_path / f"kill.3.fired.{os.getpid()}"
    assert os.environ["TM_FAILPOINT"] == f"snapshot:3:40:{marker}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"kill.3.armed.{os.getpid()}"]
    (tmp_path / "kill.0").write_text("forward 5\n")  # a script phase: not the runtime's
    d.start_step(job_of(0), 6)
    assert (tmp_path / "kill.0").exists() and os.environ["TM_FAILPOINT"].startswith("snapshot:3:")


def test_chaos_dir_end_hold_fast_slow(tmp_path, monkeypatch):
    d, off = ChaosDir(str(tmp_path)), ChaosDir(None)
    assert not off and d and not off.over(10**6) and off.end(60) == 60
    assert d.end(60) == 60 and not d.over(59)
    (tmp_path / "end").write_text("25")
    assert d.end(60) == 25 and d.over(25) and not d.over(24)
    assert not d.fast() and not d.slow()
    monkeypatch.setenv("TM_NODE_ID", "s3")
    (tmp_path / "fast").touch()
    (tmp_path / "slow.s3").touch()
    assert d.fast() and d.slow()
    d.hold(job_of(0))  # no hold file: returns at once


@pytest.mark.slow
def test_chaos_soak_ends_bitwise_equal(etcd_endpoint, tmp_path):
    report = chaos.soak(etcd_endpoint, str(tmp_path), seed=int(os.environ.get("TM_CHAOS_SEED", "1")), faults=20, steps=800, step_sleep=0.05)
    print(chaos.markdown(report["table"]))
    failed = [r for r in report["results"] if not r["recovered"]]
    assert not failed, failed
    assert report["faults"] == 20
    assert report["bitwise_equal"], report.get("diff") or report.get("error")


# The faults for a layout: a worker killed mid-step and inside the commit vote, a kill
# while the step's snapshot is on its way to its holder, an agent SIGKILL, a hang, a joiner
# killed while entering, two non-neighbouring nodes at once (the full soak: bench/chaos.py --layout).
SHORT_LAYOUT_KINDS = ("kill-backward", "kill-vote", "kill-snapshot", "agent-kill", "hang", "spare-killed-promotion", "double-failure")


@pytest.mark.slow  # ~2-4 min each here, with the machine shared
@pytest.mark.timeout(600)  # spares warm up slowly on a loaded machine: the soak holds training for them
@pytest.mark.parametrize("layout, parity", [*((layout, 0) for layout in chaos.LAYOUTS), ("fsdp", 2)], ids=[*chaos.LAYOUTS, "fsdp-parity"])
def test_chaos_soak_per_layout_recovers_every_fault_live(etcd_endpoint, tmp_path, layout, parity):
    """A short soak of a layout (tests/scripts/hybrid.py, 4 nodes): every fault recovered live,
    from the in-memory snapshots where no live rank replicates a rank's state, from the replica
    in hsdp and ddp-tp (no generation in restart mode, no state lost, no generation no fault
    explains), every rank's state bitwise equal to plain torchrun's.
    With ``--snapshot-parity 2`` (groups {0, 1} and {2, 3}, each one's stripes on the other) two
    ranks r and r + 2 lost at once take a rank and a stripe of its own group's parity: not a
    fault parity covers, so that soak leaves out the double failure."""
    seed = int(os.environ.get("TM_CHAOS_SEED", "1"))
    mine = [k for k in SHORT_LAYOUT_KINDS if k in chaos.kinds_of(layout, parity)]
    kinds = random.Random(seed).sample(mine, len(mine))
    report = chaos.soak(
        etcd_endpoint,
        str(tmp_path),
        seed=seed,
        faults=len(kinds),
        steps=800,
        step_sleep=0.05,
        kinds=kinds,
        layout=layout,
        parity=parity,
    )
    print(chaos.markdown(report["table"]))
    failed = [r for r in report["results"] if not r["recovered"]]
    assert not failed, failed
    assert report["faults"] == len(kinds)
    assert not report["restarts"] and not report["state_lost"], (report["restarts"], report["state_lost"])
    assert not report["unexplained"], report["unexplained"]  # e.g. a healthy node replaced after a recovery
    assert all(r["live"] for r in report["results"]), [r for r in report["results"] if not r["live"]]
    assert report["bitwise_equal"], report.get("diff") or report.get("error")


@pytest.mark.slow  # ~15-50 s here, with the machine shared
def test_node_lost_with_no_spare_left_fails_cleanly_with_a_checkpoint(local_job):
    """Two active nodes, no spare: losing a node ends the job with one clear line, a non-zero exit
    and the script's checkpoint on disk, within seconds, never a hang."""
    job = local_job(nnodes="2", nproc=1, launcher_args=["--max-restarts", "3"])
    ckpt = os.path.join(job.workdir, "ckpt")
    job.script_args = ["--steps", "2000", "--step-sleep", "0.02", "--step-log", job.step_log, "--ckpt-dir", ckpt, "--ckpt-every", "5"]
    job.start_all(["a", "b"])
    job.wait_step(12)
    t = time.time()
    job.kill_agent("b")
    codes = job.wait(timeout=60)
    took = time.time() - t
    assert codes["a"] != 0 and codes["b"] != 0, job.logs_tail()
    log = job.nodes["a"].log()
    assert "job failed: no spare left: 1 node(s) remain, --nnodes needs at least 2" in log, job.logs_tail()
    assert "Traceback" not in log.split("no spare left")[-1], log[-3000:]
    assert took < 30, f"the job took {took:.1f}s to fail"
    state = torch.load(os.path.join(ckpt, "ckpt.pt"))
    assert state["step"] >= 10 and state["step"] % 5 == 0
