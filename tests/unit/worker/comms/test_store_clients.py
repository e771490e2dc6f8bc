"""``tm_launch.worker.comms.store_clients``: connections to the generation stores are opened before a change
needs them, each is used by one holder, and a store the plan left is let go."""

import datetime
import threading
import time

from tm_launch.launcher import store_server
from tm_launch.protocol import StoreAddress
from tm_launch.worker.comms.store_clients import StoreClients


def _where(server) -> StoreAddress:
    return StoreAddress("127.0.0.1", server.port, "n0")


def _until(cond, timeout=30.0) -> None:  # a dropped reverse lookup costs a connect 5 s here
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_change_takes_the_connections_the_last_one_left_ready():
    server = store_server.serve("127.0.0.1")
    where = _where(server)
    clients = StoreClients(timeout_s=30)
    first = [clients.take(where) for _ in range(3)]  # generation 0: nothing ready yet
    assert clients.opened_on_demand == 3
    clients.prepare([where])
    _until(lambda: clients.ready(where) == 3)  # as many as the change took
    second = [clients.take(where) for _ in range(3)]
    assert clients.opened_on_demand == 3  # none opened on the way
    for i, c in enumerate(first + second):
        c.set(f"k{i}", str(i))
    assert [server.get(f"k{i}") for i in range(6)] == [str(i).encode() for i in range(6)]
    clients.close()


def test_each_holder_has_a_connection_of_its_own():
    """A wait blocked on one connection (a vote) does not hold up another holder's set (the
    watcher's abort): on one shared connection the set would queue behind the wait."""
    server = store_server.serve("127.0.0.1")
    where = _where(server)
    clients = StoreClients(timeout_s=30)
    clients.take(where)
    clients.prepare([where])
    _until(lambda: clients.ready(where) == 1)
    waiter, setter = clients.take(where), clients.take(where)
    done = []
    thread = threading.Thread(target=lambda: (waiter.wait(["decided"], datetime.timedelta(seconds=5)), done.append(time.monotonic())))
    thread.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    setter.set("decided", "abort")
    thread.join()
    assert done and done[0] - t0 < 2.0
    clients.close()


def test_the_standby_gets_ready_connections_and_a_store_left_behind_is_dropped():
    host, standby, elsewhere = (store_server.serve("127.0.0.1") for _ in range(3))
    clients = StoreClients(timeout_s=30)
    clients.take(_where(host))
    clients.take(_where(host))
    clients.prepare([_where(host), _where(standby)])
    _until(lambda: clients.ready(_where(host)) == 2 and clients.ready(_where(standby)) == 2)
    # The host's node was lost: the next plan's store is the standby, with a new standby.
    clients.take(_where(standby))
    clients.take(_where(standby))
    assert clients.opened_on_demand == 2
    clients.prepare([_where(standby), _where(elsewhere)])
    assert clients.ready(_where(host)) == 0
    _until(lambda: clients.ready(_where(standby)) == 2 and clients.ready(_where(elsewhere)) == 2)
    clients.close()


def test_an_unreachable_standby_holds_up_no_other_store(refusing_port):
    host = store_server.serve("127.0.0.1")
    dead = StoreAddress("127.0.0.1", refusing_port, "n1")
    clients = StoreClients(timeout_s=30)
    clients.take(_where(host))
    clients.prepare([dead, _where(host)])
    _until(lambda: clients.ready(_where(host)) == 1)
    assert clients.ready(dead) == 0
    clients.close()


def test_a_plan_without_a_store_address_is_refused():
    clients = StoreClients(timeout_s=1)
    try:
        clients.take(None)
    except ValueError as e:
        assert "no store address" in str(e)
    else:
        raise AssertionError("took a connection to nowhere")
    clients.prepare([None, StoreAddress("", 0)])  # nothing to open: no error
    clients.close()


def test_a_parked_spare_keeps_as_many_ready_as_it_will_take():
    """A parked spare took nothing yet; it keeps ``at_least`` ready to the plan's store and its
    standby for the day it is promoted (the world, its subgroups, the vote and its abort path)."""
    host, standby = store_server.serve("127.0.0.1"), store_server.serve("127.0.0.1")
    clients = StoreClients(timeout_s=30)
    clients.prepare([_where(host), _where(standby)], at_least=3)
    _until(lambda: clients.ready(_where(host)) == 3 and clients.ready(_where(standby)) == 3)
    for _ in range(3):
        clients.take(_where(standby))
    assert clients.opened_on_demand == 0
    clients.close()


def test_a_change_that_took_fewer_does_not_shrink_what_is_kept_ready():
    """Generation 0 builds every group (3 connections here); a change that rebuilt none of the
    subgroups takes 2; the next change may rebuild them all again and finds 3 ready."""
    server = store_server.serve("127.0.0.1")
    where = _where(server)
    clients = StoreClients(timeout_s=30)
    for _ in range(3):
        clients.take(where)
    clients.prepare([where])
    _until(lambda: clients.ready(where) == 3)
    for _ in range(2):
        clients.take(where)
    clients.prepare([where])
    _until(lambda: clients.ready(where) == 3)
    for _ in range(3):
        clients.take(where)
    assert clients.opened_on_demand == 3  # generation 0's only
    clients.close()
