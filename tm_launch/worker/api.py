"""The job a training script holds: ``job = tm_launch.init()``. One interface, two implementations.

``LiveJob`` (``job.live``) under tm-launch's live mode: failures are repaired inside ``steps()``
while this process keeps running. ``PlainJob`` (``job.plain``) under plain torchrun and
tm-launch's restart mode (``--no-live``): ``init_process_group`` and ``range``. A script
written against this interface runs unchanged under both, which is what makes tm-launch a
drop-in: the fault-free torchrun run and the live run execute the same code. The README's
"live API" section lists exactly these members.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator

import torch.distributed as dist


class Job(abc.ABC):
    """What ``tm_launch.init()`` returns. Properties first, then the methods a loop calls."""

    local_rank: int  # this process's rank on its node (torchrun's LOCAL_RANK)

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This process's global rank (it may change only in a spare, before its first step)."""

    @property
    @abc.abstractmethod
    def world_size(self) -> int:
        """The number of ranks."""

    @property
    @abc.abstractmethod
    def group(self) -> dist.ProcessGroup:
        """The default (world) group: hand it to DDP/FSDP. Live, it stays the same object while
        the communicator behind it is replaced."""

    @property
    @abc.abstractmethod
    def generation(self) -> int:
        """How many times the job's membership changed (0 under plain torchrun)."""

    @property
    @abc.abstractmethod
    def in_sandbox(self) -> bool:
        """True while a spare warms up without peers: skip checkpoint loads and side effects."""

    @property
    @abc.abstractmethod
    def step_ok(self) -> bool:
        """False while the current step is interrupted (it runs again, or a collective after its
        commit failed): numbers computed in it are not final; do not log them."""

    @abc.abstractmethod
    def register(self, replicas=None, per_rank: bool = False, exclude=(), **objects) -> None:
        """Objects with ``state_dict()``/``load_state_dict()`` that a rank taking over this one
        must receive (model, optimizer, scheduler, ...); ``per_rank=True`` for state this rank
        alone advances (RNG, data position). What the script keeps and does not register (an
        EMA, a GradScaler, a second optimizer, the loop's plain variables) is found at the first
        step; ``exclude=[obj, ...]`` leaves such objects out."""

    @abc.abstractmethod
    def data(self, loader):
        """``batches = job.data(loader)``; ``next(batches)`` once per step: the same batch when a
        step runs again, the lost rank's epoch and position for a rank taking its place; tm-launch
        runs the epochs (``set_epoch``). A loader that cannot be made exact is refused."""

    @abc.abstractmethod
    def new_group(self, ranks, backend=None) -> dist.ProcessGroup:
        """A subgroup; ``dist.new_group`` and ``init_device_mesh`` work too."""

    @abc.abstractmethod
    def commit(self) -> bool:
        """Take the current step's job-wide vote now; True when the step committed (its numbers
        are final: ``if job.commit(): log(metrics)``)."""

    @abc.abstractmethod
    def steps(self, total: int, start: int = 0) -> Iterator[int]:
        """The steps to run, ``start`` to ``total - 1``; live, membership changes happen between
        them and an interrupted step is yielded again."""

    @abc.abstractmethod
    def end_loop(self) -> None:
        """The loop ended as it should before ``steps()`` ran out (a framework's own loop)."""

    @abc.abstractmethod
    def report_step(self, step: int) -> None:
        """Restart mode: a loop of its own finished global step ``step`` (the agent watches it)."""

    @abc.abstractmethod
    def checkpointing(self):
        """``with job.checkpointing(): torch.save(...)``: this rank is saving a checkpoint. A save
        can take minutes, often on one rank while its peers already wait in the next collective.
        Unmarked, the agent judges it by its progress (``health.progress``): a save that moves
        (CPU time, bytes written) is busy and waited for until the collective timeout; one stalled
        on a dead filesystem is stuck after ``collective_still_floor`` (6 s). Marked, neither
        happens before ``hang_checkpoint_timeout`` (900 s). The integrations (Lightning, HF,
        torchtitan) mark their saves themselves; outside a live tm-launch worker it does nothing."""

    @abc.abstractmethod
    def enter_before_loop(self) -> None:
        """For framework loops that resume from the state they receive: a spare enters the job
        here, before its loop runs (nothing to do outside live mode)."""
