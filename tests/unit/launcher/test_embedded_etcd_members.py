"""The embedded etcd's I/O with real etcd processes (no agents): three members bootstrap from the
layout alone, one is SIGKILLed, and a fourth node takes its place through etcd's member
replacement (remove, add, start as ``existing``) exactly as the keeper does it."""

import signal
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from tm_launch.launcher.embedded_etcd.cluster_api import ClusterAPI, ClusterError
from tm_launch.launcher.embedded_etcd.decisions import replacement
from tm_launch.launcher.embedded_etcd.keeper import initial_cluster
from tm_launch.launcher.embedded_etcd.layout import Layout
from tm_launch.launcher.embedded_etcd.member import MemberProcess
from tm_launch.local.ports import free_port_block


@pytest.fixture
def cluster():
    nodes = ("a", "b", "c", "d")
    layout = Layout(nodes, port=free_port_block(3 * len(nodes)), loopback=True)
    run = f"unit-{uuid.uuid4().hex[:8]}"
    members = {n: MemberProcess(layout, n, run) for n in nodes}
    # Members die with the thread that started them (PDEATHSIG): the pool's threads outlive the test.
    pool = ThreadPoolExecutor(max_workers=4)
    try:
        yield layout, members, pool
    finally:
        for m in members.values():
            m.stop()
        pool.shutdown()


@pytest.mark.slow  # real etcd processes and etcd's own 5 s wait before an add: ~7-17 s
def test_members_bootstrap_from_the_layout_and_a_dead_one_is_replaced(cluster):
    layout, members, pool = cluster
    starts = [pool.submit(members[n].start, layout.initial_cluster, "new", 60) for n in layout.first_members]
    for f in starts:
        f.result()
    api = ClusterAPI(layout.client_urls)
    listed = api.members()
    assert sorted(m.name for m in listed) == ["a", "b", "c"] and all(m.answering and m.started for m in listed)

    victim = members["a"]
    victim._proc.send_signal(signal.SIGKILL)
    victim._proc.wait()
    plan = replacement(layout, api.members(), alive={"b", "c", "d"})
    assert plan is not None and (plan.dead_node, plan.by) == ("a", "d")

    api.remove(plan.dead.id)
    peers = api.add(members["d"].address.peer_url)
    pool.submit(members["d"].start, initial_cluster(layout, peers), "existing", 60).result()
    after = api.members()
    assert sorted(m.name for m in after) == ["b", "c", "d"] and all(m.answering for m in after)
    assert replacement(layout, after, alive={"b", "c", "d"}) is None

    with pytest.raises(ClusterError, match="refused /v3/cluster/member/add"):  # etcd says why, in one line
        api.add(members["b"].address.peer_url)
