"""DDP's speed options recover live, in one generation (``tests/scripts/ddp_options.py``).

``static_graph=True`` with ``gradient_as_bucket_view=True``, ``find_unused_parameters=True`` and
an fp16 compression comm hook; 2 nodes of 1 worker and a warm spare; real agents, etcd, gloo
and SIGKILLs. Each run: one new generation, the survivor keeps its process, and every rank's
whole state (the module's state_dict with its BatchNorm buffers, the optimizer's and the
scheduler's) is bitwise equal to the same script's fault-free run under plain torchrun.
"""

import glob
import os
import subprocess
import sys

import pytest
import torch

from tm_launch.local.localjob import REPO

SCRIPT = os.path.join(REPO, "tests", "scripts", "ddp_options.py")
STEPS = 24
PAUSE = 8  # faulty runs hold every rank at this step until the spare is parked
KILL = 12
pytestmark = pytest.mark.timeout(900)  # whole jobs (a torchrun reference and a live run) on a loaded 2-core machine


def script(option: str, workdir: str, *extra: str) -> list[str]:
    return ["--ddp", option, "--steps", str(STEPS), "--out", os.path.join(workdir, "out"), *extra]


def load(workdir: str) -> dict:
    return {os.path.basename(p).rsplit(".", 1)[1]: torch.load(p) for p in glob.glob(os.path.join(workdir, "out.rank*"))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Each option's fault-free final state per rank under plain torchrun (computed once)."""
    cache = {}

    def get(option: str) -> dict:
        if option not in cache:
            workdir = str(tmp_path_factory.mktemp(f"ref-{option}"))
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", SCRIPT, *script(option, workdir)]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=REPO)  # a loaded 2-core machine
            assert out.returncode == 0, out.stderr[-3000:]
            cache[option] = load(workdir)
            assert sorted(cache[option]) == ["rank0", "rank1"]
        return cache[option]

    return get


def run(local_job, option: str, rank: int, phase: str):
    """2 nodes of 1 worker plus a spare; the worker holding ``rank`` SIGKILLs itself at ``phase``
    of step KILL, once the spare has parked."""
    job = local_job(nnodes="2", nproc=1, script=SCRIPT, launcher_args=["--max-restarts", "3"])
    job.env = {"OMP_NUM_THREADS": "1"}
    trigger = os.path.join(job.workdir, "trigger")
    job.script_args = script(
        option,
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
    )
    job.start_all(["n0", "n1"])
    job.wait_for(lambda s: s["generation"] is not None, 120, "generation 0")
    job.start("spare")
    job.wait_parked("spare", timeout=300)  # a loaded machine: its sandbox imports torch and builds DDP
    open(trigger, "w").close()
    codes = job.wait(timeout=300)
    return job, codes, load(job.workdir)


def assert_one_live_generation(job, codes, survivor: int) -> None:
    """One new generation, live: the spare replaced the victim's node, whose worker alone died;
    the survivor's worker kept its process (one pid for all its steps)."""
    plans = [e for e in job.events() if e["kind"] == "plan" and e.get("generation", 0) >= 1]
    assert len(plans) == 1, f"new generations: {[p['cause'] for p in plans]}\n{job.logs_tail()}"
    assert plans[0]["live"] and list(plans[0]["replaced"]) == ["spare"], job.logs_tail()
    victim = plans[0]["replaced"]["spare"]
    assert codes[victim] != 0 and all(c == 0 for n, c in codes.items() if n != victim), job.logs_tail()
    pids = {}
    with open(job.step_log) as f:
        for line in f:
            _, r, step, generation, pid = line.split()
            pids.setdefault(int(r), {}).setdefault(int(generation), set()).add(pid)
    assert set(pids[survivor]) == {0, 1} and len(pids[survivor][0] | pids[survivor][1]) == 1, pids


def assert_bitwise(got: dict, ref: dict) -> None:
    assert sorted(got) == sorted(ref), f"ranks that wrote their state: {sorted(got)}"
    for rank in sorted(ref):
        a, b = got[rank], ref[rank]
        assert a["model"].keys() == b["model"].keys(), rank
        diff = [k for k in b["model"] if not torch.equal(a["model"][k], b["model"][k])]
        assert not diff, f"{rank}: its state_dict differs from the fault-free run in {diff}"
        sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
        assert sa.keys() == sb.keys(), rank
        odiff = [(i, k) for i in sb for k in sb[i] if not torch.equal(torch.as_tensor(sa[i][k]), torch.as_tensor(sb[i][k]))]
        assert not odiff, f"{rank}: its optimizer state differs in {odiff}"
        assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"], rank
        assert a["scheduler"] == b["scheduler"], rank


@pytest.mark.parametrize(
    "option, rank, phase",
    [
        pytest.param("static", 1, "backward", marks=pytest.mark.slow),
        pytest.param("static", 0, "backward", marks=pytest.mark.slow),
        pytest.param("static", 1, "forward", marks=pytest.mark.slow),
        pytest.param("unused", 0, "backward", marks=pytest.mark.slow),
        pytest.param("unused", 1, "backward", marks=pytest.mark.slow),
        pytest.param("fp16", 0, "backward", marks=pytest.mark.slow),
        pytest.param("fp16", 1, "backward", marks=pytest.mark.slow),
    ],
)
def test_ddp_option_recovers_live_in_one_generation(local_job, reference, option, rank, phase):
    job, codes, got = run(local_job, option, rank, phase)
    assert_one_live_generation(job, codes, survivor=1 - rank)
    assert_bitwise(got, reference(option))
