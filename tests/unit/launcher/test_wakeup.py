"""The agent's wake-up sources (tm_launch.launcher.wakeup) with real processes, sockets and etcd."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from rendezvous.kv import WatchNews
from tm_launch.launcher.wakeup import StateWatch, WakeSocket, Wakeup, watch_exit
from tm_launch.worker.agent_client import poke


def test_wakeup_collects_reasons_and_clears():
    w = Wakeup()
    assert w.wait(0.01) == set()
    w.set("a")
    w.set("b")
    assert w.wait(1) == {"a", "b"}
    assert w.wait(0.01) == set()


def test_worker_exit_wakes_at_once_and_leaves_the_reaping_to_popen():
    w = Wakeup()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    watch_exit(proc.pid, lambda: w.set("exit"))
    assert w.wait(0.2) == set()
    proc.kill()
    t0 = time.monotonic()
    assert w.wait(5) == {"exit"}
    assert time.monotonic() - t0 < 1.0
    assert proc.wait(timeout=5) == -9  # WNOWAIT: Popen still reaps it and sees the signal


def test_a_poke_from_another_process_wakes_the_socket():
    w = Wakeup()
    sock = WakeSocket(w)
    try:
        code = f"from tm_launch.worker.agent_client import poke; poke({sock.address!r})"
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
        assert w.wait(5) == {"worker"}
        poke(None)  # no agent (plain torchrun): nothing happens
        poke("tm-launch-wake-nobody-listens")  # the agent is gone: never raises
    finally:
        sock.close()


def _watch(kv, scope_prefix):
    return lambda: kv.watch_stream(scope_prefix)


def test_state_watch_wakes_on_changes_after_the_read_only(kv_factory):
    """Real etcd, both APIs: a change in scope after the loop's read wakes it; a change
    outside the scope does not; a change between the read and the arm wakes at the arm."""
    kv, other = kv_factory("job"), kv_factory("job")  # the same keys through two clients
    w = Wakeup()
    watch = StateWatch(w)
    try:
        read = kv.current_revision()
        watch.arm("plan", _watch(kv, "state/plan"), read)
        w.wait(2)  # the stream may start after the read: one wake-up to read again is allowed
        read = kv.current_revision()
        watch.arm("plan", _watch(kv, "state/plan"), read)
        kv.put("log/elsewhere", "x")  # outside the scope
        kv.put("state/nodes/a", "x")  # outside the plan's scope too
        assert w.wait(0.5) == set()
        other.put("state/plan", "1")
        assert w.wait(5) == {"etcd"}
        read = kv.current_revision()
        other.put("state/plan", "2")  # before the loop arms again: the arm itself wakes it
        deadline = time.monotonic() + 5
        while watch._known.get("plan", (0, 0))[1] < read + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        w.wait(0.01)
        watch.arm("plan", _watch(kv, "state/plan"), read)
        assert w.wait(0.01) == {"etcd"}
    finally:
        watch.close()


def test_a_stream_that_fails_wakes_the_loop_and_a_new_scope_gets_its_own_stream():
    w = Wakeup()
    watch = StateWatch(w, retry_s=0.05)
    opened = []

    def broken():
        opened.append("broken")
        raise ConnectionError("etcd unreachable")
        yield  # a generator

    def quiet():
        opened.append("quiet")
        yield WatchNews("created", 7)
        threading.Event().wait(0.3)

    watch.arm("other", broken, 9)
    assert w.wait(2) == {"etcd"}  # the loop's own read then meets the error and backs off
    watch.arm(StateWatch.WIDEST, quiet, 7)
    time.sleep(0.2)
    assert "quiet" in opened
    assert w.wait(0.05) == set()  # created at the read's revision: nothing missed, nothing new
    watch.arm(StateWatch.WIDEST, quiet, 5)  # a read older than the stream: read again
    assert w.wait(1) == {"etcd"}
    watch.close()
