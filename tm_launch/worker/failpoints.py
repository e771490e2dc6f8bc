"""Named fault-injection points inside the runtime, for tests and the chaos soak.

A script can kill itself at any point of its own code, but not in the middle of the runtime's
commit vote; ``TM_FAILPOINT="<name>:<rank>:<step>[:<marker file>]"`` SIGKILLs the worker of
``<rank>`` when it reaches point ``<name>`` at the first step >= ``<step>``. With a marker file it
fires once per job, whichever process holds the rank (etcd's gofail, in spirit).

Points (the phases of the script's own step, ``forward`` ``backward`` ``optimizer`` ``after-step``, are in
``phase_faults``): ``vote`` (this rank's vote is counted, the decision not yet read), ``last-vote`` (the
same, when this vote completed the count: every other rank then waits for a decision that this
rank was to write), ``snapshot`` (the step's snapshot is taken and about to be sent to its
holder: the holder never gets it). A name ending in ``/node`` (``last-vote/node``) SIGKILLs the worker's agent
first: the whole node is lost at that point, as when a machine dies.
"""

from __future__ import annotations

import os
import signal


def reached(name: str, rank: int, step: int) -> None:
    spec = os.environ.get("TM_FAILPOINT")
    if not spec:
        return
    want, want_rank, want_step, marker = (spec.split(":", 3) + [""])[:4]
    point, _, scope = want.partition("/")
    if point != name or int(want_rank) != rank or step < int(want_step):
        return
    if scope == "node":
        # The marker first: once the agent is gone this worker may die (PDEATHSIG) before it
        # would write it, and the rank's next holder would be killed at the same point again.
        if marker and not _claim(marker):
            return
        print(f"[tm-launch] failpoint {want}: SIGKILL the agent of rank {rank} at step {step}", flush=True)
        os.kill(os.getppid(), signal.SIGKILL)
        marker = ""
    kill_once(marker or None, f"[tm-launch] failpoint {want}: SIGKILL rank {rank} at step {step}")


def _claim(marker: str) -> bool:
    """Create ``marker``; False when it already exists (the kill happened once already)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def kill_once(marker: str | None, message: str) -> None:
    """SIGKILL this process, saying ``message``; with ``marker`` (a file that records the kill)
    once per job, so the process that takes this rank's place does not die at the same point
    again (also used by the example scripts' fault injection, ``tests/scripts/faults.py``)."""
    if marker and not _claim(marker):
        return
    print(message, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
