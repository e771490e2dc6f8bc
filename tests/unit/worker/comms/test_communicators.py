"""tm_launch.worker.comms.communicators: real gloo groups on a real TCPStore (ranks are threads: gloo and
NCCL release the GIL while they connect and reduce); the CUDA branches run where CUDA is."""

import datetime
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest
import torch
import torch.distributed as dist

from tm_launch.protocol import nccl_error_handling
from tm_launch.worker.comms import communicators
from tm_launch.worker.comms.groups import LiveGroup, StepPoison

HAS_CUDA = torch.cuda.is_available() and dist.is_nccl_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and NCCL (this is a CPU build or machine)")


@pytest.fixture(autouse=True)
def live_nccl_error_handling(monkeypatch):
    """What the agent gives live workers (read by each ProcessGroupNCCL at construction): an
    aborted or failed communicator must not take this test process down with it. Per test, not
    at import: the whole suite's later launches (torchrun's environment) must not inherit it."""
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", nccl_error_handling(True, None))


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
    yield master


def prefix(store, gen: str):
    """``for_rank() -> PrefixStore``: one fresh prefix, each caller on its own client (a TCPStore
    client blocked in wait() on one thread would block another thread's set())."""
    name = f"tm/{gen}/{uuid.uuid4().hex[:6]}/"
    return lambda: dist.PrefixStore(name, store.clone())


def on_ranks(size: int, fn, ranks=None):
    """Run ``fn(rank)`` for every rank in its own thread; results by rank, errors re-raised."""
    results, errors = {}, {}

    def run(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 -- re-raised below
            errors[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in (ranks if ranks is not None else range(size))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise next(iter(errors.values()))
    return results


def build_all(store, size, **kw):
    kw.setdefault("timeout_s", 10)
    kw.setdefault("setup_timeout_s", 30)
    kw.setdefault("devices", ["cpu"])
    p = prefix(store, "g")
    return on_ranks(size, lambda r: communicators.build(p(), r, size, **kw))


def test_gloo_only_group_routes_cpu_tensors_and_has_nothing_to_abort(store):
    pgs = build_all(store, 3, hostname="127.0.0.1")

    def step(r):
        pg = pgs[r]
        assert isinstance(pg, dist.ProcessGroup) and (pg.rank(), pg.size()) == (r, 3)
        assert communicators.nccl_backend(pg) is None and communicators.abort(pg) is False
        t = torch.tensor([float(r + 1)])
        pg.allreduce([t]).wait()
        out = [torch.zeros(1) for _ in range(3)]
        pg.allgather([out], [torch.tensor([float(r)])]).wait()
        return t.item(), [o.item() for o in out]

    assert all(v == (6.0, [0.0, 1.0, 2.0]) for v in on_ranks(3, step).values())


def test_cuda_requested_without_cuda_is_gloo_only(store):
    if HAS_CUDA:
        pytest.skip("CUDA is present: the gloo-only fallback does not apply")
    assert communicators.cuda_device(["cpu", "cuda:0"]) is None
    assert communicators.job_devices(None, 3) == ("cpu",)
    pg = build_all(store, 1, devices=["cpu", "cuda:0"])[0]
    assert communicators.nccl_backend(pg) is None


def test_setup_waits_long_then_collectives_time_out_fast(store):
    # Set-up: a member that never comes ends the wait at the set-up timeout, not before.
    t0 = time.monotonic()
    with pytest.raises(Exception):
        communicators.build(prefix(store, "g1")(), 0, 2, devices=["cpu"], timeout_s=0.5, setup_timeout_s=2)
    assert 1.5 < time.monotonic() - t0 < 15
    # Connected: a peer that does not take part fails the collective at the collective timeout.
    pgs = build_all(store, 2, timeout_s=1, setup_timeout_s=60)
    t0 = time.monotonic()
    with pytest.raises(Exception):
        pgs[0].allreduce([torch.ones(1)]).wait()
    assert time.monotonic() - t0 < 10


def test_each_generation_on_a_fresh_prefix_reinits_in_the_same_processes(store):
    for gen in range(3):
        pgs = build_all(store, 2)

        def step(r, pgs=pgs, gen=gen):
            t = torch.tensor([float(gen + r)])
            pgs[r].allreduce([t]).wait()
            return t.item()

        assert on_ranks(2, step) == {0: 2.0 * gen + 1, 1: 2.0 * gen + 1}
        del pgs, step


def test_shrink_without_nccl_rebuilds_and_renumbers_survivors(store):
    pgs = build_all(store, 3)
    p = prefix(store, "shrunk")

    def survive(r):
        new = communicators.shrink(pgs[r], [1], p(), timeout_s=10, setup_timeout_s=30)
        t = torch.tensor([float(r)])
        new.allreduce([t]).wait()
        return new.rank(), new.size(), t.item()

    assert on_ranks(3, survive, ranks=[0, 2]) == {0: (0, 2, 2.0), 2: (1, 2, 2.0)}
    with pytest.raises(ValueError):
        communicators.shrink(pgs[1], [1], p(), timeout_s=1, setup_timeout_s=1)


def test_live_group_forwards_to_the_composite_group(store):
    """LiveGroup's forwarding works on top of the group ``build`` returns."""
    p = prefix(store, "live")

    def step(r):
        group = LiveGroup(None, r, 2, StepPoison())
        group.swap(communicators.build(p(), r, 2, devices=["cpu"], timeout_s=10, setup_timeout_s=30), r, 2, 0)
        t = torch.tensor([1.0, float(r)])
        dist.all_reduce(t, group=group)
        b = torch.tensor([float(r)])
        dist.broadcast(b, group_src=1, group=group)
        out = [torch.zeros(2) for _ in range(2)]
        dist.all_gather(out, torch.tensor([float(r), 9.0]), group=group)
        return (t.tolist(), b.item(), [o.tolist() for o in out]), group

    got = on_ranks(2, step)
    assert {r: v for r, (v, _) in got.items()} == {r: ([2.0, 1.0], 1.0, [[0.0, 9.0], [1.0, 9.0]]) for r in (0, 1)}
    # Released here, on the main thread: a collective's completion callback holds its
    # LiveGroup, and if gloo's own worker thread dropped the last reference to a group that
    # still held its communicator, the communicator's destructor would join that thread from
    # itself (std::terminate, "Resource deadlock avoided"; seen with short-lived LiveGroups in
    # this test even after a `del` here, which a callback still running can outlive; not in
    # the runtime, whose LiveGroups live as long as the job and release on exit, as here).
    for _, group in got.values():
        group.release()


@pytest.mark.parametrize(
    "backend, local_rank, cuda_count, want",
    [
        (None, 0, 0, ("cpu",)),  # a CPU machine or build: gloo only, as before
        (None, 3, 8, ("cpu", "cuda:3")),  # torch's default: NCCL whenever CUDA is usable
        (None, 9, 8, ("cpu", "cuda:1")),  # local rank i on visible device i modulo the count
        ("gloo", 0, 0, ("cpu",)),
        ("gloo", 2, 8, ("cpu",)),  # asked for: no NCCL, even with GPUs (gloo stages CUDA tensors)
        ("GLOO", 0, 8, ("cpu",)),  # torch lowercases
        ("nccl", 2, 8, ("cpu", "cuda:2")),  # gloo still carries CPU tensors (the runtime's own)
        ("cuda:nccl", 1, 2, ("cpu", "cuda:1")),
        ("cpu:gloo,cuda:nccl", 5, 4, ("cpu", "cuda:1")),
        ("cuda:nccl, cpu:gloo", 0, 1, ("cpu", "cuda:0")),
        ("cpu:gloo", 0, 8, ("cpu",)),
        ("undefined", 0, 2, ("cpu", "cuda:0")),
        ("nccl", 0, 0, ValueError),  # NCCL where it cannot run: loud, as init_process_group
        ("cpu:gloo,cuda:nccl", 0, 0, ValueError),
        ("mpi", 0, 8, ValueError),
        ("ucc", 0, 8, ValueError),
        ("cuda:gloo", 0, 8, ValueError),  # not a pairing live mode builds
        ("cpu:nccl", 0, 8, ValueError),
        ("cpu:gloo,cuda", 0, 8, ValueError),
    ],
)
def test_devices_follow_the_scripts_backend(backend, local_rank, cuda_count, want):
    if want is ValueError:
        with pytest.raises(ValueError):
            communicators.devices_for(backend, local_rank, cuda_count)
    else:
        assert communicators.devices_for(backend, local_rank, cuda_count) == want


@pytest.mark.parametrize(
    "devices, cuda_usable, want",
    [
        (("cpu",), False, ("gloo", "cpu:gloo")),  # what the registries said before NCCL existed here
        (("cpu",), True, ("gloo", "cpu:gloo,cuda:gloo")),  # gloo asked for on a GPU machine, as torch says
        (("cpu", "cuda:1"), True, ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl")),
    ],
)
def test_registry_names_follow_the_devices(devices, cuda_usable, want):
    assert communicators.c10d_names(devices, cuda_usable) == want


def test_this_machine_keeps_gloo_only_groups():
    """The live runtime's choice on this machine: on a CPU build exactly what it was before."""
    if HAS_CUDA:
        pytest.skip("CUDA is present: the job's default devices include a GPU")
    assert communicators.job_devices(None, 0) == ("cpu",)
    assert communicators.job_devices("gloo", 1) == ("cpu",)
    with pytest.raises(ValueError, match="not usable"):
        communicators.job_devices("nccl", 0)


class Comm:
    """A communicator stand-in: what the live group hands to ``communicators.release``."""


@pytest.fixture
def released(monkeypatch):
    """Record what is given up, as if every communicator had NCCL (release returns True)."""
    got = []
    monkeypatch.setattr(communicators, "release", lambda pg: got.append(pg) or isinstance(pg, Comm))
    return got


def test_a_swapped_out_communicator_is_released_once(released):
    group = LiveGroup(None, 0, 2, StepPoison())
    a, b, c = Comm(), Comm(), Comm()
    group.swap(a, 0, 2, 1)
    group.swap(b, 0, 2, 2)
    assert released == [a]
    group.swap(c, 0, 2, 3, keep_old=True)  # parked by the caller, to be used again
    assert released == [a]
    group.release()
    assert released == [a, c] and group.inner is None


def test_the_watcher_aborts_only_older_generations_and_only_once(released):
    group = LiveGroup((0, 1), 0, 2, StepPoison())
    old, new = Comm(), Comm()
    group.swap(old, 0, 2, 4)
    released.clear()
    assert group.abort_soon(5) is True and released == [old]  # generation 5 changes it
    assert group.abort_soon(5) is False and released == [old]  # not twice
    assert group.inner is old  # the main thread still owns it until it swaps
    group.swap(new, 0, 2, 5)
    assert released == [old]  # already aborted: not handed over again
    assert group.abort_soon(5) is False  # the main thread entered 5 first: its communicator stays
    assert released == [old]
    group.broken = True
    assert group.release_if_broken() is True and released == [old, new]


def test_a_failure_reported_off_the_main_thread_closes_that_generations_communicator_only(released):
    group = LiveGroup(None, 0, 2, StepPoison())
    old, new = Comm(), Comm()
    group.swap(old, 0, 2, 1)
    released.clear()
    on_ranks(1, lambda _: group.fail(RuntimeError("peer gone"), 1))  # a backend's callback thread
    deadline = time.monotonic() + 10
    while group.inner is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert group.inner is None and released == [old] and group._poison.active  # closed on a thread of its own
    group._poison.clear()
    group.swap(new, 0, 2, 2)
    on_ranks(1, lambda _: group.fail(RuntimeError("generation 1's collective failed late"), 1))
    time.sleep(0.2)
    assert group.inner is new and not group.broken and not group._poison.active and released == [old]


def test_a_failed_collective_closes_its_communicator_before_the_step_goes_on(store):
    """4 ranks all-reduce around a ring and rank 3's communicator closes (its process died). Its
    ring neighbours 0 and 2 fail at once; rank 1, whose neighbours are 0 and 2, only fails when
    they close theirs. They do, from the failure's callback: rank 1 fails while 0 and 2 are still
    in their step's compute (which waits for it, or 15 s), not once they reach their next
    collective or the end of the step (20 s here: the collective timeout)."""
    p = prefix(store, "fail")
    groups = on_ranks(4, lambda r: LiveGroup(None, r, 4, StepPoison()))
    pgs = on_ranks(4, lambda r: communicators.build(p(), r, 4, devices=["cpu"], timeout_s=20, setup_timeout_s=30))
    for r, g in groups.items():
        g.swap(pgs[r], r, 4, 0)
    del pgs
    rank1_failed = threading.Event()

    def step(r):
        group = groups[r]
        if r == 3:
            time.sleep(0.5)
            group.release()  # this rank's process is gone: its sockets close
            return None
        group._poison.armed = True
        group.allreduce([torch.ones(1 << 12)]).wait()  # guarded: completes, failed or not
        if r == 1:
            rank1_failed.set()
            return group._poison.active
        computing = not rank1_failed.wait(15)  # the rest of the step, before any collective
        return group._poison.active, computing

    got = on_ranks(4, step, ranks=[3, 0, 2, 1])
    assert got[1] is True, "rank 1's collective did not fail"
    assert got[0] == (True, False) and got[2] == (True, False), got  # rank 1 failed while they computed
    for group in groups.values():  # on the main thread (see test_live_group_forwards_to_the_composite_group)
        group.release()


def test_gloo_groups_are_not_aborted_by_the_watcher(store):
    group = LiveGroup(None, 0, 1, StepPoison())
    pg = communicators.build(prefix(store, "w")(), 0, 1, devices=["cpu"], timeout_s=10, setup_timeout_s=30)
    group.swap(pg, 0, 1, 0)
    assert group.abort_soon(1) is False  # gloo: nothing to abort, the group keeps working
    t = torch.ones(1)
    group.inner.allreduce([t]).wait()
    assert t.item() == 1.0
    group.release()


@pytest.mark.parametrize(
    "live,user,expected",
    [
        (True, None, "2"),
        (True, "1", "2"),
        (True, "3", "2"),
        (True, "0", "0"),
        (True, "2", "2"),
        (False, None, "1"),
        (False, "3", "3"),
    ],
)
def test_nccl_error_handling_keeps_live_survivors_alive(live, user, expected):
    assert nccl_error_handling(live, user) == expected


# -- CUDA: one GPU, so world size 1 (NCCL refuses two ranks on one GPU) -------------------------


@needs_cuda
def test_cuda_tensors_go_to_nccl_and_cpu_tensors_to_gloo(store):
    pg = build_all(store, 1, devices=communicators.job_devices(None, 0))[0]
    nccl = communicators.nccl_backend(pg)
    assert nccl is not None and type(nccl).__name__ == "ProcessGroupNCCL"
    g = torch.full((4,), 3.0, device="cuda")
    c = torch.full((4,), 5.0)
    pg.allreduce([g]).wait()
    pg.allreduce([c]).wait()
    torch.cuda.synchronize()
    assert g.tolist() == [3.0] * 4 and c.tolist() == [5.0] * 4
    assert communicators.abort(pg) is True
    with pytest.raises(Exception):
        pg.allreduce([g]).wait()
        torch.cuda.synchronize()


@needs_cuda
def test_gloo_asked_for_carries_cuda_tensors_through_host_memory(store):
    """backend="gloo" on a GPU machine (two ranks sharing one GPU, which NCCL refuses): gloo
    serves CUDA tensors too, as init_process_group("gloo") does, and the group has no NCCL to
    abort (the transfer stages CUDA tensors through gloo: ``transfer.wire_for``)."""
    pgs = build_all(store, 2, devices=communicators.job_devices("gloo", 0))

    def step(r):
        pg = pgs[r]
        assert communicators.nccl_backend(pg) is None and communicators.nccl_device(pg) is None
        g = torch.full((4,), float(r + 1), device="cuda")
        pg.allreduce([g]).wait()
        out = [torch.zeros(2, device="cuda") for _ in range(2)]
        pg.allgather([out], [torch.full((2,), float(r), device="cuda")]).wait()
        torch.cuda.synchronize()
        return g.tolist(), [o.tolist() for o in out]

    assert all(v == ([3.0] * 4, [[0.0, 0.0], [1.0, 1.0]]) for v in on_ranks(2, step).values())


@needs_cuda
def test_nccl_setup_waiting_for_a_member_that_never_joins_ends_at_the_setup_timeout(store):
    """Rank 1 joins gloo but never NCCL (it has no GPU): rank 0's NCCL set-up waits for it,
    and the wait ends at the set-up timeout (build sets TORCH_NCCL_NONBLOCKING_TIMEOUT from
    it) with an error, not never. (An abort() from another thread does not cut such a wait
    short: measured on torch 2.11, a waiting allreduce held its lock for the whole timeout.)
    In a child process: torch reads TORCH_NCCL_NONBLOCKING_TIMEOUT once per process."""
    code = textwrap.dedent("""
        import threading, time, torch, torch.distributed as dist
        from tm_launch.worker.comms import communicators
        s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        threading.Thread(target=communicators.build, args=(dist.PrefixStore("p/", s.clone()), 1, 2),
                         kwargs=dict(devices=["cpu"], timeout_s=60, setup_timeout_s=120), daemon=True).start()
        t0 = time.monotonic()
        try:
            communicators.build(dist.PrefixStore("p/", s), 0, 2, devices=["cuda:0"], timeout_s=60, setup_timeout_s=15)
            print("RESULT built")
        except Exception as e:
            print("RESULT raised", type(e).__name__)
        print("ELAPSED", round(time.monotonic() - t0, 2))
    """)
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "TORCH_NCCL_NONBLOCKING_TIMEOUT"},
    )
    out = r.stdout
    assert "RESULT raised" in out, out + r.stderr[-2000:]
    assert 10 < float(out.split("ELAPSED")[1].split()[0]) < 60, out


@needs_cuda
def test_release_aborts_and_destroys_off_the_callers_thread(store):
    pgs = [build_all(store, 1, devices=["cpu", "cuda:0"])[0] for _ in range(3)]
    for pg in pgs:
        pg.allreduce([torch.ones(8, device="cuda")]).wait()
    torch.cuda.synchronize()
    used = torch.cuda.mem_get_info()
    t0 = time.monotonic()
    while pgs:
        assert communicators.release(pgs.pop()) is True
    assert time.monotonic() - t0 < 0.5  # an abort in this thread takes ~1 s per group
    assert communicators.wait_released(30)
    assert torch.cuda.mem_get_info()[0] > used[0]  # the communicators' memory came back


@needs_cuda
def test_the_watcher_aborts_a_live_nccl_group_off_its_thread(store):
    """What ``abort_changed`` does to a group whose membership the next generation changes: its
    CUDA collectives fail from then on, the call returns at once (the abort takes ~1 s on its
    own thread), and the main thread's later swap destroys it without aborting it again."""
    group = LiveGroup(None, 0, 1, StepPoison())
    group.swap(build_all(store, 1, devices=["cpu", "cuda:0"])[0], 0, 1, 0)
    g = torch.ones(4, device="cuda")
    group.inner.allreduce([g]).wait()
    torch.cuda.synchronize()
    t0 = time.monotonic()
    assert group.abort_soon(1) is True
    assert time.monotonic() - t0 < 0.5
    assert communicators.wait_released(30)
    with pytest.raises(Exception):
        group.inner.allreduce([g]).wait()
        torch.cuda.synchronize()
    group.swap(None, 0, 1, 1)
    assert communicators.wait_released(30)


@pytest.mark.parametrize("ifname, works", [("lo", True), ("lo,lo", True), ("nosuchif0", False)])
def test_gloo_takes_its_interfaces_from_gloo_socket_ifname_as_torch_does(store, monkeypatch, ifname, works):
    """``GLOO_SOCKET_IFNAME`` picks the NIC under torchrun; live mode honours it too, before the
    node's own address. An interface that does not exist fails the build with gloo's error."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", ifname)
    if not works:
        with pytest.raises(RuntimeError, match="nosuchif0"):
            build_all(store, 1, hostname="127.0.0.1")
        return
    pgs = build_all(store, 2, hostname="no-such-host.invalid")  # the interface wins over the address

    def step(r):
        t = torch.tensor([float(r + 1)])
        pgs[r].allreduce([t]).wait()
        return t.item()

    assert on_ranks(2, step) == {0: 3.0, 1: 3.0}


@pytest.mark.parametrize(
    "given, want",
    [
        ({}, {"TORCH_GLOO_LAZY_INIT": None, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}),
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, {"TORCH_GLOO_LAZY_INIT": None, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}),
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, {"TORCH_GLOO_LAZY_INIT": None, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}),
        ({"TORCH_GLOO_LAZY_INIT": "0"}, {"TORCH_GLOO_LAZY_INIT": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}),
        ({"TORCH_GLOO_LAZY_INIT": "1"}, {"TORCH_GLOO_LAZY_INIT": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}),
    ],
)
def test_a_live_process_sets_what_torch_reads_for_its_groups_once(given, want):
    """In a process of its own (it changes the environment): the agent gives torchrun's value
    (or the user's); live mode's is set by the worker; gloo's lazy connection, which can hang a
    failed communicator's teardown, is turned off when the user turned it on, and said so."""
    env = {k: v for k, v in os.environ.items() if k not in want} | given
    code = "import os, json; from tm_launch.worker.comms import communicators as c; said = c.live_process_environment(); "
    code += f"print(json.dumps([said, {{k: os.environ.get(k) for k in {sorted(want)!r}}}]))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True).stdout
    said, got = json.loads(out.splitlines()[-1])
    assert got == want
    assert (said is not None) == (given.get("TORCH_GLOO_LAZY_INIT") == "1"), said
