"""The fencing rule as a table: an etcd outage must not stop training; a cut-off node must."""

import pytest

from tm_launch.launcher.fencing import FENCE, KEEP, REREGISTER, lease_decision, settling_after_outage

TTL, LIMIT = 5.0, 8.0

CASES = [
    # lease_gone, unreachable_for, active, replaced, recovering, stalled_for -> decision
    ("healthy", False, None, True, False, False, 0.1, KEEP),
    ("etcd blip (leader election)", False, 1.0, True, False, False, 0.1, KEEP),
    ("all of etcd down, training goes on", False, 60.0, True, False, False, 0.2, KEEP),
    ("etcd down, slow steps but under the collective limit", False, 60.0, True, False, False, 7.0, KEEP),
    ("cut off: collective failed, etcd silent past ttl/2", False, 2.6, True, False, True, 1.0, FENCE),
    ("cut off: collective failed, etcd silent only briefly", False, 1.0, True, False, True, 1.0, KEEP),
    ("cut off: a collective blocks past its limit", False, 9.0, True, False, False, 9.0, FENCE),
    ("worker recovering but etcd answers: the planner handles it", False, None, True, False, True, 30.0, KEEP),
    ("spare cut off owns no rank", False, 60.0, False, False, False, None, KEEP),
    ("lease gone, plan still has us: rejoin", True, None, True, False, False, 0.1, REREGISTER),
    ("lease gone, spare: rejoin", True, None, False, False, False, None, REREGISTER),
    ("a plan replaced us", True, None, True, True, False, 0.1, FENCE),
    ("a plan replaced us, lease still alive", False, None, True, True, False, 0.1, FENCE),
]


@pytest.mark.parametrize("name,gone,unreach,active,replaced,recovering,stalled,want", CASES, ids=[c[0] for c in CASES])
def test_lease_decision(name, gone, unreach, active, replaced, recovering, stalled, want):
    got = lease_decision(
        lease_gone=gone,
        unreachable_for=unreach,
        ttl=TTL,
        active=active,
        replaced=replaced,
        recovering=recovering,
        stalled_for=stalled,
        stall_limit=LIMIT,
    )
    assert got == want


@pytest.mark.parametrize("since_back,want", [(None, False), (0.5, True), (5.9, True), (6.0, False), (60.0, False)])
def test_no_replacement_while_nodes_rejoin_after_an_outage(since_back, want):
    assert settling_after_outage(since_back, ttl=3.0) is want
