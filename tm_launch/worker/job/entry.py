"""``tm_launch.init()`` and ``tm_launch.report_step()``: which job this process gets.

Under tm-launch's live mode (``TM_LIVE=1`` in ``WorkerEnv``) a ``LiveJob``, one per process (a
spare running the script again for other ranks gets the same one back); otherwise a
``PlainJob`` over ``init_process_group``.
"""

from __future__ import annotations

import dataclasses
import datetime

from ... import settings
from ...protocol import WorkerEnv
from .. import rehearsal_dump
from ..api import Job
from ..step_report import process_reporter
from . import optimizer_steps

_LIVE = None  # the process's LiveJob, once built


def init(backend: str | None = None, rng_per_rank: bool = True, timeout=None) -> Job:
    """Start this worker's part of the job (see ``tm_launch.worker.api.Job``). ``rng_per_rank``:
    live mode treats the global RNGs (torch CPU and CUDA, numpy, ``random``) as this rank's own
    state without registration (restored when a step runs again, carried to a rank taking its
    place); False for a script that keeps every random draw out of its training state.
    ``timeout`` (a ``datetime.timedelta``, None: the backend's default): how long a collective
    waits for a peer, as ``init_process_group(timeout=...)`` takes it. Torch waits that long for
    a busy rank, so the agent does too; ``--collective-timeout`` on the command line wins."""
    global _LIVE
    if _LIVE is not None:
        return _LIVE
    script_timeout = timeout_seconds(timeout)
    env = WorkerEnv.from_environ()
    if env.live:
        import torch

        from ..log import log
        from ..torch_support import check
        from .live import LiveJob  # the live runtime, imported only where a worker goes live

        check(torch.__version__, log)  # one warning line on a torch release live mode was not tested on

        env = dataclasses.replace(env, collective_timeout=settings.chosen_timeout(env.collective_timeout, script_timeout))
        _LIVE = rehearsal_dump.arm(LiveJob(env, backend, rng_per_rank))  # tm-launch rehearse: nothing unless its variables are set
        return _LIVE
    from .plain import PlainJob

    return rehearsal_dump.arm(PlainJob(backend, timeout))


def timeout_seconds(timeout) -> float:
    """``timeout=`` in seconds (0: not given), refused as ``init_process_group`` refuses it."""
    if timeout is None:
        return 0.0
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"tm_launch.init: expected timeout to be a datetime.timedelta, got {type(timeout).__name__}")
    if timeout.total_seconds() <= 0:
        raise ValueError(f"tm_launch.init: timeout must be positive, got {timeout}")
    return timeout.total_seconds()


def live_job():
    """The process's ``LiveJob``, or None (never built, or not live)."""
    return _LIVE


def report_step(step: int) -> None:
    """``tm_launch.report_step(step)``: ``job.report_step(step)`` for scripts that never call
    ``init()`` (they call ``init_process_group`` themselves); nothing under plain torchrun."""
    optimizer_steps.the_script_reports()
    report_counted_step(step)


def report_counted_step(step: int) -> None:
    """A step this process finished, told to the agent: the script's own report, or its
    optimizers' count for a script that says nothing (``job.optimizer_steps``)."""
    if _LIVE is not None:
        _LIVE.report_finished_step(step)
        return
    reporter = process_reporter()
    if reporter is not None:
        reporter.step(step)
