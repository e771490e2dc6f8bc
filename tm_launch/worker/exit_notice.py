"""The worker's side of its exit notice (``tm_launch.exit_page``): sentinel threads whose exit
the kernel announces on the page the agent watches, and an ``atexit`` mark that tells an exit
of the interpreter's own from a death by a signal. Armed by ``python -m tm_launch.worker``
(live mode) before the script runs.

Two sentinels, both clearing the same word: the kernel writes a thread's word only while
another thread of the process still holds its memory, so the last thread to exit writes
nothing; with two, at least one of them is not the last.

``script_raised``: the script raised out of its top level in a live job's steps. The worker
prints the traceback (once per job: a replacement that raises the error its generation was
made for, ``Directive.cause``, names it in one line instead), tells its agent what was raised and at which step (``ScriptErrorRecord``)
and ends at once: the interpreter's teardown (the job's ``atexit`` close, a communicator's
destructor) waited on peers blocked in a receive, 120 s in the issue that found it, and nothing
of this process is needed any more.
"""

from __future__ import annotations

import atexit
import mmap
import os
import sys
import threading

from .. import exit_page
from ..protocol import EXIT_SCRIPT_ERROR, ScriptErrorRecord, WorkerEnv
from .log import log

SENTINELS = 2
_armed: list = []  # the page and its words, kept for the life of the process


def arm() -> bool:
    """Arm the page the agent handed over (``TM_EXIT_NOTICE``, an inherited descriptor); False
    where there is none (plain torchrun, restart mode) or the platform has no such hook."""
    variable = WorkerEnv.VARIABLES["exit_notice"]
    fd = os.environ.pop(variable, "")  # the script's own child processes have no page of theirs
    if not fd or not exit_page.supported():
        return False
    fd = int(fd)
    page = mmap.mmap(fd, exit_page.SIZE)
    os.close(fd)
    words = exit_page.words(page)
    _armed.extend((page, words))
    atexit.register(_on_its_own, words, os.getpid())
    words[exit_page.TID] = threading.get_native_id()
    for i in range(SENTINELS):
        ready = threading.Event()
        threading.Thread(target=_sentinel, args=(words, ready), daemon=True, name=f"tm-exit-sentinel-{i}").start()
        ready.wait(5)
    exit_page.wake(words, exit_page.TID)  # the agent's watch sleeps on the unarmed value
    return True


def _on_its_own(words, pid: int) -> None:
    """The interpreter exits on its own. Not in a child the script forked (a data-loader
    worker): it shares the page, and its exit is not this process's."""
    if os.getpid() == pid:
        words[exit_page.ON_ITS_OWN] = 1


def _sentinel(words, ready: threading.Event) -> None:
    """Lives as long as the process; its exit, whatever ends the process, clears the page's TID
    word and wakes the agent. (Its ``pthread`` entry is never joined: CPython's threads are
    detached, and this one never returns.)"""
    exit_page.clear_on_exit(words, exit_page.TID)
    ready.set()
    threading.Event().wait()


def script_raised(error: BaseException, job) -> None:
    """The script raised ``error`` out of its top level: in a live job (``job``, the process's
    ``LiveJob``, handed by the wrapper) that left its sandbox, print the traceback, report it,
    end now (``os._exit``). Returns where there is no such job (``None``: plain torchrun, restart
    mode; a spare's sandbox): the exception goes on as Python's."""
    if job is None or job.in_sandbox:
        return
    message = (str(error).strip().splitlines() or [""])[0][:300]
    record = ScriptErrorRecord(type=type(error).__name__, message=message, step=job.state.step, rank=job.rank)
    current = job.gens.builds.current
    if current is not None and record.signature() in current.cause:
        # The error this generation was made for (a replacement raising as its predecessor
        # did): its traceback was printed then; the job's logs get it once.
        log.error(
            f"rank {record.rank} raised {record.signature()} again, the error this generation was made for "
            "(its traceback was printed where it was first raised)"
        )
    else:
        sys.excepthook(type(error), error, error.__traceback__)
    try:
        job.agent.report_script_error(record)
    except Exception:  # noqa: BLE001 -- the agent is gone: the exit status says the rest
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_SCRIPT_ERROR)
