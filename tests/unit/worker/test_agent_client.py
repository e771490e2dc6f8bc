"""The worker's side of the agent's directives (``tm_launch.worker.agent_client``), against a real
agent part: ``WorkerSupervisor.direct`` writes to its own TCPStore server and pushes onto each
worker's queue; the channel's watch thread blocks on that queue (no polling)."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from rendezvous.plan import Plan
from rendezvous.planner import Limits
from tm_launch.launcher import store_server
from tm_launch.launcher.config import AgentConfig
from tm_launch.launcher.supervisor import WorkerSupervisor
from tm_launch.protocol import Directive, WorkerEnv, WorkerKeys
from tm_launch.worker.agent_client import AgentClient

PLAN = Plan(generation=1, nodes=("n1", "n2"), nproc=1, store={"node": "n1", "addr": "127.0.0.1", "port": 1}, live=True)


@pytest.fixture
def agent():
    cfg = AgentConfig(node_id="n2", addr="127.0.0.1", nproc=1, limits=Limits(1, 2, 2, 0), cmd=["true"], run_id="r")
    sup = WorkerSupervisor(cfg, lambda *a, **k: None)
    yield sup
    sup.close()


def channel_of(agent) -> AgentClient:
    return AgentClient(WorkerEnv(agent_store=f"127.0.0.1:{agent.store.port}", local_rank=0))


class Heard(list):
    def __init__(self):
        super().__init__()
        self.news = threading.Condition()

    def __call__(self, directive: Directive) -> None:
        with self.news:
            self.append(directive.generation)
            self.news.notify_all()

    def wait_for(self, generations: list[int]) -> list[int]:
        """What was heard once the last of ``generations`` was (or after 10 s)."""
        with self.news:
            self.news.wait_for(lambda: self and self[-1] >= generations[-1], timeout=10)
        return list(self)


@contextlib.contextmanager
def watching(agent):
    """A worker's channel to ``agent`` and what its watch hears, closed at the end."""
    channel, heard = channel_of(agent), Heard()
    try:
        channel.watch(heard)
        yield channel, heard
    finally:
        channel.close()


def test_the_watch_hears_the_current_directive_and_then_each_newer_one(agent):
    agent.direct(PLAN)
    with watching(agent) as (channel, heard):
        assert heard.wait_for([1]) == [1]
        agent.direct(PLAN.next(generation=2))
        assert heard.wait_for([1, 2]) == [1, 2]
        agent.direct(PLAN.next(generation=2))  # the same generation again: no second call
        agent.direct(PLAN.next(generation=4))
        agent.direct(PLAN.next(generation=5))  # two at once: heard in order, the newest last
        assert heard.wait_for([1, 2, 5]) in ([1, 2, 5], [1, 2, 4, 5])
        assert channel.newer_than(4) and not channel.newer_than(5)


def test_a_waiting_rank_is_woken_by_the_directive_it_waits_for(agent):
    agent.direct(PLAN)
    channel = channel_of(agent)
    try:
        channel.watch(lambda d: None)
        got = []
        waiter = threading.Thread(target=lambda: got.append(channel.wait_directive(after=1)))
        waiter.start()
        waiter.join(timeout=0.3)
        assert waiter.is_alive() and not got  # generation 1 is not newer than 1: it waits
        agent.direct(PLAN.next(generation=4))
        waiter.join(timeout=10)
        assert [d.generation for d in got] == [4]
    finally:
        channel.close()


def test_close_ends_the_watch_thread_blocked_on_its_queue(agent):
    """The watch waits an hour between wake-ups: only its own close can end it promptly, and a
    close left on the queue by an earlier process of this local rank must not end the next one's."""
    agent.store.queue_push(WorkerKeys(0).directives, "close 1")  # an earlier process's, never popped
    agent.direct(PLAN)
    channel, heard = channel_of(agent), Heard()
    channel.watch(heard)
    assert heard.wait_for([1]) == [1]
    agent.direct(PLAN.next(generation=2))
    assert heard.wait_for([1, 2]) == [1, 2]  # the stale close was skipped, the watch lives on
    time.sleep(0.2)  # back in queue_pop
    channel.close()
    assert not channel._watcher.is_alive()
    with pytest.raises(RuntimeError, match="watch of the agent's directives has ended"):
        channel.wait_directive(2)  # nothing left to wake it: loud, not a wait forever


def test_a_stale_generation_left_on_the_queue_is_not_heard_again(agent):
    """A fresh process of a local rank finds what an earlier one never popped."""
    agent.direct(PLAN)
    agent.direct(PLAN.next(generation=2))  # pushed for a process that is gone
    with watching(agent) as (_, heard):
        assert heard.wait_for([2]) == [2]
        agent.direct(PLAN.next(generation=3))
        assert heard.wait_for([2, 3]) == [2, 3]


def test_waiting_needs_the_watch(agent):
    channel = channel_of(agent)
    try:
        with pytest.raises(RuntimeError, match="watch"):
            channel.wait_directive(0)
    finally:
        channel.close()


def test_the_watch_ends_when_the_agent_is_gone():
    server = store_server.serve("127.0.0.1")
    channel = AgentClient(WorkerEnv(agent_store=f"127.0.0.1:{server.port}", local_rank=0))
    channel.watch(lambda d: None)
    del server  # the agent's store server goes with its last reference
    channel._watcher.join(timeout=10)
    assert not channel._watcher.is_alive()
    with pytest.raises(Exception):  # a wait fails at once (the store, or the ended watch), never spins
        channel.wait_directive(0)
    channel.close()


def test_progress_reports_are_written_off_the_main_thread_and_never_over_a_newer_state(agent):
    """A progress report returns before the agent's store answers (the heartbeat thread writes
    the newest one); a state change is in the store when ``report_status`` returns, and a
    progress report handed over before it is never written after it."""
    from tm_launch.protocol import WorkerState, WorkerStatus

    channel = channel_of(agent)
    key = WorkerKeys(0).status
    try:
        for step in range(1, 50):
            channel.report_status(WorkerStatus(state=WorkerState.RUNNING, step=step))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if agent.store.check([key]) and WorkerStatus.from_json(agent.store.get(key)).step == 49:
                break
            time.sleep(0.01)
        assert WorkerStatus.from_json(agent.store.get(key)).step == 49  # the newest, written by the thread
        channel._status_lock.acquire()  # the heartbeat thread cannot write while this is held
        channel.report_status(WorkerStatus(state=WorkerState.RUNNING, step=50))
        done = threading.Event()
        threading.Thread(
            target=lambda: (channel.report_status(WorkerStatus(state=WorkerState.FINISHED, step=50), wake=True), done.set()),
            daemon=True,
        ).start()
        assert not done.wait(0.2)  # the state change waits for the write lock, then goes first
        channel._status_lock.release()
        assert done.wait(10)
        assert WorkerStatus.from_json(agent.store.get(key)).state == WorkerState.FINISHED
        time.sleep(0.7)  # the heartbeat thread ran since: the older progress report was dropped
        assert WorkerStatus.from_json(agent.store.get(key)).state == WorkerState.FINISHED
    finally:
        channel.close()
