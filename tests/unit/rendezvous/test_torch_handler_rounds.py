"""The etcd-v3 torchrun backend (rendezvous/torch_handler.py), in-process: handlers meet in rounds
on threads against the session etcd (real torchrun agents: tests/e2e/test_torch_handler.py)."""

import threading
import time
import uuid

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters


def _params(endpoint, run_id, **conf):
    conf = {"lease_ttl": 2, **conf}
    return RendezvousParameters(backend="etcd-v3", endpoint=endpoint, run_id=run_id, min_nodes=2, max_nodes=2, **conf)


class Round(threading.Thread):
    """next_rendezvous() on a thread, so that several nodes can meet in one process."""

    def __init__(self, handler):
        super().__init__(daemon=True)
        self.handler, self.info, self.error = handler, None, None
        self.start()

    def run(self):
        try:
            self.info = self.handler.next_rendezvous()
        except BaseException as e:  # noqa: BLE001 - checked by the test
            self.error = e

    def result(self, timeout=30):
        self.join(timeout)
        assert not self.is_alive(), "next_rendezvous() did not return"
        if self.error:
            raise self.error
        return self.info


def _die(handler):
    """What a killed node looks like to the others: its lease is gone."""
    handler._stop.set()
    handler._thread.join()
    handler._lease.revoke()


def test_entry_point_registers_backend(etcd_endpoint):
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from rendezvous.torch_handler import EtcdV3RendezvousHandler

    h = get_rendezvous_handler(_params(etcd_endpoint, f"ep-{uuid.uuid4().hex[:8]}"))
    try:
        assert isinstance(h, EtcdV3RendezvousHandler) and h.get_backend() == "etcd-v3"
        assert not h.use_agent_store and not h.is_closed()
    finally:
        h.shutdown()


def test_rounds_restart_spare_substitution_and_close(etcd_endpoint):
    from rendezvous.torch_handler import create_handler

    run = f"rounds-{uuid.uuid4().hex[:8]}"
    a, b = create_handler(_params(etcd_endpoint, run)), create_handler(_params(etcd_endpoint, run))
    ra, rb = Round(a), Round(b)
    ia, ib = ra.result(), rb.result()
    assert sorted([ia.rank, ib.rank]) == [0, 1] and ia.world_size == ib.world_size == 2
    assert ia.bootstrap_store_info == ib.bootstrap_store_info
    assert ia.bootstrap_store_info.master_addr == "127.0.0.1"
    ia.store.set("hello", "from a")  # one store per generation, shared by both agents
    assert ib.store.get("hello") == b"from a"

    c = create_handler(_params(etcd_endpoint, run))  # beyond MAX: a spare
    rc = Round(c)
    assert c.num_spares() == 1
    assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0  # no restart loop for a spare

    # Both agents restart their workers (a worker failure): a new generation, nobody evicted.
    ra, rb = Round(a), Round(b)
    ia, ib = ra.result(), rb.result()
    assert a._gen == b._gen == 1 and rc.is_alive()
    assert ia.store.check(["hello"]) is False  # fresh prefix per generation

    # b dies: a sees it, re-rendezvouses, and the spare takes b's place.
    lost_rank = ib.rank
    _die(b)
    deadline = time.monotonic() + 10
    while a.num_nodes_waiting() == 0:
        assert time.monotonic() < deadline, "survivor never noticed the lost node"
        time.sleep(0.2)
    ra = Round(a)
    ia, ic = ra.result(), rc.result()
    assert a._gen == c._gen == 2 and ic.rank == lost_rank and ic.world_size == 2
    plan = a._m.snapshot().view.plan
    assert plan.replaced == {c.node: b.node}

    # A late spare leaves gracefully when the job closes (an active node's shutdown closes it).
    d = create_handler(_params(etcd_endpoint, run))
    rd = Round(d)
    assert a.shutdown() and a.is_closed() and d.is_closed()
    with pytest.raises(SystemExit) as exited:  # an unneeded spare: torchrun exits 0
        rd.result()
    assert exited.value.code == 0
    for h in (b, c, d):
        h.shutdown()
