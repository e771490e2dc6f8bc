"""The agent's side of a worker's exit notice: the moment a worker's exit began, before the
kernel freed its memory and long before ``waitid`` says so (``tm_launch.exit_page`` has the
measurements and the mechanism). ``failures.FailureWatch`` reports a worker that began to exit
while it trained and did not exit on its own (``counts_as_failure``) without waiting for its
status; every other exit goes the usual way.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable

from .. import exit_page
from ..protocol import WorkerState


def counts_as_failure(state: WorkerState | None, mode: str, on_its_own: bool) -> bool:
    """A worker whose exit began is a failure before its status is known when it was in a live
    job's steps (training, entering, waiting to recover) and its interpreter did not exit on its
    own: killed by a signal (SIGKILL, SIGSEGV, the OOM killer) or ``os._exit`` (a live worker's
    steps cannot end without its state saying so). A worker that finished or left, a spare, a
    loop of its own that reports steps (``mode`` "restart": it may end with ``os._exit(0)``), and
    an interpreter's own exit (an exception's traceback has the root cause, which ``waitid``'s
    path reads) are left to the exit status."""
    live_steps = (WorkerState.RUNNING, WorkerState.ENTERING, WorkerState.RECOVERING)
    return not on_its_own and mode == "live" and state in live_steps


class ExitNotice:
    """One worker's page and the thread that watches it. ``fd`` goes to the worker (inherited,
    named by ``TM_EXIT_NOTICE``); ``began_at`` is set when its exit began."""

    def __init__(self, on_notice: Callable[[], None]):
        self.began_at: float | None = None
        self._closed = False
        self.fd = os.memfd_create("tm-exit-notice", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, exit_page.SIZE)
        self._page = mmap.mmap(self.fd, exit_page.SIZE)
        self._words = exit_page.words(self._page)
        self._words[exit_page.TID] = exit_page.UNARMED
        self._on_notice = on_notice

    def watch(self) -> None:
        """Start watching, once the worker holds the page (after its start): the agent's copy of
        the descriptor is closed, the mapping stays."""
        os.close(self.fd)
        threading.Thread(target=self._run, daemon=True, name="tm-exit-notice").start()

    @property
    def on_its_own(self) -> bool:
        return self._words[exit_page.ON_ITS_OWN] == 1

    def _run(self) -> None:
        words = self._words
        while not self._closed:
            seen = words[exit_page.TID]
            if seen == 0:
                self.began_at = time.time()
                self._on_notice()
                return
            exit_page.wait(words, exit_page.TID, seen, timeout=1.0)  # armed: the worker wakes it; closing wakes it

    def close(self) -> None:
        """The worker is gone or stopped: end the thread (its page is freed with this object)."""
        self._closed = True
        exit_page.wake(self._words, exit_page.TID)
