"""One small key-value interface over etcd's v2 API (python-etcd) and v3 API (etcd3gw).

``api`` holds the interface (``KV``, ``Lease``), its errors and records, and what both
implementations share; ``v2`` and ``v3`` hold the implementations. ``connect`` imports only the
one it is asked for, so importing this package loads no etcd client library.
"""

from __future__ import annotations

import importlib

from .api import KV, AccessDenied, Change, Entry, EtcdOptions, KVError, Lease, LeaseExpired, Listing, WatchNews

__all__ = ["KV", "AccessDenied", "Change", "Entry", "EtcdOptions", "KVError", "Lease", "LeaseExpired", "Listing", "WatchNews", "connect"]

# The implementations' public names, imported on first use (with their client libraries).
_LAZY = {"EtcdV2": "v2", "EtcdV3": "v3", "TXN_OPS": "v3"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def connect(api: str, options: EtcdOptions) -> KV:
    """A KV for ``api`` "v2" or "v3", after checking once (within ``options.timeout``) that
    etcd answers, so that misconfiguration fails fast with a clear KVError."""
    kinds = {"v2": "EtcdV2", "v3": "EtcdV3"}
    if api not in kinds:
        raise ValueError(f"unknown etcd API {api!r}: use 'v2' or 'v3'")
    kv = __getattr__(kinds[api])(options)
    try:
        kv._check()
    except BaseException:
        kv.close()
        raise
    return kv
