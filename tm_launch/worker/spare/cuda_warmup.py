"""What a spare's sandbox does on CUDA after its warm-up steps, so that it leaves no trace.

The sandbox runs real steps (CUDA context, cuBLAS/cuDNN handles, kernels loaded, allocator
segments) so that a promoted spare pays none of that on the critical path. What those steps
leave behind that the job does not need: activations and gradients freed into the caching
allocator's pool (reserved by this process, unavailable to anything else on the GPU) and cuBLAS
workspaces. ``leave_no_trace`` returns both to the driver; what stays is the CUDA context, the
loaded kernels and the handles (the warm part) and whatever the script still holds (its model
and optimizer, which will receive the live state).
"""

from __future__ import annotations

import gc

import torch


def gpu_memory(device=None) -> dict:
    """Bytes on ``device``: the allocator's live tensors and its reserved pool, and what the
    whole GPU has in use (every process, contexts and NCCL buffers included)."""
    free, total = torch.cuda.mem_get_info(device)
    return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device), "device_used": total - free}


def leave_no_trace(device=None) -> dict | None:
    """Release what warm-up steps left in this process's CUDA pools; the memory figures after
    it (``gpu_memory``), or None when CUDA was never initialised here (a CPU job: nothing to do,
    and nothing is initialised by asking)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    gc.collect()  # tensors held only by reference cycles (autograd graphs of the last step)
    torch.cuda.synchronize(device)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return gpu_memory(device)
