"""XID classification (pure)."""

from __future__ import annotations

from .alarms import DEGRADED, FATAL, INFO

# Short descriptions for log messages (NVIDIA's XID catalog); unknown XIDs print as numbers.
XID_NAMES = {
    8: "GPU stopped processing (idle timeout)",
    13: "graphics engine exception",
    31: "GPU memory page fault",
    32: "invalid or corrupted push buffer stream",
    43: "GPU stopped processing (software-induced fault)",
    45: "preemptive cleanup (a GPU process was aborted)",
    46: "GPU stopped processing",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "row remapping / page retirement recorded",
    64: "row remapping / page retirement failure",
    68: "video processor exception",
    69: "graphics engine class error",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    109: "context switch timeout",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
    154: "GPU recovery action changed",
}


def xid_name(xid: int) -> str:
    name = XID_NAMES.get(xid)
    return f"XID {xid} ({name})" if name else f"XID {xid}"


def classify_xid(xid: int, cfg, recent_count: int = 1) -> str | None:
    """Severity of one XID event, or None when it is ignored.

    ``recent_count``: occurrences of this XID on this GPU within ``cfg.repeat_window``,
    this one included.  Order of precedence: ignored, fatal, degraded, repeat (info, or
    degraded from ``cfg.repeat_count`` occurrences on), anything else info.
    """
    if xid in cfg.ignored_xids:
        return None
    if xid in cfg.fatal_xids:
        return FATAL
    if xid in cfg.degraded_xids:
        return DEGRADED
    if xid in cfg.repeat_xids:
        return DEGRADED if recent_count >= cfg.repeat_count else INFO
    return INFO
