"""A worker's exit notice: the agent learns that a live worker's exit began before the kernel
has freed its memory (``tm_launch.exit_page``), with real worker processes started through live
mode's wrapper, real signals and the real shared page."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from tm_launch import exit_page
from tm_launch.launcher.exit_notice import counts_as_failure
from tm_launch.launcher.processes import OutputSpec, WorkerSet
from tm_launch.protocol import WorkerState

pytestmark = pytest.mark.skipif(not exit_page.supported(), reason="no set_tid_address hook known on this platform")

WRAPPER = [sys.executable, "-u", "-m", "tm_launch.worker"]

S = WorkerState
COUNTS = [
    (S.RUNNING, "live", False, True),  # killed while training: the failure, at once
    (S.ENTERING, "live", False, True),
    (S.RECOVERING, "live", False, True),
    (S.RUNNING, "live", True, False),  # the interpreter's own exit (an exception, sys.exit): its status says why
    (S.RUNNING, "restart", False, False),  # a loop of its own reporting steps may end with os._exit(0)
    (S.FINISHED, "live", False, False),  # done, then os._exit or a crash in teardown
    (S.LEFT, "live", False, False),
    (S.PARKED, "live", False, False),  # a spare: not on the job's path
    (S.SANDBOX, "live", False, False),
    (S.WARMUP, "live", False, False),
    (S.STARTED, "restart", False, False),  # restart mode before its first step report
    (None, "live", False, False),  # no state read
]


@pytest.mark.parametrize("state, mode, on_its_own, failure", COUNTS)
def test_which_beginnings_of_an_exit_count_as_a_failure(state, mode, on_its_own, failure):
    assert counts_as_failure(state, mode, on_its_own) is failure


def _start(tmp_path, body: str, cmd_prefix=WRAPPER) -> WorkerSet:
    script = tmp_path / "worker.py"
    script.write_text(
        "import os, sys, time\n"
        f"open({str(tmp_path / 'env')!r}, 'w').write(repr(sorted(k for k in os.environ if k.startswith('TM_'))))\n" + body
    )
    workers = WorkerSet([*cmd_prefix, str(script)], OutputSpec(), "r", str(tmp_path))
    workers.start({0: {**os.environ, "PYTHONPATH": os.getcwd()}}, generation=0, kind="fresh")
    return workers


def _until(check, timeout=30.0):
    deadline = time.time() + timeout
    while not check():
        assert time.time() < deadline, "timed out"
        time.sleep(0.005)


def test_a_killed_worker_is_seen_as_its_exit_begins_before_waitid_says_so(tmp_path):
    """A worker holding 300 MB is SIGKILLed: its page's word is cleared before ``waitid``
    returns (the kernel frees the memory in between), the agent's watch hears of it, and the
    page says the interpreter did not end it."""
    ready = tmp_path / "ready"
    workers = _start(tmp_path, f"held = b'x' * (300 * 2**20)\nopen({str(ready)!r}, 'w').close()\ntime.sleep(120)\n")
    try:
        worker = workers.workers[0]
        _until(ready.exists)
        os.kill(worker.pid, signal.SIGKILL)
        os.waitid(os.P_PID, worker.pid, os.WEXITED | os.WNOWAIT)
        assert worker.notice._words[exit_page.TID] == 0  # the kernel's order, whatever the threads' timing
        _until(lambda: worker.notice.began_at is not None)
        assert not worker.notice.on_its_own
        assert "TM_EXIT_NOTICE" not in (tmp_path / "env").read_text()  # the script's environment is torchrun's
        assert worker.poll() == -signal.SIGKILL
    finally:
        workers.stop(grace=0)


@pytest.mark.parametrize("body", ["raise SystemExit(3)\n", "raise ValueError('boom')\n"])
def test_an_interpreters_own_exit_is_marked_as_such(tmp_path, body):
    workers = _start(tmp_path, body)
    try:
        worker = workers.workers[0]
        _until(lambda: worker.poll() is not None)
        _until(lambda: worker.notice.began_at is not None)
        assert worker.notice.on_its_own and worker.poll() in (1, 3)
    finally:
        workers.stop(grace=0)


def test_a_worker_started_without_the_live_wrapper_has_no_page(tmp_path):
    """Restart mode runs ``python -u SCRIPT``: no page, no descriptor, no variable."""
    workers = _start(tmp_path, "", cmd_prefix=[sys.executable, "-u"])
    try:
        assert workers.workers[0].notice is None
        _until(lambda: workers.workers[0].poll() is not None)
        assert "TM_EXIT_NOTICE" not in (tmp_path / "env").read_text()
    finally:
        workers.stop(grace=0)


def test_a_forked_childs_own_exit_is_not_its_parents(tmp_path):
    """A child the script forked (a data-loader worker) shares the page; its interpreter's exit
    must not mark the worker's, which is then SIGKILLed and seen as killed."""
    ready = tmp_path / "ready"
    body = f"pid = os.fork()\nif pid == 0:\n    sys.exit(0)\nos.waitpid(pid, 0)\nopen({str(ready)!r}, 'w').close()\ntime.sleep(120)\n"
    workers = _start(tmp_path, body)
    try:
        worker = workers.workers[0]
        _until(ready.exists)
        os.kill(worker.pid, signal.SIGKILL)
        _until(lambda: worker.notice.began_at is not None)
        assert not worker.notice.on_its_own
    finally:
        workers.stop(grace=0)
