"""The ring of kept-open connections between agents (``tm_launch.launcher.peer_link``): whom a node
watches, and what the link reports, on real sockets."""

import math
import socket
import threading
import time
from collections import Counter

import pytest

from tm_launch.launcher import peer_link
from tm_launch.launcher.peer_link import PeerLink, probe_targets, successor


@pytest.mark.parametrize(
    "nodes, me, want",
    [
        pytest.param(["a", "b", "c"], "a", "b", id="the next node"),
        pytest.param(["a", "b", "c"], "c", "a", id="the last wraps round to the first"),
        pytest.param(["a", "b"], "b", "a", id="two nodes watch each other"),
        pytest.param(["a"], "a", None, id="alone: nobody"),
        pytest.param(["a", "b"], "s", None, id="not active (a spare): nobody"),
    ],
)
def test_successor(nodes, me, want):
    assert successor(nodes, me) == want


def test_every_active_node_is_watched_by_exactly_one_peer():
    nodes = [f"n{i}" for i in range(7)]
    watchers = [successor(nodes, me) for me in nodes]
    assert sorted(watchers) == sorted(nodes)


@pytest.mark.parametrize(
    "nodes, me, want",
    [
        pytest.param("abcdefgh", "a", list("bce"), id="distances 1, 2, 4 in a ring of 8"),
        pytest.param("abcdefgh", "g", list("hac"), id="wrapping round"),
        pytest.param("abc", "b", list("ca"), id="three nodes: both others"),
        pytest.param("ab", "b", ["a"], id="two nodes: the other"),
        pytest.param("a", "a", [], id="alone: nobody"),
        pytest.param("ab", "s", [], id="not active (a spare): nobody"),
    ],
)
def test_probe_targets(nodes, me, want):
    assert probe_targets(list(nodes), me) == want


@pytest.mark.parametrize("n", [2, 3, 5, 8, 100, 1024])
def test_a_probe_costs_log_n_per_node_and_every_node_is_probed_as_often(n):
    """A failure makes every survivor probe: log2(N) connections each, not N - 1 (N^2 in all),
    and each node, dead or alive, is probed by as many peers (none is left to its lease)."""
    nodes = [f"n{i}" for i in range(n)]
    probes = Counter(t for me in nodes for t in probe_targets(nodes, me))
    per_node = math.ceil(math.log2(n))
    assert all(len(probe_targets(nodes, me)) == per_node for me in nodes)
    assert set(probes) == set(nodes) and set(probes.values()) == {per_node}


class Peer:
    """A listening port standing for a peer agent's; ``die()`` closes it as a killed process's kernel would."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.accepted = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        try:
            while True:
                self.accepted.append(self.listener.accept()[0])
        except OSError:
            pass

    def die(self):
        self.listener.shutdown(socket.SHUT_RDWR)  # ends the blocked accept(), which holds the socket open
        self.thread.join()
        self.listener.close()
        for conn in self.accepted:
            conn.close()


def test_a_peer_that_dies_wakes_the_agent_once_per_generation():
    woke = threading.Event()
    link = PeerLink(wake=woke.set)
    peer = Peer()
    link.watch(("b", "127.0.0.1", peer.port), generation=1)
    assert not woke.wait(0.3), "a live peer must not wake anyone"
    assert link.take_dropped() is None
    peer.die()
    assert woke.wait(10), "the end of the peer's connection must wake the agent"
    assert link.take_dropped() == "b" and link.take_dropped() is None
    woke.clear()
    link.watch(("b", "127.0.0.1", peer.port), generation=1)  # the loop asks again: no reconnect spin
    assert not woke.wait(0.3)
    link.watch(("b", "127.0.0.1", peer.port), generation=2)  # a new plan still names it: tried again
    assert woke.wait(10) and link.take_dropped() == "b"  # refused
    link.close()


def test_a_broken_link_to_a_peer_that_answers_is_watched_again(monkeypatch):
    """The link ended but the probe found the peer's agent answering: watched again after
    REWATCH_AFTER (else it was left to its lease for the rest of the generation), not before."""
    monkeypatch.setattr(peer_link, "REWATCH_AFTER", 0.2)
    woke = threading.Event()
    link = PeerLink(wake=woke.set)
    peer = Peer()
    link.watch(("b", "127.0.0.1", peer.port), generation=1)
    deadline = time.time() + 10
    while not peer.accepted and time.time() < deadline:
        time.sleep(0.01)
    peer.accepted.pop().close()  # the connection breaks; the peer's listener lives on
    assert woke.wait(10) and link.take_dropped() == "b"
    link.answered("b")
    link.watch(("b", "127.0.0.1", peer.port), generation=1)
    time.sleep(0.1)
    assert not peer.accepted, "watched again before REWATCH_AFTER"
    time.sleep(0.2)
    link.watch(("b", "127.0.0.1", peer.port), generation=1)
    deadline = time.time() + 10
    while not peer.accepted and time.time() < deadline:
        time.sleep(0.01)
    assert len(peer.accepted) == 1, "not watched again"
    woke.clear()
    peer.die()
    assert woke.wait(10) and link.take_dropped() == "b"  # and its death is seen through the new link
    link.close()


def test_a_link_given_up_on_purpose_wakes_nobody():
    woke = threading.Event()
    link = PeerLink(wake=woke.set)
    first, second = Peer(), Peer()
    link.watch(("b", "127.0.0.1", first.port), generation=1)
    link.watch(("c", "127.0.0.1", second.port), generation=2)  # the plan changed: watch another node
    link.close()
    assert not woke.wait(0.5) and link.take_dropped() is None
    first.die()
    second.die()
