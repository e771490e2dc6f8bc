"""The page an agent shares with each of its workers to learn of the worker's death early, and
the futex calls on its words: the part both sides use (``launcher/exit_notice.py`` watches it,
``worker/exit_notice.py`` arms it).

Why a page: a process killed by a signal is reported to its parent (``waitid``) and closes its
sockets only after the kernel has freed its memory, and freeing a PyTorch process's memory is
slow: 14-27 ms for a process that only imported torch, 55-120 ms with 200 MB more on this
machine, seconds for a trainer holding gigabytes of host memory (pinned buffers, data, its
snapshots). The kernel has one hook before that work: a thread's ``clear_child_tid`` word
(``set_tid_address(2)``), which it sets to 0 and wakes a futex on as the thread's exit begins,
while other threads of the process are still alive. In a page of shared memory, that wake
reaches the agent: 0.1-5 ms after a SIGKILL in the same measurement.

Layout (32-bit words): ``TID``, the id of the worker's sentinel thread once armed (``UNARMED``
before), 0 once its exit began; ``ON_ITS_OWN``, 1 once the interpreter exits on its own (its
``atexit`` handlers ran: a normal exit, ``sys.exit`` or an uncaught exception), 0 for a death
by a signal or ``os._exit``.
"""

from __future__ import annotations

import ctypes
import mmap
import platform

TID, ON_ITS_OWN = 0, 1  # word indexes
UNARMED = -1
SIZE = mmap.PAGESIZE
_WORDS = 2

# syscall numbers: futex, set_tid_address
_CALLS = {"x86_64": (202, 218), "aarch64": (98, 96)}.get(platform.machine())
FUTEX_WAIT, FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE_FLAG): the waiter is another process
_libc = ctypes.CDLL(None, use_errno=True)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def supported() -> bool:
    """Linux on a CPU whose syscall numbers this module knows; elsewhere deaths are seen at
    ``waitid`` only."""
    return _CALLS is not None and platform.system() == "Linux"


def words(page: mmap.mmap):
    """The page's words, as a ctypes array over the shared memory."""
    return (ctypes.c_int32 * _WORDS).from_buffer(page)


def address(words_, index: int) -> int:
    return ctypes.addressof(words_) + 4 * index


def wait(words_, index: int, seen: int, timeout: float) -> None:
    """Sleep until word ``index`` is woken or no longer ``seen``, or ``timeout`` seconds pass."""
    ts = _Timespec(int(timeout), int((timeout % 1) * 1e9))
    _libc.syscall(_CALLS[0], ctypes.c_void_p(address(words_, index)), FUTEX_WAIT, ctypes.c_int(seen), ctypes.byref(ts), None, 0)


def wake(words_, index: int) -> None:
    _libc.syscall(_CALLS[0], ctypes.c_void_p(address(words_, index)), FUTEX_WAKE, ctypes.c_int(2**31 - 1), None, None, 0)


def clear_on_exit(words_, index: int) -> None:
    """The calling thread's exit sets word ``index`` to 0 and wakes it (``set_tid_address``)."""
    _libc.syscall(_CALLS[1], ctypes.c_void_p(address(words_, index)))
