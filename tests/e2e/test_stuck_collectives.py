"""A hung rank found from the collectives (C4), end to end: real agents, etcd, gloo, signals.

A worker stops without dying (SIGSTOP, a Python busy loop) at one point of a step; its peers
wait in a collective. The agents' collective telemetry names it (a ``culprit`` event with its
evidence), its agent kills it, a spare takes its ranks live, and every rank ends bitwise equal to
the fault-free run. No timing is asserted beyond "long before the hang watchdog's 60 s floor"
(the detection time is measured in ``bench/detection.py``). And a run without a fault, but with
long steps, a rank stalled on its data and a slow checkpoint, blames nobody.
"""

import pytest
from test_live import PAUSE, assert_bitwise, reference, run_job  # noqa: F401 - reference is a fixture

STALL = ["--log-loss", "--kill-rank", "2", "--kill-step", str(PAUSE + 5), "--kill-trigger", "TRIGGER", "--kill-marker", "MARKER"]


def _culprit_found_and_replaced(job, codes):
    events = job.events()
    culprits = [e for e in events if e["kind"] == "culprit"]
    assert culprits, [(e["kind"], e.get("message", "")[:160]) for e in events]
    assert culprits[0]["ranks"] == [2], culprits[0]
    assert not [e for e in events if e["kind"] == "hang"], "the hang watchdog must not be what found it"
    killed = [e for e in events if e["kind"] == "culprit_killed"]
    assert killed and killed[0]["rank"] == 2, events
    victim = killed[0]["node"]
    survivor = ({"a", "b"} - {victim}).pop()
    assert codes["c"] == 0 and codes[survivor] == 0, job.logs_tail()
    plans = [e for e in events if e["kind"] == "plan" and e.get("generation") == 1]
    assert plans and plans[0]["replaced"] == {"c": victim} and plans[0]["live"], events
    return culprits[0]


@pytest.mark.slow  # over ~12 s on 2 cores: the fast tier keeps near 10 minutes
@pytest.mark.timeout(600)  # with the torchrun reference: 331 s for the busy case at load 24 (its 20 s wait, 3 nodes of 2)
@pytest.mark.parametrize(
    "phase,how",
    [
        ("forward", "stop"),
        pytest.param("allreduce", "stop", marks=pytest.mark.slow),
        pytest.param("optimizer", "stop", marks=pytest.mark.slow),
        pytest.param("logging", "stop", marks=pytest.mark.slow),
        pytest.param("forward", "busy", marks=pytest.mark.slow),
    ],
)
def test_a_stalled_worker_is_named_from_the_collectives_and_replaced_bitwise(local_job, reference, phase, how):
    """DDP, 2 nodes x 2 workers + a spare, default health settings (hang floor 60 s). A Python
    busy loop makes progress (its CPU time moves): it is what torch waits for until the
    collective timeout, so it is blamed only just before that (25 s here, 30 min by default)."""
    launcher = ("--collective-timeout", "25") if how == "busy" else ()
    job, codes, params, _ = run_job(
        local_job, ["a", "b", "c"], script=[*STALL, "--kill-phase", phase, "--kill-how", how], launcher=launcher
    )
    culprit = _culprit_found_and_replaced(job, codes)
    assert culprit["verdict"] == "kill" and culprit["evidence"]["stuck"], culprit
    assert culprit["why"] == ("busy past the collective timeout" if how == "busy" else "frozen"), culprit
    assert_bitwise(params, reference(2, 2))


@pytest.mark.slow
def test_long_steps_a_data_stall_and_a_slow_checkpoint_blame_nobody(local_job, reference):
    """No fault: every 15th step is 20x longer on every rank, rank 1 stalls 3 s on its data once,
    rank 0 spends 14 s in a checkpoint save once, marked with ``job.checkpointing()`` (its peers
    wait for it in the next all-reduce: unmarked, it would be blamed after 10 s, as a busy loop is)."""
    script = ["--log-loss", "--long-every", "15", "--long-factor", "20", "--lag-rank", "1", "--lag-step", "30", "--lag-seconds", "3"]
    script += ["--stall-rank", "0", "--stall-step", "45", "--stall-seconds", "14", "--stall-saving"]
    job, codes, params, _ = run_job(local_job, ["a", "b"], spares=0, script=script)
    assert set(codes.values()) == {0}, job.logs_tail()
    kinds = [e["kind"] for e in job.events()]
    assert "culprit" not in kinds and "culprit_killed" not in kinds, job.events()
    assert_bitwise(params, reference(2, 2))


@pytest.fixture(scope="module")
def hybrid_reference(tmp_path_factory):
    from test_live_layouts import torchrun_reference

    return torchrun_reference(tmp_path_factory)


@pytest.mark.slow
@pytest.mark.timeout(900)  # 5 processes on a loaded 2-core machine: the spare's warm-up alone took minutes once
@pytest.mark.parametrize("layout, rank, phase", [("ddp-tp", 1, "backward"), ("fsdp-tp", 2, "forward"), ("fsdp", 3, "optimizer")])
def test_a_stopped_rank_of_a_hybrid_layout_is_named_and_replaced_bitwise(local_job, hybrid_reference, layout, rank, phase):
    """4 ranks (1 per node) + a spare, tests/scripts/hybrid.py: the rank's TP / FSDP peers wait
    for it in their groups, ranks of the other groups wait behind them (the chain is followed),
    and only the stopped rank is blamed."""
    from test_live_layouts import assert_bitwise as assert_same
    from test_live_layouts import assert_live, run

    job, codes, got = run(local_job, layout, kill=(rank, phase), extra=("--kill-how", "stop"))
    culprits = [e for e in job.events() if e["kind"] == "culprit"]
    assert culprits and culprits[0]["ranks"] == [rank], job.events()
    assert_live(job, codes, rank)
    assert_same(got, hybrid_reference(layout))


@pytest.mark.slow
def test_a_cut_off_node_is_blamed_by_the_majority(tmp_path, reference):
    """3 active nodes (1 worker each) + a spare, each in its own network namespace; b's link is
    cut while its process lives. a and c wait for b in a collective and cannot reach b's agent:
    the culprit rule blames b (the unreachable minority), well before b's lease (10 s) or the
    collective timeout (60 s) would, and the spare takes b's rank live, bitwise."""
    import os
    import time
    import uuid

    from netns import NetLab, unusable_reason
    from test_live import SCRIPT

    from rendezvous.etcd_server import EtcdServer
    from tm_launch.local.localjob import LocalJob

    why = unusable_reason()
    if why:
        pytest.skip(f"needs `ip netns`: {why}")
    with NetLab() as lab:
        addrs = {n: lab.add(n) for n in ("a", "b", "c", "d")}
        with EtcdServer(host=lab.host_addr) as etcd:
            run_id = f"t-{uuid.uuid4().hex[:10]}"
            job = LocalJob(
                endpoint=etcd.endpoint,
                run_id=run_id,
                workdir=str(tmp_path / run_id),
                nnodes="3",
                nproc=1,
                launcher_args=["--max-restarts", "3", "--lease-ttl", "10", "--collective-timeout", "60"],
            )
            trigger = os.path.join(job.workdir, "trigger")
            out = os.path.join(job.workdir, "params.pt")
            job.script_args = [*SCRIPT, "--out", out, "--step-log", job.step_log, "--pause-step", str(PAUSE), "--pause-file", trigger]
            start = lambda n: job.start(n, wrap=lab.wrap(n), extra_args=["--local-addr", addrs[n]])  # noqa: E731
            try:
                for n in ("a", "b", "c"):
                    start(n)
                    time.sleep(0.3)
                job.wait_for(lambda s: s["generation"] is not None, 120, "generation 0")
                start("d")
                job.wait_parked("d")
                open(trigger, "w").close()
                job.wait_step(PAUSE + 5)
                t_cut = time.time()
                lab.cut("b")
                job.wait_for(lambda s: s if s["generation"] == 1 else None, 60, "generation 1 without b")
                events = job.events()
                culprits = [e for e in events if e["kind"] == "culprit"]
                assert culprits and culprits[0]["nodes"] == ["b"] and culprits[0]["verdict"] == "cut", events
                assert culprits[0]["time"] - t_cut < 10, "found by the collectives, not by b's lease"
                plan1 = next(e for e in events if e["kind"] == "plan" and e.get("generation") == 1)
                assert plan1["replaced"] == {"d": "b"} and plan1["live"], plan1
                deadline = time.time() + 240  # b stays cut (its agent waits for etcd): the others finish
                while time.time() < deadline and any(job.nodes[n].proc.poll() is None for n in ("a", "c", "d")):
                    time.sleep(0.5)
                codes = {n: job.nodes[n].proc.poll() for n in ("a", "c", "d")}
                assert all(c == 0 for c in codes.values()), job.logs_tail()
                import torch

                assert_bitwise(torch.load(out), reference(3, 1))
            finally:
                job.stop()
