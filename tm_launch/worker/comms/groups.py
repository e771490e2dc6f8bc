"""Process groups that survive substitution: one Python object whose communicator is swapped.

``LiveGroup`` is a ``torch.distributed.ProcessGroup`` subclass (the same extension point torchft
uses) that forwards every collective to an *inner* backend. DDP, FSDP and ``dist.*(group=...)``
hold the LiveGroup; a new generation swaps the inner gloo/NCCL group underneath them, so nothing
the user built is rebuilt. A communicator swapped out is given up through
``communicators.release`` (gloo: its connections shut down at once, whatever still holds the
communicator; NCCL: aborted and destroyed off the caller's thread).

A failed collective never raises into the training step. Python cannot catch an exception
raised in the body of ``for step in job.steps()``, so the group *poisons* the step instead: the
failure is recorded, later collectives of the failed communicator complete locally (other
communicators keep working, so healthy subgroups stay in step with their peers), the registered
optimizers skip their update, and the step boundary releases the failed communicator (closing
its sockets, so peers still blocked on this rank fail at once), recovers and re-runs the step.

``LocalBackend`` serves collectives inside a process (the sandbox): a spare runs real steps with
real kernels and allocations but sends nothing to the job, as if every peer held its own values.

Some groups never need a network communicator (``in_process_backend``): a group of one member,
whose collectives are exact when computed locally, and a group the script asks torch to make
"fake" (torchtitan's mesh dimensions of degree 1: torch builds no communicator for them). They
are served in the process for good: never rebuilt, released or guarded. Building each of them
as a gloo group cost a store rendezvous at start and again on every joiner, and a gloo thread
that wakes 100 times a second for nothing (torchtitan's 2-rank job: 10 of its 11 groups).
"""

from __future__ import annotations

import itertools
import threading
import time

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FakeProcessGroup, _create_work_from_future

from .. import phase_faults
from . import communicators
from . import telemetry as collective_telemetry

_names = itertools.count()


def unique_name(ranks) -> str:
    """A group's name in c10d's by-name registry, unique in this process."""
    members = "world" if ranks is None else "-".join(map(str, ranks))
    return f"tm-{next(_names)}-{members}"


def completed_work(result=None) -> dist.Work:
    fut = torch.futures.Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class StepPoison:
    """Shared by all groups of a job: the first collective failure of the current step.

    ``armed`` is true only while a step body runs: a step can be re-run, so a failure there is
    absorbed. Anywhere else (model set-up, a final barrier) there is nothing to re-run and a
    failed collective raises, exactly as it would without tm-launch."""

    def __init__(self):
        self.error: BaseException | None = None
        self.armed = False
        self.abandoned = False  # the poisoned step was left part-way: abandon()
        self._lock = threading.Lock()
        self._broken: list = []  # groups whose communicator failed and is not closed yet

    def set(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                # Without its traceback: the frames hold the failed collective's future, whose
                # work keeps gloo's connections open after the communicator is released, so a
                # peer blocked on this rank would wait for the collective timeout.
                self.error = error.with_traceback(None)

    @property
    def active(self) -> bool:
        return self.error is not None

    def clear(self) -> None:
        with self._lock:
            self.error = None
            self.abandoned = False

    def abandon(self) -> None:
        """This rank leaves the poisoned step part-way: an exception out of torch's pipeline
        schedule or a framework's step, raised on what a failed collective left, is dropped and
        the step runs again. The collectives it had left on groups the failure did not break
        never run, and a peer may wait for it in one (torchtitan's FSDP gradient reduction over
        a data-parallel pair the change keeps, inside the schedule's backward). At its boundary
        it then closes its subgroups, as a rank late to its boundary does
        (``Generations.follow``): that wait fails at once, and every member rebuilds them."""
        self.abandoned = True

    def note_broken(self, group) -> None:
        with self._lock:
            self._broken.append(group)

    def release_broken(self) -> None:
        """Close every failed communicator now (main thread). A peer may be blocked in that
        communicator waiting for this rank, while this rank goes on to a collective of a
        healthy group that needs the peer: only closing the failed one breaks the cycle
        (the peer fails at once and joins the interrupted step) before the collective timeout."""
        with self._lock:
            broken, self._broken = self._broken, []
        for group in broken:
            group.release_if_broken()


def _sums(args) -> bool:
    """Does this all-reduce sum? Its op comes in options (``AllreduceOptions.reduceOp``: what
    ``dist.all_reduce`` passes) or bare; none is torch's default, SUM."""
    for a in args:
        op = a if isinstance(a, dist.ReduceOp) else getattr(a, "reduceOp", None)
        if op is not None:
            return op == dist.ReduceOp.SUM
    return True


class LocalBackend:
    """Collectives of ``size`` identical replicas, computed in-process (sandbox warmup).

    ``keeps_own_objects``: a rank that already received its state and is setting up a
    framework's loop around it (``LiveJob.enter_before_loop``) keeps its own objects in a
    ``broadcast_object_list`` from another rank (set-up values such as a log directory, the
    same on every rank) instead of being refused (``torch_patches.refuse_rooted_objects_without_peers``)."""

    def __init__(self, rank: int, size: int, keeps_own_objects: bool = False):
        self._rank, self._size = rank, size
        self.keeps_own_objects = keeps_own_objects

    def allreduce(self, tensors, *args, **kwargs):
        if _sums(args):
            for t in tensors:
                t.mul_(self._size)
        return completed_work(tensors)

    def allreduce_coalesced(self, tensors, *args, **kwargs):
        return self.allreduce(tensors, *args)

    def broadcast(self, tensors, *args, **kwargs):
        return completed_work(tensors)

    def allgather(self, output_lists, input_tensors, *args, **kwargs):
        for outs, inp in zip(output_lists, input_tensors):
            for o in outs:
                o.copy_(inp)
        return completed_work(output_lists)

    def _allgather_base(self, output, inp, *args, **kwargs):
        output.copy_(inp.repeat(self._size, *([1] * (inp.dim() - 1))).view_as(output))
        return completed_work(output)

    def allgather_into_tensor_coalesced(self, outputs, inputs, *args, **kwargs):
        for o, i in zip(outputs, inputs):
            self._allgather_base(o, i)
        return completed_work(outputs)

    def reduce_scatter(self, outputs, input_lists, *args, **kwargs):
        for o, ins in zip(outputs, input_lists):
            o.copy_(ins[self._rank]).mul_(self._size)
        return completed_work(outputs)

    def _reduce_scatter_base(self, output, inp, *args, **kwargs):
        output.copy_(inp.chunk(self._size)[self._rank]).mul_(self._size)
        return completed_work(output)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, *args, **kwargs):
        for o, i in zip(outputs, inputs):
            self._reduce_scatter_base(o, i)
        return completed_work(outputs)

    def alltoall_base(self, output, inp, *args, **kwargs):
        piece = inp.chunk(self._size)[self._rank]  # every peer sends us its piece for this rank
        output.copy_(piece.repeat(self._size, *([1] * (inp.dim() - 1))).view_as(output))
        return completed_work(output)

    def barrier(self, *args, **kwargs):
        return completed_work(None)

    def reduce(self, tensors, *args, **kwargs):
        return self.allreduce(tensors, *args)

    def gather(self, output_lists, inputs, *args, **kwargs):
        return self.allgather(output_lists, inputs)

    def scatter(self, outputs, input_lists, *args, **kwargs):
        for o, ins in zip(outputs, input_lists):
            if ins:
                o.copy_(ins[self._rank])
        return completed_work(outputs)

    def allgather_coalesced(self, output_lists, input_tensors, *args, **kwargs):
        return self.allgather(output_lists, input_tensors)

    def alltoall(self, outputs, inputs, *args, **kwargs):
        for o in outputs:  # peer j sends its piece for this rank: identical replicas, ours
            o.copy_(inputs[self._rank])
        return completed_work(outputs)

    def send(self, *args, **kwargs):
        return completed_work(None)

    def recv(self, tensors, *args, **kwargs):
        for t in tensors:  # no peer sent anything: zeros, not uninitialised memory (an object's size)
            t.zero_()
        return completed_work(tensors)


FAKE_NAMES = ("fake", "cpu:fake,cuda:fake")  # what torch's registries say of a "fake" group


def asks_fake(backend) -> bool:
    """Did the script ask ``dist.new_group`` for torch's "fake" backend (no communication)?"""
    return backend is not None and str(backend).lower() == dist.Backend.FAKE


def in_process_backend(rank: int, size: int, backend=None):
    """The communicator of a group whose collectives never leave this process, or None where
    the group needs a network one: torch's own ``FakeProcessGroup`` where the script asked for
    the "fake" backend (what ``dist.new_group(backend="fake")`` builds, with its semantics), the
    exact local one for a group of one member."""
    if asks_fake(backend):
        return FakeProcessGroup._create_internal(rank, size)
    if size == 1:
        return LocalBackend(0, 1)
    return None


class LiveGroup(dist.ProcessGroup):
    """A process group whose membership is fixed in global ranks and whose communicator is not."""

    def __init__(
        self,
        ranks: tuple[int, ...] | None,
        rank: int,
        size: int,
        poison: StepPoison,
        name: str = "tm-world",
        backend: tuple[str, str] = ("gloo", "cpu:gloo"),
        store_key: str | None = None,
        in_process: bool = False,
    ):
        super().__init__(max(rank, 0), size)
        self.member_ranks = ranks  # None: the world group
        self.in_process = in_process  # served here for good (``in_process_backend``): never rebuilt
        self.store_key = store_key  # its communicators' name in a generation's store (Generations.build)
        self._rank, self._size = rank, size
        self._inner = None
        self._poison = poison
        self._name = name
        self.backend_name, self.backend_config = backend  # what torch's registries say (communicators.c10d_names)
        self.generation = -1
        self.last_submit = 0.0
        self.last_complete = 0.0
        self.broken = False  # a collective of this communicator failed: it is released at the boundary
        self._pending: list = []  # works handed out this step and not yet settled
        self._swap_lock = threading.Lock()  # the directive watcher aborts while the main thread swaps
        self._aborted = None  # the communicator abort_soon already handed to communicators.release

    # -- identity ----------------------------------------------------------------------------
    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:
        # Not "gloo": DDP's logger would then look up a registered gloo backend object; a name
        # of our own makes it skip that and treat the group as a custom backend.
        return "tm"

    @property
    def group_name(self) -> str:
        # torch keeps a group's name on its C++ backends, and this group has none: functional
        # collectives (DTensor, FSDP2, torch.compile) look the group up by this name instead.
        return self._name

    @property
    def group_desc(self) -> str:
        return self._name

    @property
    def inner(self):
        return self._inner

    def swap(self, inner, rank: int, size: int, generation: int, keep_old: bool = False) -> None:
        """Point this group at a new communicator. The old one is given up (its sockets close,
        its NCCL communicators are aborted) unless ``keep_old``: the caller holds it to use again."""
        with self._swap_lock:
            old, self._inner = self._inner, inner
            self._rank, self._size, self.generation = rank, size, generation
            self.broken = False
            self._pending.clear()
            aborted, self._aborted = self._aborted, None
        if not keep_old:
            _give_up(old, aborted)
        del old

    def fail(self, error: BaseException, generation: int | None = None) -> None:
        """A collective of this communicator (submitted in ``generation``) failed: poison the
        step, stop using the communicator. A collective of an earlier generation's communicator
        (abandoned when a peer died, failing once the others close theirs) says nothing about
        the current one: ignored.

        Reported on a backend's own thread (a future's callback), the communicator is closed at
        once on a thread of its own: a peer blocked in one of its collectives waiting for this
        rank then fails now, not when this rank's step reaches its next collective or its end.
        With the step's compute in between, a failure went around a ring of N ranks one such
        wait per rank (16 ranks: survivors entered the next generation over 350 ms instead of
        90). Not on the callback's thread: closing a gloo communicator joins its threads. The
        callback holds the generation, not the communicator, so that the communicator's last
        reference is never dropped on a backend thread."""
        if generation is not None and generation != self.generation:
            return  # a communicator this group already gave up: nothing of the current step
        self.broken = True
        self._poison.set(error)
        self._poison.note_broken(self)  # else closed by the main thread (not a gloo callback thread)
        if generation is not None and threading.current_thread() is not threading.main_thread():
            threading.Thread(target=self._release_failed, args=(generation,), name="tm-release-failed", daemon=True).start()

    def _release_failed(self, generation: int) -> None:
        """Close the communicator of ``generation`` if this group still uses it (the main thread
        may have moved on to a newer one meanwhile, which must not be touched)."""
        with self._swap_lock:
            if self.generation != generation or not self.broken or self._inner is None:
                return
            failed, self._inner = self._inner, None
            self._pending.clear()
            aborted, self._aborted = self._aborted, None
        _give_up(failed, aborted)

    def release(self) -> None:
        """Close the communicator now, healthy or not: this rank is leaving it for a new
        generation, and a peer still blocked in one of its collectives must fail at once rather
        than wait for this rank until the collective timeout (it would, while this rank waits
        for that peer in the new generation's setup). A group served in the process has no
        peer to free: it keeps its communicator."""
        if self.in_process:
            return
        with self._swap_lock:
            old, self._inner = self._inner, None
            self._pending.clear()
            aborted, self._aborted = self._aborted, None
        _give_up(old, aborted)

    def abort_soon(self, generation: int) -> bool:
        """Called by the directive watcher when generation ``generation`` changes this group's
        membership: give up its communicator now, off the main thread, so that a step waiting
        for a rank that is gone fails at once instead of when the dead process's sockets close
        (at the end of its exit, once the kernel freed its memory; never while a process it
        forked holds them) or at the collective timeout: gloo's connections are shut down, NCCL
        is aborted. Only a communicator of an older generation (the main thread may already
        have entered this one). The group keeps the object until the main thread swaps it out.
        True when something was ended."""
        with self._swap_lock:
            inner = self._inner
            if inner is None or inner is self._aborted or self.generation >= generation:
                return False
            if not communicators.release(inner):
                return False
            self._aborted = inner
            return True

    def release_if_broken(self) -> bool:
        """Close a failed communicator now (main thread, nothing in flight) so peers blocked on
        this rank get 'connection closed' instead of waiting for the collective timeout."""
        if not self.broken or self._inner is None:
            return False
        self.release()  # its connections shut down: peers blocked on this rank fail now
        return True

    def settle(self) -> None:
        """Wait for every collective this group handed out and the script did not wait for (a
        step may only be committed once all of its communication is known to have worked)."""
        pending, self._pending = self._pending, []
        for work in pending:
            try:
                work.wait()
            except Exception:  # already recorded as the step's poison by the guard
                pass

    # -- collectives (methods added below by _forward) ---------------------------------------
    def _call(self, name: str, result, args, kwargs):
        phase_faults.at_collective()  # tm-launch rehearse's ``after-step`` kill point (a no-op unless armed)
        self.last_submit = time.perf_counter()
        if self._poison.active:
            self._poison.release_broken()
        inner, generation = self._inner, self.generation  # one read: a failure's thread may close it
        if self.in_process and inner is not None:  # no peer can fail it: as torch would call it
            return _collective(inner, name)(*args, **kwargs)
        if self.broken or inner is None:
            # The step is poisoned (or this rank is not connected): serve it locally as if every
            # peer held this rank's values, so shapes stay right and object collectives unpickle.
            return getattr(LocalBackend(max(self._rank, 0), self._size), _local_name(name))(*args, **kwargs)
        collective = _collective(inner, name)
        local = isinstance(inner, LocalBackend)
        token = None if local else collective_telemetry.entered(self, name)  # the agent's culprit rule
        try:
            work = collective(*args, **kwargs)
        except Exception as e:  # a broken communicator can fail at submission time too
            collective_telemetry.completed(token)
            self.fail(e)
            if not self._poison.armed:
                raise
            return completed_work(result)
        if local:
            return work
        guarded = _guarded(work, self, result, generation, token)
        if self._poison.armed:
            self._pending.append(guarded)
        return guarded


# torch 2.13's ProcessGroup names some collectives differently from its backends (the communicator
# behind a LiveGroup may be either); FSDP2 calls the ProcessGroup names.
ALIASES = {
    "all_gather_single": "_allgather_base",
    "reduce_scatter_single": "_reduce_scatter_base",
    "all_to_all_single": "alltoall_base",
    "all_gather_single_coalesced": "allgather_into_tensor_coalesced",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
}
_LOCAL = {v: k for k, v in ALIASES.items()}


def _collective(inner, name: str):
    """Collective ``name`` (a ProcessGroup's name) of communicator ``inner``, under its own name."""
    return getattr(inner, name if hasattr(inner, name) else ALIASES.get(name, name))


def _local_name(name: str) -> str:
    return name if hasattr(LocalBackend, name) else ALIASES.get(name, _LOCAL.get(name, name))


COLLECTIVES = (
    "allreduce",
    "allreduce_coalesced",
    "broadcast",
    "allgather",
    "_allgather_base",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "reduce_scatter",
    "_reduce_scatter_base",
    "reduce_scatter_tensor_coalesced",
    "alltoall_base",
    "alltoall",
    "barrier",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    *ALIASES,
)


def outside_graphs(fn):
    """``fn`` runs eagerly, never traced by Dynamo: a graph break where a collective is issued.

    torch registers ``ProcessGroup`` as an opaque type for torch.compile (only ``rank``,
    ``size``, ``group_name`` ... may be read while tracing), and Dynamo compiles every Python
    frame that starts while a compiled function runs, the methods torch's C++ calls back into
    included (DDP's reducer broadcasting, a compiled graph's functional collective resolving the
    group by name and calling its ``allreduce``). A LiveGroup's methods read its own attributes,
    poison the step, start threads and keep telemetry: none of that can be a graph, and tracing
    it ended every rank at its first compiled step (``Member '_call' is not registered``). So the
    collective is issued eagerly, with its guard, where torch's own backend would be called; the
    graphs around it stay compiled (a functional collective in a graph still calls it)."""
    return torch.compiler.disable(fn, recursive=True)


def _forward(name: str):
    """A LiveGroup method that sends collective ``name`` to the current communicator."""

    def method(self, *args, **kwargs):
        first = args[0] if args else next(iter(kwargs.values()), None)
        return self._call(name, None if name == "barrier" else first, args, kwargs)

    method.__name__ = method.__qualname__ = name
    return method


for _name in COLLECTIVES:
    setattr(LiveGroup, _name, _forward(_name))


def keep_out_of_graphs() -> None:
    """Mark every LiveGroup method torch's C++ calls back into, and the guarded work's, as
    ``outside_graphs`` (once, in a live worker: it imports torch._dynamo, ~0.7 s, which DDP's
    constructor imports anyway; a process that only imports this module does not pay it)."""
    if getattr(LiveGroup, "_outside_graphs", False):
        return
    for name in (*COLLECTIVES, "rank", "size", "getBackendName"):  # the collectives and what C++ asks a group it holds
        setattr(LiveGroup, name, outside_graphs(vars(LiveGroup)[name]))
    for name in ("wait", "is_completed", "get_future"):  # called back by a compiled graph's wait_tensor
        setattr(_SettledWork, name, outside_graphs(vars(_SettledWork)[name]))
    LiveGroup._outside_graphs = True


class _SettledWork(dist.Work):
    """A work whose failure poisons the step instead of raising (for backends whose works have
    no future, e.g. gloo's reduce-scatter)."""

    def __init__(self, work: dist.Work, group: LiveGroup, result, generation: int, token=None):
        super().__init__()
        self._work, self._group, self._result, self._generation = work, group, result, generation
        self._waited = False
        self._token = token

    def wait(self, timeout=None) -> bool:
        # Once only: the script waits, then the commit settles every work of the step again,
        # and a second wait() on gloo's send/recv works blocks for another message.
        if self._waited:
            return True
        self._waited = True
        try:
            self._work.wait()
        except Exception as e:
            self._group.fail(e, self._generation)
            if not self._group._poison.armed:
                raise
        finally:
            self._group.last_complete = time.perf_counter()
            collective_telemetry.completed(self._token)
        return True

    def is_completed(self) -> bool:
        return self._waited or self._work.is_completed()

    def get_future(self):
        self.wait()
        fut = torch.futures.Future()
        fut.set_result(self._result)
        return fut


def _guarded(work: dist.Work, group: LiveGroup, result, generation: int, token=None) -> dist.Work:
    """A work that completes even when the real one fails; the failure poisons the step."""

    def settle(fut):
        group.last_complete = time.perf_counter()
        collective_telemetry.completed(token)
        try:
            fut.value()
        except Exception as e:
            group.fail(e, generation)
            if not group._poison.armed:
                raise  # outside a step: the caller's wait() raises, as in plain torch
        return result

    try:
        future = work.get_future()
    except RuntimeError:  # "Work::getFuture not implemented"
        return _SettledWork(work, group, result, generation, token)
    return _create_work_from_future(future.then(settle))


def _give_up(old, aborted) -> None:
    """A communicator this process leaves (``communicators.release``: gloo's connections shut
    down, NCCL aborted and destroyed off this thread; not twice when the watcher already did)."""
    if old is not None and old is not aborted:
        communicators.release(old)
