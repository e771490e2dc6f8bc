"""A 3-member etcd cluster under member faults: the KV layer fails over for leases, watches and
compare-and-swap when a follower, then the leader, is SIGKILLed; a full outage keeps leases."""

import threading
import time

import pytest

from rendezvous.etcd_server import EtcdCluster
from rendezvous.kv import EtcdOptions, KVError, connect


@pytest.fixture(scope="module")
def cluster():
    with EtcdCluster() as c:
        yield c


def _kv(cluster, api, prefix):
    return connect(api, EtcdOptions(endpoints=tuple(cluster.endpoints), prefix=prefix, timeout=2))


def _wait_in_thread(kv, prefix, rev, timeout):
    out = {}

    def run():
        try:
            out["result"] = kv.wait(prefix, rev, timeout)
        except Exception as e:  # noqa: BLE001 - the test reports whatever escaped
            out["result"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, out


@pytest.mark.parametrize("api", [pytest.param("v2", marks=pytest.mark.slow), "v3"])
def test_member_kills_fail_over_leases_watches_and_cas(cluster, api):
    kv = _kv(cluster, api, f"fo-{api}")
    other = _kv(cluster, api, f"fo-{api}")
    try:
        lease = kv.grant(3)
        kv.put("nodes/a", "1", lease=lease)
        for victim in (cluster.follower(), cluster.leader()):
            kv._cur = victim  # the client is talking to the member about to die
            t, out = _wait_in_thread(kv, "state/", kv.current_revision(), 10)
            time.sleep(0.3)
            cluster.kill(victim)
            time.sleep(0.3)
            other.put("state/x", str(victim))  # a change the watch must see
            t.join()
            assert out["result"] is True, out
            assert lease.refresh() is True
            entry = kv.get("state/x")
            assert kv.replace("state/x", "cas", entry.revision) is True
            assert kv.get("nodes/a").value == "1"
            cluster.restart(victim)
    finally:
        kv.close()
        other.close()


def test_full_outage_longer_than_ttl_keeps_the_lease(cluster):
    """etcd renews every lease when a new leader takes over, so an outage of the whole cluster
    longer than the TTL does not by itself expire anyone's membership."""
    kv = _kv(cluster, "v3", "outage")
    try:
        lease = kv.grant(2)
        kv.put("nodes/a", "1", lease=lease)
        for i in range(len(cluster.members)):
            cluster.kill(i)
        with pytest.raises(KVError, match="cannot reach etcd"):
            lease.refresh()
        time.sleep(3.5)
        cluster.restart()
        assert lease.refresh() is True
        assert kv.get("nodes/a").value == "1"
    finally:
        kv.close()
