"""The fencing rule and the etcd retry policy as tables: an etcd outage must not stop training
(the agent keeps asking, the workers keep training); a cut-off node must stop."""

import pytest

from tm_launch.launcher.etcd_retry import GIVE_UP, RETRY, gone_after, outage_decision, retry_delay
from tm_launch.launcher.fencing import (
    FENCE,
    KEEP,
    REREGISTER,
    lapsed_but_alive,
    lease_decision,
    peers_cut_off,
    plans_while_settling,
    settling_after_outage,
)

TTL, LIMIT = 5.0, 8.0

CASES = [
    # lease_gone, unreachable_for, active, replaced, recovering, stalled_for[, peers_cut_off] -> decision
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
    # a peer's worker died while all of etcd was down: every peer asked is cut off from etcd too
    ("all of etcd down, a peer's worker died: nobody can take our ranks", False, 2.6, True, False, True, 1.0, KEEP, True),
    ("all of etcd down, a collective blocks past its limit", False, 9.0, True, False, False, 9.0, KEEP, True),
    ("peers cut off too, but a plan replaced us", False, 9.0, True, True, True, 1.0, FENCE, True),
    ("peers cut off too, lease gone and etcd answers: rejoin", True, None, True, False, True, 1.0, REREGISTER, True),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_lease_decision(case):
    name, gone, unreach, active, replaced, recovering, stalled, want, *peers = case
    got = lease_decision(
        lease_gone=gone,
        unreachable_for=unreach,
        ttl=TTL,
        active=active,
        replaced=replaced,
        recovering=recovering,
        stalled_for=stalled,
        stall_limit=LIMIT,
        peers_cut_off=bool(peers and peers[0]),
    )
    assert got == want


@pytest.mark.parametrize("since_back,want", [(None, False), (0.5, True), (5.9, True), (6.0, False), (60.0, False)])
def test_no_replacement_while_nodes_rejoin_after_an_outage(since_back, want):
    assert settling_after_outage(since_back, ttl=3.0) is want


@pytest.mark.parametrize(
    "since_back, renewal_age, want",
    [
        (None, 0.2, False),  # renewals on time (every ttl/3 = 1 s)
        (None, 1.3, False),  # one renewal's round trip on top of the interval
        (None, 1.9, True),  # a renewal late (past 0.6 TTL): etcd slow for this agent too
        (None, 30.0, True),  # still not through
        (60.0, 2.5, True),
        (0.5, 0.2, True),  # right after an outage, renewals on time again
        (60.0, None, False),  # no lease (not registered yet): the outage rule alone
    ],
)
def test_no_replacement_while_this_agents_own_renewal_is_late(since_back, renewal_age, want):
    assert settling_after_outage(since_back, ttl=3.0, renewal_age=renewal_age) is want


@pytest.mark.parametrize(
    "attempt, ttl, jitter, want",
    [
        (0, 3.0, 0.0, 0.0),  # nothing failed yet
        (1, 3.0, 0.0, 0.05),  # the first retry comes at once: an election is over in a moment
        (2, 3.0, 0.0, 0.1),
        (3, 3.0, 0.0, 0.2),
        (5, 3.0, 0.0, 0.8),
        (6, 3.0, 0.0, 1.0),  # capped at a second
        (60, 3.0, 0.0, 1.0),  # however long the outage
        (6, 1.5, 0.0, 0.5),  # never later than a lease renewal (ttl / 3)
        (1, 0.0, 0.0, 0.0),
        (6, 3.0, 1.0, 0.8),  # jitter takes up to a fifth off
        (6, 3.0, 0.5, 0.9),
        (6, 3.0, 7.0, 0.8),  # a draw outside [0, 1] is clamped
    ],
)
def test_retry_delay(attempt, ttl, jitter, want):
    assert retry_delay(attempt, ttl, jitter) == pytest.approx(want)


@pytest.mark.parametrize(
    "silent_for, ttl, running, want",
    [
        (None, 3.0, False, RETRY),  # etcd just answered
        (5.0, 3.0, False, RETRY),  # a restart, an upgrade: keep asking
        (59.9, 3.0, False, RETRY),
        (60.0, 3.0, False, GIVE_UP),  # gone for a minute and nothing to protect: one line, exit
        (3600.0, 3.0, True, RETRY),  # workers still train: they keep training, the agent keeps asking
        (119.0, 10.0, False, RETRY),  # 12 TTLs when that is longer
        (120.0, 10.0, False, GIVE_UP),
    ],
)
def test_outage_decision(silent_for, ttl, running, want):
    assert outage_decision(silent_for=silent_for, ttl=ttl, workers_running=running) == want
    assert gone_after(ttl) == max(60.0, 12 * ttl)


@pytest.mark.parametrize(
    "mine, peers, want",
    [
        (100.0, [], False),  # alone: nothing proves etcd is down for anyone else
        (100.0, [99.0, 100.5], True),  # nobody heard from etcd since (a peer's renewal came just after ours)
        (100.0, [101.25], True),  # the peer's last contact is within its own interval of ours
        (100.0, [101.3], False),  # etcd answered a peer after it stopped answering us: we may be cut off
        (100.0, [99.0, None], False),  # a peer that does not answer may be cut off with us
        (100.0, [None], False),
    ],
)
def test_peers_cut_off(mine, peers, want):
    assert peers_cut_off(mine, peers, ttl=3.0) is want


@pytest.mark.parametrize(
    "live, finished, removed, replaced, reported, want",
    [
        (True, False, {"a"}, {"a"}, {"a"}, True),  # a's worker was killed in the outage, the spare takes its ranks
        (True, False, {"a", "b"}, {"a", "b"}, {"a"}, False),  # b is out for its lease alone: it may be re-registering
        (True, False, {"a"}, set(), {"a"}, False),  # nobody takes a's ranks: a restart at a smaller size
        (False, False, {"a"}, {"a"}, {"a"}, False),  # restart mode: every worker starts afresh
        (True, True, {"a"}, {"a"}, {"a"}, False),  # the job would end (no spare left: the spare may be re-registering)
        (True, False, set(), set(), set(), False),  # nothing removed: nothing urgent
    ],
)
def test_only_a_reported_failure_is_planned_while_nodes_rejoin(live, finished, removed, replaced, reported, want):
    assert plans_while_settling(live=live, finished=finished, removed=removed, replaced=replaced, reported=reported) is want


@pytest.mark.parametrize(
    "contacts, request_timeout, want",
    [
        ([], 0.0, False),  # no address known: replaced as before
        ([None], 0.0, False),  # its agent does not answer: dead, frozen or cut off
        ([99.0], 0.0, True),  # answers, etcd answered it 1 s ago: a late renewal (the v2 FSDP2 soak, etcd slowed)
        ([94.1], 0.0, True),
        ([94.0], 0.0, False),  # answers, but etcd has not for two TTLs: cut off from etcd, replaced
        ([50.0], 0.0, False),
        ([None, 99.0], 0.0, True),  # one of two alive: hold (the other is replaced once that one is back)
        ([None, 10.0], 0.0, False),
        ([93.8], 5.0, True),  # 6.2 s: its renewal still waits out the client's 5 s on a hung member (soak seed 3)
        ([89.1], 5.0, True),
        ([89.0], 5.0, False),  # two TTLs and a request timeout: it would have failed over by now
        ([None], 5.0, False),
    ],
)
def test_a_lapsed_lease_is_not_replaced_while_its_agent_answers_and_hears_from_etcd(contacts, request_timeout, want):
    assert lapsed_but_alive(contacts, now=100.0, ttl=3.0, request_timeout=request_timeout) is want
