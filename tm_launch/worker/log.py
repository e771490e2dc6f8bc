"""The worker's log lines: tm-launch's logging convention (``tm_launch.logs``) under the logger
``tm_launch.worker``, each line named by the rank this process holds when it is written (a
promoted spare changes rank): ``[tm-launch worker 3] ...``. The user script's own logging is
left alone (no handler on the root logger)."""

from __future__ import annotations

import os

from ..logs import logger

log = logger("tm_launch.worker", prog=lambda: f"tm-launch worker {os.environ.get('RANK', '?')}")


def first_line(error: BaseException, limit: int = 160) -> str:
    """An error in one log line: its message's first line (its type when the message is empty)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:limit]
