"""Fault injection for the example scripts: a real SIGKILL of this worker at one point of a step.

    --kill-rank R --kill-step S --kill-phase PHASE [--kill-trigger FILE] [--kill-marker FILE]

PHASE is a point of a step: ``forward``, ``backward`` (inside the backward pass, mid gradient
communication for DDP/FSDP), ``vote`` (inside tm-launch's commit vote: its vote counted, the
decision not read), ``last-vote-node`` (its vote completed the count and the whole node dies:
agent and workers, while the other ranks wait for the decision), ``snapshot`` / ``snapshot-node``
(the step's snapshot taken, not yet on its holder: the worker, or its whole node, dies while
the snapshot is on its way), ``optimizer`` (after the commit, before the update), ``logging`` (after the
update, before the loss all-reduce) or ``logged`` (after it); a script may add points of its own
(``tests/scripts/train.py``: ``allreduce`` inside DDP's gradient allreduce, ``checkpoint`` mid-write). With ``--kill-trigger`` the kill
waits for that file (at the first step >= S); with ``--kill-marker`` it happens once per job,
whichever process holds rank R by then.
"""

from __future__ import annotations

import os
import time

PHASES = [
    "forward",
    "backward",
    "allreduce",
    "vote",
    "last-vote-node",
    "snapshot",
    "snapshot-node",
    "optimizer",
    "logging",
    "logged",
    "checkpoint",
]
# phase -> tm_launch.worker.failpoints point (inside the runtime: the commit vote, the snapshot's send)
RUNTIME_POINTS = {"vote": "vote", "last-vote-node": "last-vote/node", "snapshot": "snapshot", "snapshot-node": "snapshot/node"}


def kill_once(marker: str | None, rank: int, where: str) -> None:
    """SIGKILL this process; with ``marker`` once per job (``tm_launch.worker.failpoints.kill_once``)."""
    from tm_launch.worker.failpoints import kill_once as kill

    kill(marker, f"[faults] rank {rank}: SIGKILL myself at {where}")


class Faults:
    @staticmethod
    def add_arguments(p) -> None:
        p.add_argument("--kill-rank", type=int, default=-1)
        p.add_argument("--kill-step", type=int, default=-1)
        p.add_argument("--kill-phase", default="forward", choices=PHASES)
        p.add_argument("--kill-trigger", default=None, help="kill only once this file exists (at the first step >= --kill-step)")
        p.add_argument("--kill-marker", default=None, help="file that records the kill happened (kill once)")
        p.add_argument("--pause-step", type=int, default=-1, help="every rank waits at this step until --pause-file exists")
        p.add_argument("--pause-file", default=None)

    def __init__(self, args):
        self.args = args
        self.step: int | None = None
        point = RUNTIME_POINTS.get(args.kill_phase)
        if point and args.kill_rank >= 0:  # a point inside the runtime (tm_launch.worker.failpoints)
            os.environ["TM_FAILPOINT"] = f"{point}:{args.kill_rank}:{args.kill_step}:{args.kill_marker or ''}"

    def at(self, job, phase: str) -> None:
        """SIGKILL this worker if it holds the armed rank and reached the armed point; the pause
        (every rank holds at --pause-step until --pause-file exists) happens at ``forward``."""
        a, step = self.args, self.step
        if job.in_sandbox or step is None:
            return
        if phase == "forward" and step == a.pause_step and a.pause_file:
            while not os.path.exists(a.pause_file):
                time.sleep(0.02)
        if job.rank != a.kill_rank or phase != a.kill_phase:
            return
        if a.kill_trigger:
            if step < a.kill_step or not os.path.exists(a.kill_trigger):
                return
        elif step != a.kill_step:
            return
        kill_once(a.kill_marker, job.rank, f"step {step} ({phase})")

    def arm_backward(self, model, job) -> None:
        """The ``backward`` point: when the backward pass reaches the model's first layer, the
        later layers' gradient communication (DDP buckets, FSDP reduce-scatters) is under way."""
        first = next(m for m in model.modules() if any(True for _ in m.parameters(recurse=False)))
        first.register_full_backward_pre_hook(lambda module, grad_output: self.at(job, "backward"))

    @staticmethod
    def log_step(path: str, job, step: int) -> None:
        with open(path, "a") as f:
            f.write(f"{time.time():.6f} {job.rank} {step} {getattr(job, 'generation', 0)} {os.getpid()}\n")
