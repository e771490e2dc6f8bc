"""What a run of the script left in its working directory, read for the comparison
(``compare.compare_files``): the files are part of what a run produces, and a checkpoint the
script saves at the end (an EMA, a counter it keeps outside ``job.register``) can diverge after a
fault while every registered object came back right.

* a ``torch.save`` file is loaded (on the CPU, never executing more than ``torch.load`` does) and
  each tensor or plain value in it is an entry ``~file/<path>:<key>``, compared bitwise;
* a directory holding a DCP checkpoint (``torch.distributed.checkpoint``: its ``.metadata``) is
  read whole (``dcp_to_torch_save``, no process group) into entries ``~file/<dir>:<key>``;
* any other file is one entry ``~file/<path>``, compared byte for byte (``compare.FileBytes``).

The rehearsal's own files never lie there (each run keeps its logs and dumps beside its
working directory, ``runs``).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import zipfile

from .compare import FILES, FileBytes

KEEP_BYTES = 1 << 20  # files up to this size keep their bytes (where two copies first differ is said)
DCP_METADATA = ".metadata"


def read_files(cwd: str) -> dict:
    """``{"entries", "roles"}`` of every file under ``cwd`` (symbolic links not followed)."""
    entries: dict = {}
    if not os.path.isdir(cwd):
        return {"entries": entries, "roles": {}}
    for root, dirs, names in os.walk(cwd):
        dirs.sort()
        rel_root = os.path.relpath(root, cwd)
        if DCP_METADATA in names:  # a DCP checkpoint: its shards read as one state dict
            entries.update(_dcp(root, _rel(rel_root, "")))
            dirs[:] = []
            continue
        for name in sorted(names):
            path = os.path.join(root, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            entries.update(_file(path, _rel(rel_root, name)))
    return {"entries": entries, "roles": dict.fromkeys(entries, "file")}


def _rel(root: str, name: str) -> str:
    return os.path.normpath(os.path.join(root, name)) if name else os.path.normpath(root)


def _file(path: str, rel: str) -> dict:
    loaded = _torch_load(path)
    if loaded is not None:
        return {f"{FILES}/{rel}:{k}" if k else f"{FILES}/{rel}:(value)": v for k, v in flatten(loaded).items()}
    digest, size = hashlib.blake2b(), 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
            size += len(chunk)
    content = None
    if size <= KEEP_BYTES:
        with open(path, "rb") as f:
            content = f.read()
    return {f"{FILES}/{rel}": FileBytes(size, digest.hexdigest(), content)}


def _torch_load(path: str):
    """The object a ``torch.save`` file holds, or None for any other file."""
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive (its legacy format is not read)
        return None
    try:
        with zipfile.ZipFile(path) as z:
            if not any(n.endswith("/data.pkl") or n == "data.pkl" for n in z.namelist()):
                return None
        import torch

        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception:  # noqa: BLE001 -- not a torch file after all: compared byte for byte
        return None


def _dcp(directory: str, rel: str) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "whole.pt")
        try:
            dcp_to_torch_save(directory, out)
        except Exception as e:  # noqa: BLE001 -- an unreadable checkpoint is a difference of its own
            return {f"{FILES}/{rel}:(unreadable)": f"{type(e).__name__}: {e}"[:200]}
        import torch

        return {f"{FILES}/{rel}:{k}": v for k, v in flatten(torch.load(out, map_location="cpu", weights_only=False)).items()}


def flatten(value, prefix: str = "") -> dict:
    """Nested dicts/lists/tuples -> ``{"a.b.0": leaf}``: tensors (a DTensor's full value is not
    at hand here: its local part), numbers, strings and bytes as they are, anything else by its
    type's name (its repr may hold an address)."""
    import torch

    out = {}
    if isinstance(value, torch.Tensor):
        local = getattr(value, "to_local", None)
        out[prefix] = (local() if local is not None else value).detach().cpu()
    elif isinstance(value, dict):
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            out.update(flatten(v, f"{prefix}.{i}" if prefix else str(i)))
    elif value is None or isinstance(value, (bool, int, float, str, bytes)):
        out[prefix] = value
    else:
        out[prefix] = f"<{type(value).__name__}>"
    return out
