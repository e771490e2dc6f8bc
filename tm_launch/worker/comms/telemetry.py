"""Per-group collective telemetry for the agent's culprit rule (C4, arXiv 2406.04594).

``LiveGroup`` calls ``entered`` as it hands a collective to its communicator and ``completed``
when the collective's work settles; the commit vote (a world-wide rendezvous through the store,
not a communicator) calls ``vote_entered``/``vote_done``. Each writes a few float64 words of
this process's page (``tm_launch.collective_page``), a file the agent created and maps too:
no system call, no lock, no collective of its own, nothing through etcd. The agent reads the
page on its own schedule; only when a collective looks stuck do agents exchange what they read.

Why this shape:

* One slot per group, looked up once and kept on the group object: the hot path is an attribute
  read, ``time.monotonic()`` and four stores (``bench/telemetry_cost.py`` measures it).
* ``T_PENDING`` is "no progress since": set when a collective is entered with none pending, and
  moved on each completion while more are pending. A DDP backward keeps buckets in flight for
  its whole length; what is abnormal is a pending collective that stops completing, not a long
  run of ones that complete.
* ``TYPICAL`` is a decaying maximum of recent durations (each collective lowers it by 5%), so the
  stuck threshold follows the group's own rhythm without a history buffer.
* Counters restart when the group's communicator is swapped (a new generation): survivors and
  joiners then count from the same point, the re-run step.
* Threads: completions arrive on gloo's threads, entries on the caller's. Each word has one
  writer at a time in practice, and the reader tolerates one stale word.

* The main thread's position (``PositionSampler``): a thread of this process looks at the main
  thread's innermost frame every ``SAMPLE_EVERY`` and counts the changes on the page, with the
  script's place in words. The agent compares the count between its looks: Python code that
  runs moves it, a sleep, a blocked read or a deadlock does not (``health.progress``).

Without an agent (plain torchrun) or without a page path, every call returns at once.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import sys
import sysconfig
import threading
import time

from ... import collective_page as page
from ...protocol import WorkerEnv

P2P = frozenset({"send", "recv"})
DECAY = 0.95
SAMPLE_EVERY = 0.2  # s between two looks at the main thread (the agent compares windows of 1 s)


class Page:
    """This process's mapped page."""

    def __init__(self, path: str, rank: int):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < page.SIZE:
                os.ftruncate(fd, page.SIZE)
            self._map = mmap.mmap(fd, page.SIZE)
        finally:
            os.close(fd)
        self._map[: page.SIZE] = bytes(page.SIZE)  # a restarted process starts clean
        # A memoryview of doubles: an element store costs about half of a ctypes array's.
        self.words = memoryview(self._map).cast("d")
        self.words[page.H_PID] = os.getpid()
        self.words[page.H_RANK] = rank
        self.words[page.H_VERSION] = page.VERSION
        self.words[page.H_MAGIC] = page.MAGIC
        self.used = 0
        self.named: dict[str, int] = {}  # groups without an object to keep their slot on (the commit vote)

    def take(self, name: str, members) -> int | None:
        """The first word of a new slot for group ``name``; None when every slot is taken (the
        group is then not recorded: the rule sees it as never judged)."""
        if self.used >= page.MAX_SLOTS:
            return None
        i = self.used
        desc = page.describe(name, members)
        self._map[page.DESC_AT + i * page.DESC : page.DESC_AT + i * page.DESC + len(desc)] = desc
        base = page.HEADER + i * page.SLOT
        self.words[base + page.GENERATION] = -1
        self.words[base + page.USED] = 1.0
        self.used += 1
        self.words[page.H_SLOTS] = self.used
        return base

    def rank(self, rank: int) -> None:
        self.words[page.H_RANK] = rank  # a spare promoted to another rank runs the script again for it

    def where(self, where: str) -> None:
        self._map[page.WHERE_AT : page.WHERE_AT + page.WHERE] = page.encode_where(where)


def _library_dirs() -> tuple[str, ...]:
    """Where code that is not the script's lives: the standard library, installed packages,
    tm-launch itself. The place a busy rank is reported at is the script's innermost frame."""
    dirs = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs.add(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tm_launch/
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs)


@functools.lru_cache(maxsize=4096)
def _is_library(filename: str, library: tuple[str, ...]) -> bool:
    return filename.startswith("<") or os.path.realpath(filename).startswith(library)


def place(frame, library: tuple[str, ...]) -> str:
    """``evaluate() at train.py:88``: the innermost frame of ``frame``'s stack that is the
    script's (not the library's), else the innermost one."""
    innermost = frame
    while frame is not None and _is_library(frame.f_code.co_filename, library):
        frame = frame.f_back
    frame = frame or innermost
    return f"{frame.f_code.co_name}() at {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


class PositionSampler(threading.Thread):
    """Counts the changes of the main thread's position (code object and line of its innermost
    frame) on the page. It needs the interpreter's lock for each look: a long C call that
    holds it looks like no movement here, and shows as CPU time to the agent instead."""

    def __init__(self, p: Page, main: int):
        super().__init__(daemon=True, name="tm-position")
        self.page, self.main = p, main

    def run(self) -> None:
        library, last = _library_dirs(), None
        while True:
            time.sleep(SAMPLE_EVERY)
            frame = sys._current_frames().get(self.main)
            if frame is None:
                return  # the main thread is gone: the interpreter ends
            key = (frame.f_code, frame.f_lineno)
            if key != last:
                last = key
                self.page.where(place(frame, library))  # first: the agent reads the place of the move it counts
                self.page.words[page.H_MOVES] += 1
            del frame


_page: Page | None = None
_opened = False


def _open() -> Page | None:
    global _page, _opened
    _opened = True
    env = WorkerEnv.from_environ()
    if env.telemetry:
        try:
            _page = Page(env.telemetry, env.rank)
        except OSError:
            _page = None
        else:
            PositionSampler(_page, threading.main_thread().ident).start()
    return _page


def collective_timeout(seconds: float) -> None:
    """The timeout this rank's groups run their collectives under: a busy rank is blamed only
    just before it (the agent's ``Limits.busy_after``)."""
    p = _page if _opened else _open()
    if p is not None:
        p.words[page.H_TIMEOUT] = seconds


def _slot(p: Page, group) -> int | None:
    try:
        return group._tm_telemetry_slot
    except AttributeError:
        base = group._tm_telemetry_slot = p.take(group.group_name, group.member_ranks)
        return base


_GEN, _ENTERED, _DONE, _T_ENTERED, _T_PENDING, _T_DONE, _TYPICAL = (
    page.GENERATION,
    page.ENTERED,
    page.DONE,
    page.T_ENTERED,
    page.T_PENDING,
    page.T_DONE,
    page.TYPICAL,
)
_P2P_ENTERED, _P2P_DONE, _T_P2P = page.P2P_ENTERED, page.P2P_DONE, page.T_P2P
_monotonic = time.monotonic


def _enter(p: Page, base: int, generation: int, p2p: bool):
    w, now = p.words, _monotonic()
    if w[base + _GEN] != generation:  # a new communicator: count from its first collective
        for i in range(_ENTERED, page.SLOT):
            w[base + i] = 0.0
        w[base + _GEN] = generation
    if p2p:
        seq = w[base + _P2P_ENTERED] + 1
        w[base + _P2P_ENTERED] = seq
        w[base + _T_P2P] = now
        return base, generation, -seq, now
    seq = w[base + _ENTERED] + 1
    if w[base + _DONE] >= seq - 1:
        w[base + _T_PENDING] = now  # nothing was pending: this collective's wait starts now
    w[base + _T_ENTERED] = now
    w[base + _ENTERED] = seq
    return base, generation, seq, now


def entered(group, name: str):
    """Group ``group`` (a ``LiveGroup``) hands collective ``name`` to its communicator: a token
    for ``completed``, or None when nothing is recorded."""
    p = _page if _opened else _open()
    if p is None:
        return None
    base = _slot(p, group)
    if base is None:
        return None
    return _enter(p, base, group.generation, name in P2P)


def completed(token) -> None:
    """The collective of ``token`` settled (worked or failed: either way nobody waits on it)."""
    if token is None or _page is None:
        return
    base, generation, seq, t0 = token
    w, now = _page.words, _monotonic()
    if w[base + _GEN] != generation:
        return  # the communicator was swapped meanwhile: its counters started over
    if seq < 0:
        if -seq > w[base + _P2P_DONE]:
            w[base + _P2P_DONE] = -seq
        w[base + _T_P2P] = now
        return
    if seq > w[base + _DONE]:
        w[base + _DONE] = seq
    w[base + _T_DONE] = now
    typical = w[base + _TYPICAL] * DECAY
    w[base + _TYPICAL] = now - t0 if now - t0 > typical else typical
    if w[base + _ENTERED] > seq:
        w[base + _T_PENDING] = now  # the next one waits from here: the chain still moves


def vote_entered(generation: int, rank: int):
    """This rank votes on its step's commit in ``generation``'s store (``commit.StepCommit``)."""
    p = _page if _opened else _open()
    if p is None:
        return None
    base = p.named.get(page.COMMIT_GROUP)
    if base is None:
        base = p.named[page.COMMIT_GROUP] = p.take(page.COMMIT_GROUP, None)
        if base is None:
            return None
    p.rank(rank)
    return _enter(p, base, generation, False)


vote_done = completed


@contextlib.contextmanager
def checkpointing():
    """``Job.checkpointing()``: this rank saves a checkpoint inside. While it saves, the agent
    gives it ``hang_checkpoint_timeout`` before blaming it for a collective its peers wait in (a
    rank-0-only save while the others wait at the next all-reduce is normal), and before its
    watchdog fires. Nested saves count as one (the outermost)."""
    p = _page if _opened else _open()
    if p is None or p.words[page.H_SAVING]:
        yield
        return
    p.words[page.H_SAVING] = _monotonic()
    try:
        yield
    finally:
        p.words[page.H_SAVED] = _monotonic()  # first: the rank's idle time counts from here, never from before the save
        p.words[page.H_SAVING] = 0.0
