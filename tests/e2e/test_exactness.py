"""Exact for the scripts people write: per-rank state found, not assumed.

``tests/scripts/ordinary.py`` is a torchrun script plus ``tm_launch.init()`` that registers its
model, optimizer and scheduler and nothing else: BatchNorm under DDP (either
``broadcast_buffers``) and FSDP2, dropout from the global RNG, a forward counter. 2 nodes of one
worker and a warm spare, a real SIGKILL at a point of a step; every rank's whole state
(``state_dict()`` with buffers, optimizer, scheduler) must equal the same script's fault-free run
under plain torchrun, bit for bit. DDP x tensor parallel (``--layout ddp-tp``, torch's DDP over
the ``dp`` dimension of a 2-D mesh) runs on 2 nodes of 2 workers: 4 ranks.
"""

import glob
import os
import sys

import pytest
import torch
from torchrun_reference import run_torchrun

from tm_launch.local.localjob import REPO

pytestmark = pytest.mark.timeout(900)  # whole jobs (a torchrun reference and a live run) on a loaded 2-core machine

ORDINARY = os.path.join(REPO, "tests", "scripts", "ordinary.py")
sys.path.append(os.path.dirname(ORDINARY))
from compile_records import by_process, last_graphs  # noqa: E402  (ordinary.py --compile's DIR/compile.jsonl)
from compile_records import read as compile_records  # noqa: E402

STEPS = 24
PAUSE = 8  # faulty runs hold every rank at this step until the spare is parked
KILL = 12


def load(out: str) -> dict:
    return {os.path.basename(p)[:-3]: torch.load(p) for p in glob.glob(os.path.join(out, "rank*.pt"))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """``get(*script_args, world=2) -> {rank: state}``: plain torchrun's fault-free run, cached."""
    cache = {}

    def get(*extra: str, world: int = 2) -> dict:
        if (extra, world) not in cache:
            out = str(tmp_path_factory.mktemp("ref"))
            timeout = 900 if "--compile" in extra else 300  # inductor's C++ compiles on a loaded 2-core machine
            run_torchrun(ORDINARY, ["--steps", str(STEPS), "--out", out, *extra], nproc=world, timeout=timeout)
            cache[extra, world] = load(out)
            get.dirs[extra, world] = out
            assert sorted(cache[extra, world]) == [f"rank{r}" for r in range(world)]
        return cache[extra, world]

    get.dirs = {}  # (extra, world) -> the run's --out directory (its compile records)
    return get


def run_live(local_job, extra: tuple, kills: list, spares: int = 1, nproc: int = 1, script: str = ORDINARY):
    """2 active nodes of ``nproc`` workers + ``spares`` spares running ``script`` (one that takes
    ``ordinary.py``'s ``--steps``, ``--out`` and fault arguments); ``kills``: (rank, phase, step)
    SIGKILLs, each once."""
    job = local_job(nnodes="2", nproc=nproc, script=script, launcher_args=["--max-restarts", "3"])
    job.env = {"OMP_NUM_THREADS": "1"}
    out = os.path.join(job.workdir, "out")
    trigger = os.path.join(job.workdir, "trigger")
    args = ["--steps", str(STEPS), "--out", out, *extra, "--pause-step", str(PAUSE), "--pause-file", trigger]
    if len(kills) == 1:
        rank, phase, step = kills[0]
        args += ["--kill-rank", str(rank), "--kill-step", str(step), "--kill-phase", phase]
        args += ["--kill-trigger", trigger, "--kill-marker", os.path.join(job.workdir, "killed")]
    else:  # each armed once, fired by whichever process holds the rank (faults.ChaosDir)
        chaos = os.path.join(job.workdir, "chaos")
        os.makedirs(chaos)
        for rank, phase, step in kills:
            with open(os.path.join(chaos, f"kill.{rank}"), "w") as f:
                f.write(f"{phase} {step}")
        args += ["--chaos-dir", chaos]
    job.script_args = args
    job.start_all(["a", "b"])
    job.wait_for(lambda s: s["generation"] is not None, 120, "generation 0")
    spare_names = [f"s{i}" for i in range(spares)]
    for name in spare_names:
        job.start(name)
        job.wait_parked(name, timeout=300)  # 2 workers warming up on a loaded 2-core machine
    open(trigger, "w").close()
    codes = job.wait(timeout=300)
    return job, codes, load(out)


def differences(got: dict, ref: dict) -> dict:
    out = {}
    for rank in sorted(ref):
        mine = got.get(rank, {})
        keys = set(ref[rank]) | set(mine)
        bad = [k for k in sorted(keys) if k not in mine or k not in ref[rank] or not _equal(mine[k], ref[rank][k])]
        if bad:
            out[rank] = bad
    return out


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def assert_exact_and_live(job, codes, got, ref):
    assert not [e for e in job.events() if e["kind"] == "state_lost"], job.logs_tail()
    plans = [e for e in job.events() if e["kind"] == "plan" and e.get("generation", 0) >= 1]
    assert plans and all(p["live"] for p in plans), job.logs_tail()
    assert sorted(got) == sorted(ref), job.logs_tail()
    assert differences(got, ref) == {}, job.logs_tail()


CASES = {
    "bn-ddp-broadcast": ("--bn",),
    "bn-ddp-own": ("--bn", "--no-broadcast-buffers"),
    "bn-fsdp": ("--bn", "--layout", "fsdp"),
    "dropout": ("--dropout", "0.3"),
    "counter": ("--counter", "--log-loss"),
    "everything": ("--bn", "--dropout", "0.3", "--counter", "--log-loss"),
}


@pytest.mark.slow  # over ~12 s on 2 cores: the fast tier keeps near 10 minutes
@pytest.mark.parametrize(
    "case, rank, phase",
    [
        ("bn-ddp-broadcast", 0, "backward"),
        pytest.param("bn-ddp-broadcast", 1, "backward", marks=pytest.mark.slow),
        pytest.param("bn-ddp-own", 1, "backward", marks=pytest.mark.slow),
        pytest.param("bn-fsdp", 1, "backward", marks=pytest.mark.slow),
        pytest.param("bn-fsdp", 0, "optimizer", marks=pytest.mark.slow),
        pytest.param("dropout", 1, "backward", marks=pytest.mark.slow),
        pytest.param("counter", 1, "backward", marks=pytest.mark.slow),  # after the survivor's forward, before the commit
        pytest.param("everything", 0, "forward", marks=pytest.mark.slow),
        pytest.param("everything", 1, "optimizer", marks=pytest.mark.slow),
        pytest.param("everything", 0, "logging", marks=pytest.mark.slow),
        pytest.param("everything", 1, "logged", marks=pytest.mark.slow),
    ],
)
def test_an_ordinary_script_recovers_exactly(local_job, reference, case, rank, phase):
    job, codes, got = run_live(local_job, CASES[case], [(rank, phase, KILL)])
    assert_exact_and_live(job, codes, got, reference(*CASES[case]))


@pytest.mark.slow
@pytest.mark.parametrize("broadcast", [True, False], ids=["broadcast", "own"])
def test_batchnorm_under_ddp_x_tp_recovers_exactly(local_job, reference, broadcast):
    """BatchNorm under DDP x TP, as a user writes it: a 2-D mesh (dp x tp), ColwiseParallel /
    RowwiseParallel on an MLP block, ``DDP(model, device_mesh=mesh["dp"])``; 2 nodes of 2
    workers. Rank 1 dies in its backward (after the survivors' forward changed their BatchNorm
    statistics); the spare node takes ranks 0 and 1 from their dp peers 2 and 3. Every rank
    ends bitwise equal to plain torchrun's fault-free run, every tensor of its state_dict: the
    parameters DDP's tensor-parallel wrapper keeps as plain attributes included."""
    extra = ("--bn", "--layout", "ddp-tp", *(() if broadcast else ("--no-broadcast-buffers",)))
    job, codes, got = run_live(local_job, extra, [(1, "backward", KILL)], nproc=2)
    assert_exact_and_live(job, codes, got, reference(*extra, world=4))


@pytest.mark.slow  # over ~12 s on 2 cores: the fast tier keeps near 10 minutes
def test_state_the_script_never_registered_ends_live_mode_loudly(local_job, reference):
    """``--hidden``: a counter in a Python variable, folded into the weights every step, never
    registered. The joiner starts it at 0, so its replicated weights drift from the survivor's
    after its first step: the audit after the change names the tensor and ends live mode (every
    worker restarts from the script's checkpoint, here its start), never a silent finish."""
    job, codes, got = run_live(local_job, ("--hidden",), [(1, "backward", KILL)])
    lost = [e for e in job.events() if e["kind"] == "state_lost"]
    assert lost, job.logs_tail()
    assert "replicas diverged" in lost[0]["message"] and "model:" in lost[0]["message"], lost[0]
    # Restarted from its start (no checkpoint), the job ends as the fault-free run does.
    assert differences(got, reference("--hidden")) == {}, job.logs_tail()


@pytest.mark.slow
def test_two_faults_in_a_row_recover_exactly(local_job, reference):
    """Rank 1 dies after the survivor's forward, then rank 0 (whose buffers DDP broadcasts) in
    the optimizer step four steps later: two spares, two live recoveries, exact."""
    extra = CASES["everything"]
    job, codes, got = run_live(local_job, extra, [(1, "backward", KILL), (0, "optimizer", KILL + 4)], spares=2)
    plans = [e for e in job.events() if e["kind"] == "plan" and e.get("generation", 0) >= 1]
    assert len(plans) >= 2, job.logs_tail()
    assert_exact_and_live(job, codes, got, reference(*extra))


COMPILED = {"ddp": ("--compile",), "fsdp-per-block": ("--compile", "--layout", "fsdp")}


@pytest.mark.slow
@pytest.mark.timeout(2400)  # two compiled jobs: every process compiles its graphs (cold: minutes under load)
@pytest.mark.parametrize("layout", COMPILED)
def test_a_compiled_script_recovers_exactly_and_keeps_its_graphs(local_job, reference, layout):
    """``torch.compile`` (inductor on the CPU): DDP around a compiled model, or FSDP2 with each
    block compiled before it is sharded. Rank 1 dies in its backward; the spare, warmed up as
    rank 1, takes over. Every rank ends bitwise equal to the same compiled script under plain
    torchrun; the survivor compiled exactly the graphs torchrun's rank 0 did (its graphs were
    kept through the change: no recompile), and the joiner compiled all of its graphs in its
    warm-up, none after its promotion, as many as torchrun's rank 1."""
    extra = COMPILED[layout]
    ref = reference(*extra)
    job, codes, got = run_live(local_job, extra, [(1, "backward", KILL)])
    assert_exact_and_live(job, codes, got, ref)
    torchrun = last_graphs(compile_records(os.path.join(reference.dirs[extra, 2], "compile.jsonl")))
    assert torchrun.keys() == {0, 1} and torchrun[0] > 0 and torchrun[1] > 0, torchrun
    live = by_process(compile_records(os.path.join(job.workdir, "out", "compile.jsonl")))
    assert len(live) == 3, live  # the survivor, the victim (until its kill), the joiner
    (kept,) = [records for records in live.values() if records[0]["rank"] == 0]
    (joiner,) = [records for records in live.values() if records[0]["sandbox"]]
    assert not any(r["sandbox"] for r in kept) and kept[-1]["step"] == STEPS - 1, kept
    assert kept[-1]["graphs"] == torchrun[0], (kept, torchrun)  # kept through the change: no recompile
    warm_up, promoted = [r for r in joiner if r["sandbox"]], [r for r in joiner if not r["sandbox"]]
    assert warm_up and promoted and {r["rank"] for r in joiner} == {1}, joiner
    assert warm_up[-1]["graphs"] == promoted[-1]["graphs"] == torchrun[1], (joiner, torchrun)  # all compiled in the warm-up
    assert warm_up[-1]["compile_s"] == promoted[-1]["compile_s"], joiner  # not a second spent compiling after the promotion
