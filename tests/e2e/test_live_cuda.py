"""Live substitution of a job whose state lives on the GPU: real agents, real etcd, real signals.

Two ranks share the one GPU a test machine has. NCCL refuses two ranks on one device, so the job
asks for gloo, which carries CUDA tensors through host memory: DDP's gradient buckets, the loss
all-reduced after the optimizer step, and the joiner's state (``transfer.wire_for``: a CUDA
tensor on a group without NCCL is staged one tensor at a time). Model, batches, optimizer
state and dropout's random state are CUDA tensors; every run ends with the bitwise check against
the fault-free run on the same GPU. Skipped without CUDA (the CPU suite covers the protocol).
"""

import pytest
import test_live_layouts as layouts
import test_snapshots as snapshots
import torch
from test_live import PAUSE, assert_bitwise, fault_free_reference, run_job

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the README's GPUs section says where this ran)")

CUDA = ("--device", "cuda", "--backend", "gloo", "--random")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, etcd_server):
    return fault_free_reference(tmp_path_factory, etcd_server)


@pytest.mark.parametrize(
    "kill_rank, phase",
    [
        (1, "optimizer"),  # the spare takes the ranks it warmed up as
        (0, "vote"),  # the spare runs the script again on the GPU for rank 0
        (1, "logged"),  # after the commit, inside the loss logging
    ],
)
def test_cuda_state_survives_a_worker_sigkill_bitwise(local_job, reference, kill_rank, phase):
    script = [
        *CUDA,
        "--log-loss",
        "--kill-rank",
        str(kill_rank),
        "--kill-step",
        str(PAUSE + 5),
        "--kill-phase",
        phase,
        "--kill-trigger",
        "TRIGGER",
        "--kill-marker",
        "MARKER",
    ]
    job, codes, params, _ = run_job(local_job, ["a", "b", "c"], nproc=1, script=script)
    victim = next(e["node"] for e in job.events() if e["kind"] == "worker_failed")
    survivor = ({"a", "b"} - {victim}).pop()
    assert codes["c"] == 0 and codes[survivor] == 0, job.logs_tail()
    assert_bitwise(params, reference(2, 1, extra=CUDA))
    spare = job.nodes["c"].log()
    assert "received the training state" in spare, spare
    plans = [e for e in job.events() if e["kind"] == "plan" and e.get("generation", 0) >= 1]
    assert len(plans) == 1 and plans[0]["live"], [p["cause"] for p in plans]


# Ranks holding different state on the GPU (tests/scripts/hybrid.py): DTensor tensor parallel, FSDP2
# and pipeline stages, four ranks on one GPU through gloo. The joiner must receive its own shard,
# on the GPU.
HYBRID_CUDA = ("--device", "cuda", "--backend", "gloo")


@pytest.fixture(scope="module")
def layout_reference(tmp_path_factory):
    return layouts.torchrun_reference(tmp_path_factory)


@pytest.mark.parametrize(
    "layout, rank, phase",
    [
        # The spare runs the script again for another TP shard. Its sandbox's backward ran on
        # autograd's GPU thread, whose DTensor caches hold the old meshes (sharding_decisions corrects them).
        ("ddp-tp", 1, "backward"),
        ("hsdp", 2, "forward"),  # FSDP2 shards on the GPU, replicated across the other half
        ("pp", 1, "vote"),  # the spare takes another stage; activations cross stages through the host
    ],
)
def test_cuda_joiner_receives_its_own_shard_bitwise(local_job, layout, rank, phase, layout_reference):
    job, codes, got = layouts.run(local_job, layout, kill=(rank, phase), extra=HYBRID_CUDA)
    layouts.assert_live(job, codes, rank)
    assert layouts.received(job), job.logs_tail()
    layouts.assert_bitwise(got, layout_reference(layout, HYBRID_CUDA))


# Layouts no live rank replicates, on the GPU: the lost shard comes back from its in-memory
# snapshot, copied off the GPU on a side stream into pinned host memory (test_snapshots.py is
# the CPU suite of the same cases).
@pytest.fixture(scope="module")
def snapshot_reference(tmp_path_factory):
    return snapshots.torchrun_reference(tmp_path_factory)


@pytest.mark.parametrize(
    "layout, rank, phase",
    [
        ("fsdp", 2, "vote"),  # pure FSDP2 shards on the GPU
        ("fsdp-tp", 1, "backward"),  # FSDP2 x DTensor TP
        ("zero", 0, "logging"),  # ZeroRedundancyOptimizer: the optimizer partition from the snapshot
        ("fsdp", 1, "snapshot"),  # killed before its holder had the step: every rank returns one step
    ],
)
def test_cuda_shard_without_a_replica_comes_back_from_its_snapshot_bitwise(local_job, snapshot_reference, layout, rank, phase):
    job, codes, got = snapshots.run(local_job, layout, kill=(rank, phase), extra=HYBRID_CUDA)
    snapshots.assert_live(job, codes)
    layouts.assert_bitwise(got, snapshot_reference(layout, 4, HYBRID_CUDA))
    text = snapshots.logs(job)
    assert "received this rank's snapshot of step" in text, text[-3000:]
