"""tm_launch.worker.comms.connections, and what it measures: a rank entering a generation connects its
world group's full mesh, N - 1 connections, and nothing more for the agreement and a state
transfer (real processes, one per rank, on a real TCPStore; gloo's lazy connection, which can
hang a failed communicator's teardown, is off even where the user's environment turns it on)."""

import datetime
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

from tm_launch.worker.comms import communicators, connections

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

# One rank entering a generation as the runtime does: the communicator, then the agreement
# (an all-gather of every rank's holding) and one state transfer (rank 0 sends to rank size/2,
# not a ring neighbour from 4 ranks on).
RANK = textwrap.dedent(
    """
    import datetime, os, sys
    import torch, torch.distributed as dist
    from tm_launch.worker.comms import communicators, connections
    from tm_launch.worker.state.transfer import allgather_objects
    rank, size, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    communicators.live_process_environment()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    mark = connections.Mark()
    pg = communicators.build(dist.PrefixStore("g1/", store), rank, size, devices=["cpu"], timeout_s=30,
                             setup_timeout_s=60, hostname="127.0.0.1")
    assert allgather_objects(pg, size, {"rank": rank}) == [{"rank": r} for r in range(size)]
    # objects longer than the first round's bytes, of different lengths (a second round)
    assert allgather_objects(pg, size, "x" * 5000 * rank) == ["x" * 5000 * r for r in range(size)]
    t = torch.full((4,), float(rank))
    if rank == 0:
        pg.send([t], size // 2, 0).wait()
    elif rank == size // 2:
        pg.recv([t], 0, 0).wait()
        assert t.sum().item() == 0
    print("OPENED", mark.opened(), flush=True)
    print("PAIRS", len(communicators.pair_sockets(pg)), flush=True)
    store.set(f"done/{rank}", "1")
    store.wait([f"done/{r}" for r in range(size)])
    # Out without the interpreter's teardown: a bare communicator (no tm-launch runtime to free
    # it first) destroyed there sometimes ends the process in C++'s "terminate called without an
    # active exception" (gloo's threads), a non-zero exit that says nothing of what was measured.
    communicators.release(pg)
    os._exit(0)
    """
)


# Giving up a communicator that something still holds: rank 0 holds a pending receive on it
# (as an unfinished work of an abandoned step does) and releases it; ranks 1 and 2, blocked on
# rank 0 in a receive under a 60 s collective timeout, fail at once, and so does rank 0's own.
GIVE_UP = textwrap.dedent(
    """
    import datetime, sys, time
    import torch, torch.distributed as dist
    from tm_launch.worker.comms import communicators
    rank, size, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    communicators.live_process_environment()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    pg = communicators.build(dist.PrefixStore("g1/", store), rank, size, devices=["cpu"], timeout_s=60,
                             setup_timeout_s=60, hostname="127.0.0.1")
    work = pg.recv([torch.zeros(4)], 0 if rank else 1, 0)
    store.set(f"waiting/{rank}", "1")
    if rank == 0:
        store.wait([f"waiting/{r}" for r in range(size)])
        time.sleep(0.3)
        print("RELEASED", communicators.release(pg), communicators.pair_sockets(pg), flush=True)
    start = time.monotonic()
    try:
        work.wait()
        print("RECEIVED", flush=True)
    except RuntimeError as e:
        print("FAILED", round(time.monotonic() - start, 3), str(e).splitlines()[0][:200], flush=True)
    """
)


def run_ranks(script: str, size: int, lazy: str | None = None) -> list[str]:
    """The standard output of ``size`` rank processes running ``script`` (rank, size, store port)."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    env.pop(communicators.LAZY_GLOO, None)
    if lazy is not None:
        env[communicators.LAZY_GLOO] = lazy
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(r), str(size), str(master.port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(size)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        outs.append(out)
    return outs


def said(out: str, word: str) -> list[str]:
    return next(line.split()[1:] for line in out.splitlines() if line.startswith(word))


def test_a_communicator_given_up_fails_every_wait_on_it_at_once_whatever_holds_it():
    outs = run_ranks(GIVE_UP, 3)
    assert said(outs[0], "RELEASED") == ["True", "[]"], outs[0]  # its 2 connections shut down, once
    for out in outs:
        seconds = float(said(out, "FAILED")[0])
        assert seconds < 10, out  # not the 60 s collective timeout


def enter_on(size: int, lazy: str | None = None) -> list[int]:
    """Connections each of ``size`` rank processes opened while entering (by rank), with the
    user's ``TORCH_GLOO_LAZY_INIT`` set to ``lazy`` (None: unset); each rank's communicator
    knows its connections, one per peer."""
    outs = run_ranks(RANK, size, lazy)
    assert all(said(out, "PAIRS") == [str(size - 1)] for out in outs), outs
    return [int(said(out, "OPENED")[0]) for out in outs]


def test_a_rank_entering_connects_the_full_mesh_and_nothing_more():
    assert enter_on(2) == [1, 1]
    assert enter_on(4) == [3] * 4


@pytest.mark.slow
def test_the_users_lazy_gloo_is_turned_off_in_live_mode():
    assert enter_on(4, lazy="1") == [3] * 4  # lazy: 2 ring neighbours, 3 for the transfer's ends


def test_a_mark_counts_established_connections_only():
    mark = connections.Mark()
    assert mark.opened() == 0
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    assert mark.opened() == 2  # both ends live in this process; the listener is no connection
    for s in (client, accepted, listener):
        s.close()
    assert mark.opened() == 0


def test_a_connection_an_older_listener_accepts_is_not_counted():
    """Another process connecting to a group this one had before the mark (a dying worker's last
    collective of the old generation) is no connection the change opened; a listener opened
    since the mark (the rebuilt group's) counts what it accepts."""
    old = socket.create_server(("127.0.0.1", 0))
    mark = connections.Mark()
    client = socket.create_connection(old.getsockname())
    accepted, _ = old.accept()
    assert mark.opened() == 1  # the client end is outgoing; the accepted end belongs to the old listener
    new = socket.create_server(("127.0.0.1", 0))
    client2 = socket.create_connection(new.getsockname())
    accepted2, _ = new.accept()
    assert mark.opened() == 3
    for s in (client, accepted, old, client2, accepted2, new):
        s.close()
