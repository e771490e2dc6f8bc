"""The one place that builds a generation's communicator: gloo for CPU tensors, NCCL for CUDA.

``build`` returns a plain ``torch.distributed.ProcessGroup`` with one backend per device type,
the composite torch builds for ``init_process_group(backend="cpu:gloo,cuda:nccl")``: a
collective goes to the backend of its tensors' device (the c10d dispatcher picks it), so CPU
control traffic (step agreement, pickled state) and CUDA gradients share one group object.
The group is registered nowhere in ``torch.distributed``'s global state: it is reached only
through the ``LiveGroup`` that wraps it, and dropping the last reference releases it.

Every generation bootstraps on a fresh ``PrefixStore`` (reusing a prefix reads stale
addresses); each backend takes a sub-prefix of it (``cpu/``, ``cuda/``), as torch does.

Every pair of a gloo group is connected when it is built (gloo's full mesh, torch's default).
gloo's lazy mode (``TORCH_GLOO_LAZY_INIT=1``: pairs connect on first use, 2 connections per
rank instead of N - 1) can hang the process that gives up a failed communicator, so live mode
turns it off (``live_process_environment``). The cause, read in gloo's TCP transport and seen
in a worker's stack: when a collective fails on one pair (a dead peer), gloo frees the
operation's buffers while another pair may still hold an operation naming them; when the live
peer then sends data or asks for the send, that pair can neither read nor write it, and its
socket stays ready for ever, so gloo's event loop never goes idle. A lazy context's destructor
joins that loop before it closes its pairs, and waits for ever: the rank that dropped its
failed communicator hangs there with every socket of it open, and its peers wait on it until
the collective timeout. A full-mesh context closes its pairs first, the loop goes idle, and
the destructor returns. Where the world group's set-up would cost most (N - 1 connections per
rank), it runs off the critical path: a survivor builds the next world while it finishes the
interrupted step (``Generations.build_ahead_as_survivor``), a spare while it warms up.

Timeouts: joining may wait long (a joiner may still be warming up or starting cold), a
collective may not (a dead or hung peer must surface fast). gloo waits for its members (in its
constructor, which connects every pair) under the set-up timeout and is then switched to the
collective timeout. NCCL is created non-blocking (``config.blocking = 0``) and connected
eagerly; ``build`` returns once it is connected. The wait for a member is bounded by ``TORCH_NCCL_NONBLOCKING_TIMEOUT``
(set from the set-up timeout if the user did not set it); ``abort`` cannot cut it short (torch
holds the communicator's lock while it waits), so a set-up that waits for a member that will
never come is abandoned by leaving the thread that runs ``build``.  NCCL's collective timeout
(its watchdog) is the collective timeout.  Groups with NCCL are given up with ``release``
(abort and destruction off the caller's thread: an abort takes about a second).
"""

from __future__ import annotations

import datetime
import os
import threading
import time
import weakref

import torch
import torch.distributed as dist

from ... import settings
from ...protocol import nccl_error_handling
from . import connections, telemetry

GLOO = dist.ProcessGroup.BackendType.GLOO
NCCL = dist.ProcessGroup.BackendType.NCCL

# What live mode can serve: gloo carries CPU tensors (always: the runtime's own traffic, state
# agreement and pickled headers, is CPU), NCCL carries CUDA tensors.
LIVE_PAIRS = {"cpu": "gloo", "cuda": "nccl"}


def devices_for(backend: str | None, local_rank: int, cuda_count: int) -> tuple[str, ...]:
    """The devices a live job's groups serve, from ``tm_launch.init(backend=...)`` in torch's
    spellings: ``None`` (torch's default: NCCL too when CUDA is usable), ``"gloo"`` (no NCCL:
    gloo carries CUDA tensors too, through host memory, as torch's does), ``"nccl"``,
    ``"cuda:nccl"`` or ``"cpu:gloo,cuda:nccl"`` (CUDA tensors through NCCL; CPU tensors still
    through gloo, which the runtime itself needs). ``cuda_count``: the
    CUDA devices usable here with NCCL (0 on a CPU build or machine). Local rank i uses device
    i modulo the count, as torchrun's scripts do. Asking for NCCL where it cannot run, or for a
    pairing live mode does not build, raises, as ``init_process_group`` would: a job that
    silently ran its gradients through another backend would not be the job asked for."""
    spelled = "".join((backend or "undefined").split()).lower()
    if spelled == "undefined":
        wants_cuda = cuda_count > 0
    elif ":" in spelled:
        pairs = [item.split(":") for item in spelled.split(",")]
        if any(len(p) != 2 or LIVE_PAIRS.get(p[0]) != p[1] for p in pairs):
            raise ValueError(
                f"tm-launch live mode runs {','.join(f'{d}:{b}' for d, b in LIVE_PAIRS.items())}; "
                f"backend={backend!r} is not one of those pairings"
            )
        wants_cuda = any(dev == "cuda" for dev, _ in pairs)
    elif spelled in ("gloo", "nccl"):
        wants_cuda = spelled == "nccl"
    else:
        raise ValueError(f"tm-launch live mode runs gloo (CPU tensors) and nccl (CUDA tensors); backend={backend!r} is not supported")
    if not wants_cuda:
        return ("cpu",)
    if cuda_count <= 0:
        raise ValueError(f"backend={backend!r} asks for NCCL, but CUDA with NCCL is not usable in this process")
    return ("cpu", f"cuda:{local_rank % cuda_count}")


def usable_cuda_devices() -> int:
    """How many CUDA devices NCCL can use here (0 on a CPU build or machine)."""
    return torch.cuda.device_count() if torch.cuda.is_available() and dist.is_nccl_available() else 0


def job_devices(backend: str | None, local_rank: int) -> tuple[str, ...]:
    """``devices_for`` on this process's hardware."""
    return devices_for(backend, local_rank, usable_cuda_devices())


def c10d_names(devices, cuda_usable: bool | None = None) -> tuple[str, str]:
    """(backend name, backend config) for torch's group registries, as ``init_process_group``
    records them: what ``dist.get_backend(group)`` answers and what DeviceMesh reads to decide
    whether the world group can carry CUDA tensors. Without NCCL, gloo carries CUDA tensors
    too where CUDA is usable (``cuda_usable``; default: this process), as torch's gloo does."""
    if any(torch.device(d).type == "cuda" for d in devices):
        return ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl")
    if cuda_usable is None:
        cuda_usable = torch.cuda.is_available()
    return ("gloo", "cpu:gloo,cuda:gloo") if cuda_usable else ("gloo", "cpu:gloo")


def cuda_device(devices) -> torch.device | None:
    """The CUDA device among ``devices`` (strings or ``torch.device``), if CUDA is usable here."""
    for d in devices:
        d = torch.device(d)
        if d.type == "cuda":
            if not (torch.cuda.is_available() and dist.is_nccl_available()):
                return None
            return torch.device("cuda", d.index if d.index is not None else torch.cuda.current_device())
    return None


def gloo_devices(hostname: str | None) -> list:
    """The network devices a gloo communicator uses, by torch's own rule first: the interfaces
    named in ``GLOO_SOCKET_IFNAME`` (a comma list), as ``init_process_group("gloo")`` takes
    them, so a job pinned to one NIC under torchrun stays on it; else the node's address as its
    agent registered it (``--local-addr`` or torchrun's choice); else gloo's default (the
    address the host name resolves to). A name that is no interface here raises gloo's own
    error ("Unable to find address for: ...")."""
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    interfaces = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
    if interfaces:
        return [ProcessGroupGloo.create_device(interface=name) for name in interfaces]
    if hostname:
        return [ProcessGroupGloo.create_device(hostname=hostname)]
    return [ProcessGroupGloo.create_default_device()]


LAZY_GLOO = "TORCH_GLOO_LAZY_INIT"  # read by libtorch in each ProcessGroupGloo constructor
NCCL_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"  # read by each ProcessGroupNCCL constructor


def live_process_environment() -> str | None:
    """What torch reads when it builds a live worker's groups, set once when the worker starts
    live mode, before it starts threads (``setenv`` racing a C++ ``getenv`` on another thread
    can crash the process; measured here: setting it around each constructor, with ranks as
    threads, ended in a segmentation fault). Restart mode never calls it: a script's own
    ``init_process_group`` gets exactly torchrun's environment.

    - ``TORCH_NCCL_ASYNC_ERROR_HANDLING``: the live value (``protocol.nccl_error_handling``: a
      survivor of a failed NCCL collective must live on) in place of torchrun's 1.
    - ``TORCH_GLOO_LAZY_INIT``: off when the user turned it on (see the module's doc: a failed
      communicator's teardown can hang). Every gloo group of a live worker is tm-launch's own.

    Returns a line for the log when it overrode a value the user set, else None."""
    os.environ[NCCL_HANDLING] = nccl_error_handling(True, os.environ.get(NCCL_HANDLING))
    lazy = os.environ.get(LAZY_GLOO)
    if lazy is None or lazy.strip() in ("", "0"):
        return None
    os.environ[LAZY_GLOO] = "0"
    return (
        f"{LAZY_GLOO}={lazy} is turned off in live mode: gloo's lazy connection can hang the teardown of a failed "
        "communicator (tm-launch builds every group's full mesh, off the recovery's critical path)"
    )


def _gloo(store: dist.Store, rank: int, size: int, timeout_s: float, setup_timeout_s: float, hostname: str | None):
    """(the gloo backend, its connections: ``pair_sockets``)."""
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    mark = connections.Mark()  # before the devices: each one listens from its creation
    opts = ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=max(timeout_s, setup_timeout_s))
    opts._devices = gloo_devices(hostname)
    mine = _own_listeners(mark, len(opts._devices))
    store.append(_LISTENERS, _listener_text(mine))  # before the constructor: see _pair_sockets
    backend = ProcessGroupGloo(store, rank, size, opts)
    backend.set_timeout(datetime.timedelta(seconds=timeout_s))
    return backend, _pair_sockets(store, mark, mine, size, len(opts._devices))


# -- giving up a gloo communicator ------------------------------------------------------------
# gloo has no abort: its connections close when the context is destroyed, and a context lives
# as long as anything holds it: an unfinished work (one blocked on a peer holds it until the
# collective timeout), a future, a traceback. Two survivors each blocked on the other in an
# abandoned communicator then wait out the timeout (ZeroRedundancyOptimizer's parameter
# broadcasts, after a rank died with the step committed: one survivor's broadcast failed on
# the dead rank, the next one's waited on that survivor for 120 s). So the connections of each
# gloo communicator are found when it is built, and giving it up shuts them down (``release``):
# everything waiting on them fails now, on this rank and on the other end.

_LISTENERS = "tm-listeners"  # in the group's store: every member's listeners, appended
_pairs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> [(inode, fd)] of its gloo connections
_pairs_lock = threading.Lock()


def _own_listeners(mark, devices: int) -> set[tuple[str, int]]:
    """This rank's new gloo listeners (one per device, created since ``mark``); none where more
    appeared (another group built at the same time in this process) or none can be seen."""
    mine = {here for _, _, here, there in mark.new_sockets() if there is None}
    return mine if 0 < len(mine) <= devices else set()


def _listener_text(listeners) -> str:
    return "".join(f"{host}|{port};" for host, port in sorted(listeners)) or ";"


def _listeners_of(text: str) -> set[tuple[str, int]]:
    return {(host, int(port)) for host, _, port in (item.rpartition("|") for item in text.split(";") if item)}


def _pair_sockets(store, mark, mine, size: int, devices: int) -> list[tuple[int, int]]:
    """(inode, fd) of the connections of a gloo communicator just built (``mark``: before its
    devices and constructor, which connects every pair). A pair's socket was either accepted by
    one of this rank's new listeners (``mine``) or connected to a peer's. Every member appended
    its listeners to the group's store before its constructor, and a constructor returns only
    once every peer has connected, from inside its own constructor: so one read of that key now
    holds them all. Only gloo's own connections match, whatever other threads opened meanwhile.
    None where this process's sockets cannot be listed, or where what matched is not one
    connection per peer and device (another group built at the same time in this process, as
    ranks run as threads in tests): such a group closes its connections only when it is
    destroyed."""
    if not mine:
        return []
    peers = _listeners_of(store.get(_LISTENERS).decode()) - mine
    wildcard_ports = {port for host, port in peers if host in ("0.0.0.0", "::")}

    def is_pair(here, there) -> bool:
        return here in mine or there in peers or there[1] in wildcard_ports

    pairs = [(inode, fd) for inode, fd, here, there in mark.new_sockets() if there is not None and is_pair(here, there)]
    return pairs if len(pairs) == (size - 1) * devices else []  # else not only this rank's (ranks as threads)


def _track(pg, pairs) -> None:
    if pairs:
        with _pairs_lock:
            _pairs[pg] = pairs


def pair_sockets(pg) -> list[tuple[int, int]]:
    """(inode, fd) of ``pg``'s gloo connections as found when it was built (empty once given up)."""
    try:
        with _pairs_lock:
            return list(_pairs.get(pg, ()))
    except TypeError:  # not a group this module built
        return []


def _shut_down(pg) -> int:
    """Shut down ``pg``'s gloo connections, once: how many were still open."""
    try:
        with _pairs_lock:
            pairs = _pairs.pop(pg, ())
    except TypeError:  # not a group this module built
        return 0
    return sum(connections.shut_down(fd, inode) for inode, fd in pairs)


def _nccl_options(timeout_s: float, name: str):
    from torch.distributed.distributed_c10d import ProcessGroupNCCL

    opts = ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = False
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    opts.config.blocking = 0  # init returns at once; abort() can end a set-up stuck on a dead peer
    opts.group_name = name
    return opts


def _nccl(store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float, setup_timeout_s: float, name: str):
    from torch.distributed.distributed_c10d import ProcessGroupNCCL

    # Read once per process by torch, at the first non-blocking wait: bound it by the set-up
    # timeout unless the user chose a value.
    os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(max(1, int(setup_timeout_s))))
    backend = ProcessGroupNCCL(store, rank, size, _nccl_options(timeout_s, name))
    backend.eager_connect_single_device(device)  # starts NCCL's bootstrap now, in the background
    # Enqueueing a collective waits (on this host thread) until the communicator is connected,
    # so build() returns a group that is ready, like gloo. The runtime runs build() in a thread
    # it can walk away from: abort() cannot interrupt this wait (see abort).
    backend.allreduce([torch.zeros(1, device=device)])
    return backend


def _assemble(store: dist.Store, rank: int, size: int, gloo, nccl, device, name: str) -> dist.ProcessGroup:
    pg = dist.ProcessGroup(store, rank, size)
    pg._register_backend(torch.device("cpu"), GLOO, gloo)
    if nccl is not None:
        pg._register_backend(torch.device("cuda"), NCCL, nccl)
        pg._set_default_backend(NCCL)
        pg.bound_device_id = device
    else:
        if torch.cuda.is_available():
            # As init_process_group("gloo") does: gloo stages CUDA tensors through host memory
            # (two ranks sharing one GPU, which NCCL refuses). Without this, a CUDA tensor
            # finds no backend ("No backend type associated with device type cuda": DDP's
            # first call, seen on an H100).
            pg._register_backend(torch.device("cuda"), GLOO, gloo)
        pg._set_default_backend(GLOO)
    pg._set_group_name(name)
    return pg


def build(
    store: dist.Store, rank: int, size: int, *, devices, timeout_s: float, setup_timeout_s: float, hostname: str | None = None
) -> dist.ProcessGroup:
    """A communicator for ``size`` ranks bootstrapped through ``store`` (a fresh PrefixStore of
    this generation): gloo always, NCCL too when ``devices`` names a CUDA device and CUDA is
    usable. Blocks until every member is there (at most ``setup_timeout_s``). ``timeout_s`` 0:
    each backend's own default, as under torchrun (``settings.collective_timeout``); the one the
    job's collectives run under goes on the rank's page, for the agent's busy limit."""
    name = f"tm-{id(store):x}-r{rank}"
    gloo_timeout = settings.collective_timeout(timeout_s, "gloo")
    gloo, pairs = _gloo(dist.PrefixStore("cpu/", store), rank, size, gloo_timeout, setup_timeout_s, hostname)
    device = cuda_device(devices)
    nccl = None
    if device is not None:
        nccl_timeout = settings.collective_timeout(timeout_s, "nccl")
        nccl = _nccl(dist.PrefixStore("cuda/", store), rank, size, device, nccl_timeout, setup_timeout_s, name)
    telemetry.collective_timeout(gloo_timeout if nccl is None else nccl_timeout)
    pg = _assemble(store, rank, size, gloo, nccl, device, name)
    _track(pg, pairs)
    return pg


def nccl_backend(pg):
    """The group's NCCL backend, or None (a gloo-only group, gloo serving CUDA tensors too, or
    any other object)."""
    if not isinstance(pg, dist.ProcessGroup):
        return None
    try:
        backend = pg._get_backend(torch.device("cuda"))
    except RuntimeError:  # no backend registered for CUDA
        return None
    nccl = getattr(dist, "ProcessGroupNCCL", None)  # absent from builds without NCCL
    return backend if nccl is not None and isinstance(backend, nccl) else None


def nccl_device(pg) -> torch.device | None:
    """The CUDA device the group's NCCL communicator is bound to, or None (no NCCL)."""
    return pg.bound_device_id if nccl_backend(pg) is not None else None


def abort(pg) -> bool:
    """Abort every NCCL communicator of ``pg``: its pending and future CUDA collectives fail
    instead of waiting for a peer. Takes about a second (see ``release``).

    Safe from a thread that does not wait on the GPU (a watchdog or the directive watcher).
    It cannot interrupt a thread that is waiting for a non-blocking set-up to finish: torch
    holds the communicator's lock during that wait, so abort() waits too, until the set-up
    ends or ``TORCH_NCCL_NONBLOCKING_TIMEOUT`` (= the set-up timeout here) passes (measured on
    torch 2.11: a member that never joined held both for the whole timeout). So a set-up is
    abandoned by walking away from the thread that runs ``build`` (the runtime does), not by
    aborting it. gloo-only groups: nothing to abort (gloo's sockets close when the last
    reference to the group goes); returns False."""
    nccl = nccl_backend(pg)
    if nccl is None:
        return False
    nccl.abort()
    return True


_releasing: list[threading.Thread] = []
_releasing_lock = threading.Lock()


def release(pg) -> bool:
    """Give up a group, from any thread. Its gloo connections are shut down at once (see
    above): every collective waiting on them fails now, here and at the other ends. Its NCCL
    communicators are aborted and the group destroyed on a thread of its own, because
    ``ProcessGroupNCCL.abort()`` takes about a second (measured: 1.00 s per group on an H100,
    torch 2.11 / NCCL 2.28.9, monitoring on or off) and would sit on the recovery path. The
    caller drops its own references right away (for NCCL the thread's is then the last one, and
    the destructor, ~5 ms after an abort, runs there too), or, from a thread that must not touch
    the group's owner (the directive watcher, while the main thread may be inside one of its
    collectives), leaves the object to its owner, whose later drop destroys it
    (``LiveGroup.abort_soon``). Returns whether it ended anything (False for a group given up
    before, or any other object)."""
    shut = _shut_down(pg) > 0
    if nccl_backend(pg) is None:
        return shut

    def reap(box=[pg]):  # noqa: B006 -- the thread's own reference, dropped after the abort
        abort(box[0])
        box.clear()

    t = threading.Thread(target=reap, name="tm-comm-release", daemon=True)
    with _releasing_lock:
        _releasing[:] = [r for r in _releasing if r.is_alive()] + [t]
    t.start()
    return True


def wait_released(timeout_s: float = 30.0) -> bool:
    """Wait for groups handed to ``release`` to be gone (before the process exits: an NCCL
    group torn down by interpreter shutdown aborts the process). True when none is left."""
    deadline = time.monotonic() + timeout_s
    with _releasing_lock:
        pending = list(_releasing)
    for t in pending:
        t.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in pending)


def shrink(
    pg: dist.ProcessGroup, exclude: list[int], store: dist.Store, *, timeout_s: float, setup_timeout_s: float, hostname: str | None = None
) -> dist.ProcessGroup:
    """``pg`` without the ranks ``exclude`` (group ranks), for a group that only loses members;
    survivors keep their order, so rank r becomes r minus the excluded ranks below it. Only
    survivors call it. ``store`` is a fresh prefix for this generation.

    NCCL: ``ncclCommShrink`` (NCCL >= 2.27, torch's ``Backend.shrink``) with in-flight work of
    the old communicator aborted; it reuses the survivors' connections instead of
    bootstrapping from scratch. Where the backend cannot shrink, NCCL is rebuilt. gloo cannot
    shrink: it is rebuilt (milliseconds). The old group is left to the caller to drop."""
    from torch.distributed.distributed_c10d import SHRINK_ABORT

    gone = sorted(set(exclude))
    rank, size = pg.rank(), pg.size()
    if rank in gone or not gone or gone[0] < 0 or gone[-1] >= size or len(gone) >= size:
        raise ValueError(f"cannot exclude {gone} from a group of {size} as rank {rank}")
    new_rank, new_size = rank - sum(1 for g in gone if g < rank), size - len(gone)
    name = f"tm-{id(store):x}-r{new_rank}"
    gloo, pairs = _gloo(dist.PrefixStore("cpu/", store), new_rank, new_size, timeout_s, setup_timeout_s, hostname)
    old = nccl_backend(pg)
    nccl = device = None
    if old is not None:
        device = pg.bound_device_id
        if getattr(old, "supports_shrinking", False):
            nccl = old.shrink(gone, SHRINK_ABORT, _nccl_options(timeout_s, name))
        else:
            nccl = _nccl(dist.PrefixStore("cuda/", store), new_rank, new_size, device, timeout_s, setup_timeout_s, name)
    shrunk = _assemble(store, new_rank, new_size, gloo, nccl, device, name)
    _track(shrunk, pairs)
    return shrunk
