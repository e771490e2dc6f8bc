"""Process groups that survive substitution: one Python object whose communicator is swapped.

``LiveGroup`` is a ``torch.distributed.ProcessGroup`` subclass (the same extension point torchft
uses) that forwards every collective to an *inner* backend. DDP, FSDP and ``dist.*(group=...)``
hold the LiveGroup; a new generation swaps the inner gloo/NCCL group underneath them, so nothing
the user built is rebuilt.

A failed collective never raises into the training step. Python cannot catch an exception
raised in the body of ``for step in job.steps()``, so the group *poisons* the step instead: the
failure is recorded, this and every later collective of the step completes locally, the
registered optimizers skip their update, and the step boundary recovers and runs the step again.

``LocalBackend`` serves collectives inside a process (the sandbox): a spare runs real steps with
real kernels and allocations but sends nothing to the job, as if every peer held its own values.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future


def completed_work(result=None) -> dist.Work:
    fut = torch.futures.Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class StepPoison:
    """Shared by all groups of a job: the first collective failure of the current step."""

    def __init__(self):
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def set(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = error

    @property
    def active(self) -> bool:
        return self.error is not None

    def clear(self) -> None:
        with self._lock:
            self.error = None


def _op_name(args) -> str:
    for a in args:
        op = getattr(a, "reduceOp", None)
        if op is not None:
            return str(op)
    return "SUM"


class LocalBackend:
    """Collectives of ``size`` identical replicas, computed in-process (sandbox warmup)."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def allreduce(self, tensors, *args):
        if "SUM" in _op_name(args) and not any(isinstance(a, dist.ReduceOp) and a != dist.ReduceOp.SUM for a in args):
            for t in tensors:
                t.mul_(self._size)
        return completed_work(tensors)

    def allreduce_coalesced(self, tensors, *args):
        return self.allreduce(tensors, *args)

    def broadcast(self, tensors, *args):
        return completed_work(tensors)

    def allgather(self, output_lists, input_tensors, *args):
        for outs, inp in zip(output_lists, input_tensors):
            for o in outs:
                o.copy_(inp)
        return completed_work(output_lists)

    def _allgather_base(self, output, inp, *args):
        output.copy_(inp.repeat(self._size, *([1] * (inp.dim() - 1))).view_as(output))
        return completed_work(output)

    def allgather_into_tensor_coalesced(self, outputs, inputs, *args):
        for o, i in zip(outputs, inputs):
            self._allgather_base(o, i)
        return completed_work(outputs)

    def reduce_scatter(self, outputs, input_lists, *args):
        for o, ins in zip(outputs, input_lists):
            o.copy_(ins[self._rank]).mul_(self._size)
        return completed_work(outputs)

    def _reduce_scatter_base(self, output, inp, *args):
        output.copy_(inp.chunk(self._size)[self._rank]).mul_(self._size)
        return completed_work(output)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, *args):
        for o, i in zip(outputs, inputs):
            self._reduce_scatter_base(o, i)
        return completed_work(outputs)

    def alltoall_base(self, output, inp, *args):
        output.copy_(inp)
        return completed_work(output)

    def barrier(self, *args):
        return completed_work(None)

    def reduce(self, tensors, *args):
        return self.allreduce(tensors, *args)

    def gather(self, output_lists, inputs, *args):
        return self.allgather(output_lists, inputs)

    def scatter(self, outputs, input_lists, *args):
        for o, ins in zip(outputs, input_lists):
            if ins:
                o.copy_(ins[self._rank])
        return completed_work(outputs)

    def send(self, *args):
        return completed_work(None)

    def recv(self, *args):
        return completed_work(None)


class LiveGroup(dist.ProcessGroup):
    """A process group whose membership is fixed in global ranks and whose communicator is not."""

    def __init__(self, ranks: tuple[int, ...] | None, rank: int, size: int, poison: StepPoison, backend_name: str = "gloo"):
        super().__init__(max(rank, 0), size)
        self.member_ranks = ranks  # None: the world group
        self._rank, self._size = rank, size
        self._inner = None
        self._poison = poison
        self._backend_name = backend_name
        self.generation = -1

    # -- identity ----------------------------------------------------------------------------
    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:
        return self._backend_name

    @property
    def inner(self):
        return self._inner

    def swap(self, inner, rank: int, size: int, generation: int) -> None:
        """Point this group at a new communicator; the old one is released (its sockets close)."""
        old, self._inner = self._inner, inner
        self._rank, self._size, self.generation = rank, size, generation
        if old is not None and not isinstance(old, LocalBackend):
            _release(old)

    # -- collectives ---------------------------------------------------------------------------
    def _call(self, name: str, result, *args):
        if self._poison.active:
            return completed_work(result)
        try:
            work = getattr(self._inner, name)(*args)
        except Exception as e:  # a broken communicator can fail at submission time too
            self._poison.set(e)
            return completed_work(result)
        if isinstance(self._inner, LocalBackend):
            return work
        return _guarded(work, self._poison, result)

    def allreduce(self, tensors, *args):
        return self._call("allreduce", tensors, tensors, *args)

    def allreduce_coalesced(self, tensors, *args):
        return self._call("allreduce_coalesced", tensors, tensors, *args)

    def broadcast(self, tensors, *args):
        return self._call("broadcast", tensors, tensors, *args)

    def allgather(self, output_lists, input_tensors, *args):
        return self._call("allgather", output_lists, output_lists, input_tensors, *args)

    def _allgather_base(self, output, inp, *args):
        return self._call("_allgather_base", output, output, inp, *args)

    def allgather_into_tensor_coalesced(self, outputs, inputs, *args):
        return self._call("allgather_into_tensor_coalesced", outputs, outputs, inputs, *args)

    def reduce_scatter(self, outputs, input_lists, *args):
        return self._call("reduce_scatter", outputs, outputs, input_lists, *args)

    def _reduce_scatter_base(self, output, inp, *args):
        return self._call("_reduce_scatter_base", output, output, inp, *args)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, *args):
        return self._call("reduce_scatter_tensor_coalesced", outputs, outputs, inputs, *args)

    def alltoall_base(self, output, inp, *args):
        return self._call("alltoall_base", output, output, inp, *args)

    def barrier(self, *args):
        return self._call("barrier", None, *args)

    def reduce(self, tensors, *args):
        return self._call("reduce", tensors, tensors, *args)

    def gather(self, output_lists, inputs, *args):
        return self._call("gather", output_lists, output_lists, inputs, *args)

    def scatter(self, outputs, input_lists, *args):
        return self._call("scatter", outputs, outputs, input_lists, *args)

    def send(self, tensors, dst, tag=0):
        return self._call("send", tensors, tensors, dst, tag)

    def recv(self, tensors, src, tag=0):
        return self._call("recv", tensors, tensors, src, tag)


def _guarded(work: dist.Work, poison: StepPoison, result) -> dist.Work:
    """A work that completes even when the real one fails; the failure poisons the step."""

    def settle(fut):
        try:
            fut.value()
        except Exception as e:
            poison.set(e)
        return result

    return _create_work_from_future(work.get_future().then(settle))


def _release(backend) -> None:
    for method in ("shutdown", "abort"):
        fn = getattr(backend, method, None)
        if fn is None:
            continue
        try:
            fn()
            return
        except Exception:
            continue


def new_gloo(store: dist.Store, rank: int, size: int, timeout_s: float, hostname: str | None = None):
    """A gloo backend bootstrapped through ``store`` (a fresh PrefixStore per generation)."""
    import datetime

    from torch.distributed.distributed_c10d import ProcessGroupGloo

    opts = ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    opts._devices = [ProcessGroupGloo.create_device(hostname=hostname) if hostname else ProcessGroupGloo.create_default_device()]
    return ProcessGroupGloo(store, rank, size, opts)
