"""The torchtitan job the e2e test (``tests/e2e/test_torchtitan.py``) and the benchmark
(``bench/torchtitan_bench.py``) both run, and how both read its last checkpoint: one definition, so
that the benchmark measures the job the test proves bitwise. No torchtitan import here (the
test module imports it before it knows whether torchtitan is installed)."""

from __future__ import annotations

import os


def titan_args(
    assets: dict[str, str],
    dump_folder: str,
    steps: int,
    ckpt_every: int,
    replicate: int = 1,
    tp: int = 1,
    pp: int = 1,
    schedule: str | None = None,
    seq_len: int = 128,
    local_batch_size: int = 2,
) -> list[str]:
    """torchtitan's command line, as a user gives it to ``torchtitan.train``: the tiny llama3,
    FSDP over 2 ranks (HSDP with ``replicate`` > 1: that many replicas of those 2 shards; with
    ``tp`` > 1, each FSDP rank a tensor-parallel group of ``tp`` ranks; with ``pp`` > 1 no FSDP
    sharding but ``pp`` pipeline stages, each ``replicate`` times, under torchtitan's default
    schedule or ``schedule``: 2 microbatches of 1 sequence), a DCP checkpoint every
    ``ckpt_every`` steps, a fixed seed and deterministic kernels (so two runs can be compared
    bitwise), fp32 parameters (bf16 is slow on CPU). ``seq_len`` x ``local_batch_size`` tokens per
    rank and step set how much compute a step has (the benchmark's ``--seq-len``)."""
    return [
        "--module",
        "tiny_llama3",
        "--config",
        "llama3_tiny",
        "--hf-assets-path",
        assets["hf_assets_path"],
        "--dataloader.dataset-path",
        assets["dataset_path"],
        "--dump-folder",
        dump_folder,
        "--training.steps",
        str(steps),
        "--training.seq-len",
        str(seq_len),
        "--training.local-batch-size",
        str(local_batch_size),
        "--training.mixed-precision-param",
        "float32",
        "--parallelism.data-parallel-shard-degree",
        "1" if pp > 1 else "2",
        "--checkpoint.enable",
        "--checkpoint.interval",
        str(ckpt_every),
        "--debug.seed",
        "42",
        "--debug.deterministic",
        *(["--parallelism.data-parallel-replicate-degree", str(replicate)] if replicate > 1 else []),
        *(["--parallelism.tensor-parallel-degree", str(tp)] if tp > 1 else []),
        # torchtitan refuses pipeline parallelism with its CUDA graphs on (its default), even on a CPU
        *(["--parallelism.pipeline-parallel-degree", str(pp), "--training.disable-cuda-graphs"] if pp > 1 else []),
        *(["--parallelism.pipeline-parallel-schedule", schedule] if schedule else []),
    ]


def ranks_of(replicate: int = 1, tp: int = 1, pp: int = 1) -> int:
    """The ranks ``titan_args`` with these degrees runs on."""
    return (1 if pp > 1 else 2) * replicate * tp * pp


def final_state(dump_folder: str, steps: int) -> dict:
    """Everything in torchtitan's last checkpoint (``step-<steps>``), gathered to full tensors and
    flattened to dotted keys: each rank's FSDP shards of the model and the optimizer, the LR
    scheduler, the train state and each data-parallel rank's data-loader position."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = os.path.join(dump_folder, "checkpoint", f"step-{steps}")
    out = path + ".pt"
    dcp_to_torch_save(path, out)
    return flatten(torch.load(out, weights_only=False))


def flatten(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in flatten(sub, f"{prefix}{key}.").items()}
    if isinstance(tree, list | tuple):
        return {k: v for i, sub in enumerate(tree) for k, v in flatten(sub, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): tree}
