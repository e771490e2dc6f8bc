"""Health alarms drive failover end to end: fake NVML at the pynvml boundary, real agents."""

import os
import time

import pytest
import torch
from test_live import PAUSE, SCRIPT, assert_bitwise, reference  # noqa: F401  (fixture)


def _start(local_job, actives, spare, nproc, launcher=(), script=(), env_for=None):
    job = local_job(nnodes=str(len(actives)), nproc=nproc, launcher_args=["--max-restarts", "3", *launcher])
    trigger = os.path.join(job.workdir, "trigger")
    out = os.path.join(job.workdir, "params.pt")
    job.script_args = [*SCRIPT, "--out", out, "--step-log", job.step_log, "--pause-step", str(PAUSE), "--pause-file", trigger, *script]
    for name in actives:
        job.start(name, (env_for or {}).get(name))
        time.sleep(0.2)
    job.wait_for(lambda s: s["generation"] is not None, 120, "generation 0")
    job.start(spare)
    return job, trigger, out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["live", "restart"])
def test_fatal_xid_fails_over_to_the_spare(local_job, reference, tmp_path, mode):
    timeline, armed = tmp_path / "xid79.yaml", tmp_path / "xid79.go"
    timeline.write_text(f"gpus: 2\nevents:\n  - {{at: 0, after_file: {armed}, gpu: 1, xid: 79}}\n")
    launcher = [] if mode == "live" else ["--no-live"]
    job, trigger, out = _start(local_job, ["a", "b"], "c", 2, launcher=launcher, env_for={"b": {"TM_FAKE_NVML": str(timeline)}})
    if mode == "live":
        job.wait_parked("c")
    else:
        job.wait_for(lambda s: any(n["id"] == "c" and n["role"] == "spare" for n in s["nodes"]), 60, "the spare")
    armed.touch()  # the fake NVML delivers XID 79 on b's GPU 1 now
    job.wait_for(lambda s: s["generation"] == 1, 90, "the failover after XID 79")
    status = job.status()
    alarm = [a for a in status["alarms"] if a["node"] == "b"][0]
    assert alarm["signal"] == "xid" and alarm["severity"] == "fatal" and alarm["value"] == 79, alarm
    assert {n["id"]: n["role"] for n in status["nodes"]}["b"] == "failed"
    open(trigger, "w").close()
    codes = job.wait(timeout=240)
    assert codes["a"] == 0 and codes["c"] == 0 and codes["b"] != 0, job.logs_tail()
    if mode == "live":
        assert_bitwise(torch.load(out), reference(2, 2))


@pytest.mark.slow
def test_straggler_is_migrated_to_the_spare(local_job, reference, tmp_path):
    # Node b's worker needs ~50% more compute per step (0.16 s -> 0.24 s here), from when the
    # spare has parked (``DIR/slow.b``): slow from the start, b was found a straggler before a
    # loaded machine had warmed the spare up, the migration then went to the cold spare, and the
    # test waited for a spare that was no longer one to park.
    chaos = tmp_path / "chaos"
    chaos.mkdir()
    launcher = ["--health-straggler-window", "5", "--health-straggler-need", "3", "--health-straggler-of", "5"]
    job, trigger, out = _start(
        local_job,
        ["a", "b", "d"],
        "c",
        1,
        launcher=launcher,
        script=["--steps", "120", "--step-sleep", "0.1", "--chaos-dir", str(chaos), "--slow-factor", "0.8"],
    )
    job.wait_parked("c")
    (chaos / "slow.b").touch()
    open(trigger, "w").close()
    codes = job.wait(timeout=240)
    assert codes == {"a": 0, "b": 0, "c": 0, "d": 0}, job.logs_tail()
    kinds = [(e["kind"], e.get("message", "")) for e in job.events()]
    assert any(k == "alarm" and "straggler" in m for k, m in kinds), kinds
    plan = [e for e in job.events() if e["kind"] == "plan" and e.get("generation") == 1][0]
    assert plan["planned"] and plan["replaced"] == {"c": "b"}, plan
    assert_bitwise(torch.load(out), reference(3, 1, 120))


def test_no_nvml_is_one_info_line_and_nothing_else(local_job):
    job = local_job(nnodes="1", nproc=1, script_args=["--steps", "3"])
    job.start("solo")
    assert job.wait(timeout=120) == {"solo": 0}
    log = job.nodes["solo"].log()
    assert log.count("GPU health monitor off") == 1, log
