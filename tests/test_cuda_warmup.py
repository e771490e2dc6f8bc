"""tm_launch.cuda_warmup: the sandbox's clean-up after warm-up steps on a real GPU."""

import pytest
import torch

from tm_launch.cuda_warmup import gpu_memory, leave_no_trace


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
