"""``PlainJob``: the job API over a normal process group, for plain torchrun and tm-launch's
restart mode (``--no-live``: there it reports its steps to the agent, ``step_report``)."""

from __future__ import annotations

import atexit
import gc
import os

import torch.distributed as dist

from ..api import Job
from ..comms import telemetry
from ..state import data_loaders
from ..step_report import process_reporter
from . import optimizer_steps


class PlainJob(Job):
    in_sandbox = False
    step_ok = True
    generation = 0

    def __init__(self, backend: str | None, timeout=None):
        if not dist.is_initialized():  # None: torch's own default (gloo for CPU tensors, NCCL for CUDA)
            dist.init_process_group(backend=backend, timeout=timeout)
            atexit.register(_destroy_default_group)
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self._objects: dict = {}

    @property
    def group(self):
        """The default group (not held here: at exit it must be freed, see ``_destroy_default_group``)."""
        return dist.group.WORLD

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    def register(self, replicas=None, per_rank: bool = False, exclude=(), **objects) -> None:
        why = data_loaders.refuse_registered(objects)  # as in live mode: a script refused there is refused here
        if why:
            raise data_loaders.DataRefused(why)
        self._objects.update(objects)

    def data(self, loader) -> data_loaders.Batches:
        """``next()`` gives one batch per step, epochs run on (``state.data_loaders``)."""
        return data_loaders.Batches(loader, cached=False)

    def new_group(self, ranks, backend=None):
        return dist.new_group(list(ranks), backend=backend)

    def commit(self) -> bool:
        return True

    def checkpointing(self):
        return telemetry.checkpointing()

    def enter_before_loop(self) -> None:
        return None

    def steps(self, total: int, start: int = 0):
        optimizer_steps.the_script_reports()
        for step in range(start, total):
            yield step
            self.report_step(step + 1)
        self.end_loop()  # the steps ran out: finished

    def end_loop(self) -> None:
        """The loop ended as it should before ``steps()`` ran out (``LiveJob.end_loop``): the
        worker is finished (told to the agent under ``--no-live``; nothing under torchrun)."""
        reporter = process_reporter()
        if reporter is not None:
            reporter.finished()

    def report_step(self, step: int) -> None:
        """This worker finished step ``step`` (the global step count): told to the agent under
        ``tm-launch --no-live``, nothing under plain torchrun."""
        optimizer_steps.the_script_reports()
        reporter = process_reporter()
        if reporter is not None:
            reporter.step(step)


def _destroy_default_group() -> None:
    """At exit, the group ``PlainJob`` started, if the script did not destroy it: left to the
    interpreter's teardown, gloo's worker thread can reach for the GIL after finalization began,
    and Python 3.11 ends such a thread with a forced unwind that C++ turns into SIGABRT
    ("terminate called without an active exception"; 7 of 30 two-rank runs of a bare gloo
    script exited so here, none with the group destroyed first)."""
    if dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()  # the group's last holder may sit in a cycle: its destructor joins those threads now
