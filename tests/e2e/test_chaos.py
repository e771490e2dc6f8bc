"""Chaos: a long live run with >= 20 random real faults ends bitwise equal to the fault-free run
(bench/chaos.py); and a fault that no spare can cover ends the job cleanly, never a hang."""

import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

import chaos  # noqa: E402  (bench/chaos.py)


@pytest.mark.parametrize("seed, faults", [(1, 12), (1, 24), (7, 30)])
def test_schedule_covers_every_kind_and_is_seeded(seed, faults):
    kinds = chaos.schedule(seed, faults)
    assert len(kinds) == faults and set(kinds) == set(chaos.KINDS)
    assert kinds == chaos.schedule(seed, faults) and kinds != chaos.schedule(seed + 1, faults)


def test_schedule_refuses_too_few_faults():
    with pytest.raises(ValueError, match="at least 12"):
        chaos.schedule(1, 5)


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


@pytest.mark.slow
def test_chaos_soak_ends_bitwise_equal(etcd_endpoint, tmp_path):
    report = chaos.soak(etcd_endpoint, str(tmp_path), seed=int(os.environ.get("TM_CHAOS_SEED", "1")), faults=20, steps=800, step_sleep=0.05)
    print(chaos.markdown(report["table"]))
    failed = [r for r in report["results"] if not r["recovered"]]
    assert not failed, failed
    assert report["faults"] == 20
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
