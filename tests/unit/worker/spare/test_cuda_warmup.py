"""tm_launch.worker.spare.cuda_warmup: the sandbox's clean-up after warm-up steps on a real GPU."""

import pytest
import torch

from tm_launch.worker.spare.cuda_warmup import leave_no_trace


def test_cpu_job_has_nothing_to_release():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("CUDA already initialised in this process")
    assert leave_no_trace() is None
    if torch.cuda.is_available():
        assert not torch.cuda.is_initialized()  # asking did not create a context


def warm_up():
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(3):
        model(torch.randn(256, 1024, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (this is a CPU build or machine)")
def test_warmup_steps_leave_only_the_model_and_optimizer():
    torch.ones(1, device="cuda")
    base = leave_no_trace()
    model, opt = warm_up()
    kept = sum(p.numel() * p.element_size() for p in model.parameters()) * 3  # params + Adam's 2 moments
    assert torch.cuda.memory_reserved() > kept  # activations and workspaces still pooled
    parked = leave_no_trace()
    assert parked["allocated"] - base["allocated"] >= kept
    assert parked["reserved"] - parked["allocated"] < 40 << 20  # no garbage beyond partly used segments
    del model, opt
    dropped = leave_no_trace()
    assert dropped["allocated"] == base["allocated"] and dropped["reserved"] == base["reserved"]
    # What stays outside torch's allocator is the warm part: kernels loaded on first use and
    # cuBLAS handles (132 MiB on an H100 with torch 2.11 for bench/cuda_warmup.py's model).
    assert dropped["device_used"] - base["device_used"] < 512 << 20
    warm_up()
    again = leave_no_trace()
    assert (again["allocated"], again["reserved"]) == (base["allocated"], base["reserved"])
    assert abs(again["device_used"] - dropped["device_used"]) < 8 << 20  # a second warm-up: no growth


SANDBOX = r"""
import json, os
import torch, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
os.environ.update(TM_AGENT_STORE=f"127.0.0.1:{store.port}", TM_SANDBOX="1", GROUP_RANK="-1", WORLD_SIZE="2",
                  LOCAL_WORLD_SIZE="1", LOCAL_RANK="0", RANK="0", TM_SANDBOX_STEPS="3")
import tm_launch
job = tm_launch.init()  # a spare: no peers, every collective served locally
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
opt = torch.optim.AdamW(model.parameters())
job.register(model=model, optimizer=opt)
for step in job.spare.warm_up(0):  # what job.steps() runs in the sandbox before it parks
    model(torch.randn(256, 1024, device="cuda")).square().mean().backward()
    torch.distributed.all_reduce(next(model.parameters()).grad, group=job.group)
    opt.step()
kept = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
print("RESULT", json.dumps({"devices": list(job.devices), "allocated": torch.cuda.memory_allocated(),
                            "reserved": torch.cuda.memory_reserved(), "kept": kept}))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (this is a CPU build or machine)")
def test_the_sandbox_leaves_only_the_model_and_optimizer_on_the_gpu():
    """A spare's warm-up steps on its GPU end with ``leave_no_trace``: what the steps left in the
    allocator's pool (activations, gradients) goes back to the driver, the model and optimizer
    stay, and the job's groups would carry CUDA tensors through NCCL."""
    import json
    import os
    import subprocess
    import sys

    from tm_launch.local.localjob import REPO

    out = subprocess.run(
        [sys.executable, "-c", SANDBOX], capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": REPO}
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.split("RESULT", 1)[1])
    assert got["devices"] == ["cpu", "cuda:0"]
    assert got["allocated"] >= got["kept"]
    assert got["reserved"] - got["allocated"] < 40 << 20
    assert "CUDA pools released" in out.stderr
