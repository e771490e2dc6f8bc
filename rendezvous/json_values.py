"""Reading back the JSON values tm-launch writes under a job's keys, shared by their readers
(``membership.Membership`` for ``state/``, ``operator_log.OperatorLog`` for ``log/``).

etcd content is input: anyone with access to the job's prefix can write anything there, so a
value tm-launch never wrote is skipped, never fatal, and named once (``ValueReader``) with how to
fix it, whichever reader met it.
"""

from __future__ import annotations

import json
import logging

from .kv import KV

log = logging.getLogger(__name__)


def json_object(text: str) -> dict:
    """A JSON object, else ValueError (NaN and Infinity, which Python's json accepts, included)."""
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    if not isinstance(value, dict):
        raise ValueError(f"a JSON {type(value).__name__}, not an object")
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


class ValueReader:
    """Reads a job's JSON values and records the unreadable keys its readers ignored: one per
    job, shared by ``Membership`` and its ``OperatorLog``, so that each key is logged once and
    ``skipped`` lists them all."""

    def __init__(self, kv: KV):
        self.kv = kv
        self.skipped: dict[str, str] = {}  # key -> why it was ignored (each is logged once)

    def objects(self, prefix: str) -> dict[str, dict]:
        """Key -> JSON object under ``prefix``, skipping anything else (etcd content is input:
        a garbage value must not break ``ctl status``)."""
        out = {}
        for e in self.kv.get_prefix(prefix):
            try:
                out[e.key] = json_object(e.value)
            except ValueError as err:
                self.skip(e.key, err)
        return out

    def where(self, key: str) -> str:
        options = getattr(self.kv, "options", None)
        where = (options.prefix.rstrip("/") + "/" if options and options.prefix else "") + key
        return ascii(where)[1:-1]  # a key is input too: no newlines or terminal escapes in logs

    def skip(self, key: str, error: Exception) -> None:
        """Ignore one unreadable value, and say so once per key: what it is and how to fix it."""
        why = " ".join(str(error).split())[:100] or type(error).__name__
        if key not in self.skipped:
            log.warning(
                "ignoring etcd key %s: unreadable (%s); tm-launch never wrote that, delete it (etcdctl del %s)",
                self.where(key),
                why,
                self.where(key),
            )
        self.skipped[key] = why
