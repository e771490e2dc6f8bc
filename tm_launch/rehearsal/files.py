"""What a run of the script left in its working directory, read for the comparison
(``compare.compare_files``): the files are part of what a run produces, and a checkpoint the
script saves at the end (an EMA, a counter it keeps outside ``job.register``) can diverge after a
fault while every registered object came back right.

* a ``torch.save`` file is loaded (on the CPU, never executing more than ``torch.load`` does) and
  each tensor or plain value in it is an entry ``~file/<path>:<key>``, compared bitwise;
* a directory holding a DCP checkpoint (``torch.distributed.checkpoint``: its ``.metadata``) is
  read whole (``dcp_to_torch_save``, no process group) into entries ``~file/<dir>:<key>``;
* a ``.json`` file (a framework's trainer state) is read as its values, ``~file/<path>:<key>``,
  so that a wall-clock measurement in it is named apart as in a rank's state
  (``compare.is_wall_clock``);
* any other file is one entry ``~file/<path>``, compared byte for byte (``compare.FileBytes``).

The run's own working directory, where a file holds its path (a framework's "best checkpoint"
path), reads as ``<cwd>``: every run has a directory of its own.

The rehearsal's own files never lie there (each run keeps its logs and dumps beside its
working directory, ``runs``).
"""

from __future__ import annotations

import hashlib
import json
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
            entries.update(_dcp(root, _rel(rel_root, ""), cwd))
            dirs[:] = []
            continue
        for name in sorted(names):
            path = os.path.join(root, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            entries.update(_file(path, _rel(rel_root, name), cwd))
    return {"entries": entries, "roles": dict.fromkeys(entries, "file")}


def _rel(root: str, name: str) -> str:
    return os.path.normpath(os.path.join(root, name)) if name else os.path.normpath(root)


def _values(rel: str, value, cwd: str) -> dict:
    return {f"{FILES}/{rel}:{k or '(value)'}": _unplaced(v, cwd) for k, v in flatten(value).items()}


def _unplaced(value, cwd: str):
    """``value`` with the run's own directory written ``<cwd>``."""
    if isinstance(value, str):
        return value.replace(cwd, "<cwd>")
    if isinstance(value, bytes):
        return value.replace(cwd.encode(), b"<cwd>")
    return value


def _file(path: str, rel: str, cwd: str) -> dict:
    loaded = _torch_load(path)
    if loaded is not None:
        return _values(rel, loaded, cwd)
    if path.endswith(".json") and os.path.getsize(path) <= KEEP_BYTES:
        try:
            with open(path) as f:
                return _values(rel, json.load(f), cwd)
        except ValueError:
            pass  # not JSON after all: its bytes
    size = os.path.getsize(path)
    if size > KEEP_BYTES:
        digest = hashlib.blake2b()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        return {f"{FILES}/{rel}": FileBytes(size, digest.hexdigest())}
    with open(path, "rb") as f:
        content = _unplaced(f.read(), cwd)
    return {f"{FILES}/{rel}": FileBytes(len(content), hashlib.blake2b(content).hexdigest(), content)}


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


def _dcp(directory: str, rel: str, cwd: str) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "whole.pt")
        try:
            dcp_to_torch_save(directory, out)
        except Exception as e:  # noqa: BLE001 -- an unreadable checkpoint is a difference of its own
            return {f"{FILES}/{rel}:(unreadable)": f"{type(e).__name__}: {e}"[:200]}
        import torch

        return _values(rel, torch.load(out, map_location="cpu", weights_only=False), cwd)


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
