"""Which torch releases live mode is tested on, and what a worker says on another.

Live mode changes torch's own objects (``torch_patches``) and reads some of its private
attributes; ``tests/unit/worker/test_torch_patch_shapes.py`` checks each of them and passed on
the releases below (``make test-torch TORCH=X``; results in docs/development.md).
``pyproject.toml`` asks for ``torch>=2.13`` and no upper bound: an upper bound would make pip
replace the torch a user already has. So a worker on a newer release is told once, at start, in
one warning line, and refused only where the internals live mode cannot do without are gone
(``missing``): a clear line then instead of an ``AttributeError`` in the middle of a job.
"""

from __future__ import annotations

# major.minor; the patch releases run: 2.13.0, 2.14.1, 2.15.0 (docs/development.md)
TESTED = ("2.13", "2.14", "2.15")


def release(version: str) -> str:
    """``"2.14.1+cu130"`` -> ``"2.14"``."""
    return ".".join(version.split("+")[0].split(".")[:2])


def warning(version: str) -> str | None:
    """The line a worker on ``version`` logs at start, or None for a tested release."""
    if release(version) in TESTED:
        return None
    return (
        f"torch {version} is not a release tm-launch's live mode was tested on ({', '.join(TESTED)}); "
        "it changes some of torch's internals (tests/unit/worker/test_torch_patch_shapes.py checks them): "
        "rehearse the script first (tm-launch rehearse)"
    )


def missing() -> list[str]:
    """The torch internals ``torch_patches`` assigns to or calls that this torch lacks."""
    from torch.distributed import distributed_c10d as c10d

    needed = {
        "torch.distributed.distributed_c10d._world.pg_group_ranks": lambda: c10d._world.pg_group_ranks,
        "torch.distributed.distributed_c10d._world.pg_map": lambda: c10d._world.pg_map,
        "torch.distributed.distributed_c10d._world.pg_names": lambda: c10d._world.pg_names,
        "torch.distributed.distributed_c10d._world.pg_backend_config": lambda: c10d._world.pg_backend_config,
        "torch.distributed.distributed_c10d._register_process_group": lambda: c10d._register_process_group,
        "torch.distributed.distributed_c10d._unregister_process_group": lambda: c10d._unregister_process_group,
        "torch.distributed.distributed_c10d._update_default_pg": lambda: c10d._update_default_pg,
        "torch.distributed.device_mesh.new_group": _device_mesh_new_group,
    }
    absent = []
    for name, read in needed.items():
        try:
            read()
        except AttributeError:
            absent.append(name)
    return absent


def _device_mesh_new_group():
    import torch.distributed.device_mesh as device_mesh

    return device_mesh.new_group


def check(version: str, log) -> None:
    """At a live worker's start: one warning line on an untested release; SystemExit with one
    ``tm-launch: error:`` line where the internals live mode patches are gone."""
    line = warning(version)
    if line is None:
        return
    log.warning(line)
    absent = missing()
    if absent:
        raise SystemExit(
            f"tm-launch: error: torch {version} lacks what live mode patches ({', '.join(absent)}): "
            f"use a tested torch ({', '.join(TESTED)}) or --no-live"
        )
