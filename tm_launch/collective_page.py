"""The collective-telemetry page a live worker shares with its agent (both sides use it:
``worker/comms/telemetry.py`` writes it, ``launcher/collective_watch.py`` reads it).

Why a file mapped into memory and not the status report: C4's detector (arXiv 2406.04594) needs,
per rank and per communicator, which collective the rank entered last and since when, on every
collective. The status report is written at most every 0.25 s through the agent's store (a
round trip); a store into mapped memory costs nanoseconds and no system call, and the agent
reads the file only when it looks (every loop iteration, ~10 per second). No collective of its
own, nothing through etcd.

Layout (little-endian float64 words; counters fit a double exactly up to 2**53):

* header, ``HEADER`` words: ``MAGIC``, ``VERSION``, the writer's pid, its rank, slots in use,
  since when it has been saving a checkpoint (``job.checkpointing()``; 0: it is not), when its
  last save ended (a save is activity: the rank's time outside collectives counts from there),
  how many times its main thread's position changed (sampled by a thread of the worker: the
  agent's evidence that Python code runs, ``health.progress``), the collective timeout its
  groups use (seconds; 0: not known);
* ``MAX_SLOTS`` slots of ``SLOT`` words, one per process group (``LiveGroup``), indexes below;
* after them, ``DESC`` bytes per slot: the group's name and member ranks as JSON (``{"g": name,
  "m": [ranks] or null}``; null: the world), written once when the slot is taken;
* then ``WHERE`` bytes: the main thread's place in the script as last sampled
  (``evaluate() at train.py:88``, UTF-8, NUL-padded), for the agent's log of a busy rank.

Sequence numbers count the group's collectives since its communicator was last swapped (the
slot's ``GENERATION``): every member of a group issues its collectives in the same order, so
the n-th collective of one rank is the n-th of every other (C4's premise). Point-to-point
operations are counted apart (a send and its receive are one operation on two ranks, and the
ranks in between issue none): they show activity, not which collective is stuck.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from dataclasses import dataclass

MAGIC, VERSION = 7434.0, 2.0
HEADER = 12
SLOT = 16
MAX_SLOTS = 64
DESC = 256
WHERE = 256
# slot word indexes
USED, GENERATION, ENTERED, DONE, T_ENTERED, T_PENDING, T_DONE, TYPICAL, P2P_ENTERED, P2P_DONE, T_P2P = range(11)
# header word indexes
H_MAGIC, H_VERSION, H_PID, H_RANK, H_SLOTS, H_SAVING, H_SAVED, H_MOVES, H_TIMEOUT = range(9)
WORDS = HEADER + MAX_SLOTS * SLOT
DESC_AT = WORDS * 8
WHERE_AT = DESC_AT + MAX_SLOTS * DESC
SIZE = WHERE_AT + WHERE
COMMIT_GROUP = "tm-commit"  # the commit vote (through the store, not a communicator): a world-wide rendezvous too


@dataclass(frozen=True)
class SlotView:
    """One group's record as the agent read it (times: the writer's ``time.monotonic()``, the
    same clock as the reader's on one machine)."""

    group: str
    members: tuple[int, ...] | None  # None: the world; (): unknown (never judged)
    generation: int
    entered: int
    done: int
    t_entered: float
    t_pending: float  # since when the oldest collective still pending has made no progress
    t_done: float
    typical: float  # recent collective duration in this group, seconds (a decaying maximum)
    p2p_entered: int
    p2p_done: int
    t_p2p: float

    @property
    def pending(self) -> bool:
        return self.entered > self.done

    def last_activity(self) -> float:
        return max(self.t_entered, self.t_done, self.t_p2p)


@dataclass(frozen=True)
class PageView:
    pid: int
    rank: int
    slots: tuple[SlotView, ...]
    saving_since: float = 0.0  # the writer's time.monotonic() when its checkpoint save began (0: none)
    saved_at: float = 0.0  # ... when its last checkpoint save ended (0: none yet)
    moves: int = 0  # times its main thread's position changed (the worker's sampler thread)
    timeout: float = 0.0  # the collective timeout of its groups, seconds (0: not known)
    where: str = ""  # its main thread's place in the script, as last sampled


@functools.lru_cache(maxsize=1024)
def _description(raw: bytes) -> tuple[str, tuple[int, ...] | None]:
    """A slot's name and members (parsed once: a slot's description never changes)."""
    desc = json.loads(raw)
    members = None if desc.get("m") is None else tuple(int(r) for r in desc["m"])
    return str(desc["g"]), members


def parse(raw: bytes) -> PageView | None:
    """The page's contents, or None when it is not (yet) a page. A slot being written while it
    is read may show a mix of two moments: every rule reading it tolerates one stale word."""
    if len(raw) < SIZE:
        return None
    header = struct.unpack_from(f"<{HEADER}d", raw, 0)
    if header[H_MAGIC] != MAGIC or header[H_VERSION] != VERSION:
        return None
    used = min(int(header[H_SLOTS]), MAX_SLOTS)
    words = struct.unpack_from(f"<{used * SLOT}d", raw, HEADER * 8)
    slots = []
    for i in range(used):
        w = words[i * SLOT : (i + 1) * SLOT]
        if w[USED] != 1.0:
            continue
        try:
            name, members = _description(raw[DESC_AT + i * DESC : DESC_AT + (i + 1) * DESC].rstrip(b"\0"))
        except (ValueError, TypeError, KeyError):
            continue  # the description is being written: the slot is new, nothing to judge yet
        slots.append(
            SlotView(
                name,
                members,
                int(w[GENERATION]),
                int(w[ENTERED]),
                int(w[DONE]),
                w[T_ENTERED],
                w[T_PENDING],
                w[T_DONE],
                w[TYPICAL],
                int(w[P2P_ENTERED]),
                int(w[P2P_DONE]),
                w[T_P2P],
            )
        )
    where = raw[WHERE_AT : WHERE_AT + WHERE].split(b"\0", 1)[0].decode("utf-8", "replace")
    return PageView(
        int(header[H_PID]),
        int(header[H_RANK]),
        tuple(slots),
        header[H_SAVING],
        header[H_SAVED],
        int(header[H_MOVES]),
        header[H_TIMEOUT],
        where,
    )


def read(path: str) -> PageView | None:
    try:
        with open(path, "rb") as f:
            return parse(f.read(SIZE))
    except OSError:
        return None


def describe(name: str, members) -> bytes:
    """A slot's description, at most ``DESC`` bytes. A member list too long to fit is written as
    ``[]``: members unknown, and the culprit rule never judges such a group (taking it for the
    world would make its non-members look like ranks that never entered)."""
    raw = json.dumps({"g": name, "m": None if members is None else list(members)}).encode()
    if len(raw) > DESC:
        raw = json.dumps({"g": name[:64], "m": []}).encode()
    return raw


def encode_where(where: str) -> bytes:
    """``where`` as the page holds it: at most ``WHERE`` bytes, NUL-padded (a reader that finds
    it mid-write sees a mix of two places, never an overrun)."""
    raw = where.encode("utf-8", "replace")[: WHERE - 1]
    return raw + bytes(WHERE - len(raw))


def page_path(scratch: str, local_rank: int) -> str:
    """Where the agent whose scratch directory is ``scratch`` keeps local rank ``local_rank``'s page."""
    return os.path.join(scratch, f"collectives-{local_rank}")


def create(path: str) -> None:
    """An empty page at ``path`` (the writer fills the header)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, SIZE)
    finally:
        os.close(fd)
