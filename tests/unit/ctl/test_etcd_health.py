"""``ctl status``'s view of etcd (tm_launch.ctl.etcd_health): the pure table, then a real
3-member cluster (EtcdCluster) asked over both APIs, with a member crashed."""

import json
import subprocess
import sys
import uuid

import pytest

from rendezvous.etcd_server import EtcdCluster
from rendezvous.kv import EtcdOptions
from tm_launch.ctl.etcd_health import Answer, Member, ask_v2, ask_v3, etcd_members, listed_v2, listed_v3, members, summary

A, B, C = (Member(str(i), f"m{i}", (f"http://h:{i}",)) for i in (1, 2, 3))


def row(name, answers, leader, error=""):
    return (name, answers, leader, error)


def short(rows):
    return [(r["name"], r["answers"], r["leader"], r["error"]) for r in rows]


@pytest.mark.parametrize(
    "listed, answers, expected",
    [
        (  # all up, all agree on the leader
            [A, B, C],
            [Answer("http://h:1", "1", "2"), Answer("http://h:2", "2", "2"), Answer("http://h:3", "3", "2")],
            [row("m1", True, False), row("m2", True, True), row("m3", True, False)],
        ),
        (  # one down: its endpoint's error is shown
            [A, B, C],
            [Answer("http://h:1", "1", "1"), Answer("http://h:2", None, error="refused"), Answer("http://h:3", "3", "1")],
            [row("m1", True, True), row("m2", False, False, "refused"), row("m3", True, False)],
        ),
        (  # a member the endpoints do not name
            [A, B, C],
            [Answer("http://h:1", "1", "3")],
            [
                row("m1", True, False),
                row("m2", False, False, "not asked (not in --rdzv-endpoint)"),
                row("m3", False, True, "not asked (not in --rdzv-endpoint)"),
            ],
        ),
        (  # members disagree (a partition): nobody is shown as leader
            [A, B],
            [Answer("http://h:1", "1", "1"), Answer("http://h:2", "2", "2")],
            [row("m1", True, False), row("m2", True, False)],
        ),
        (  # no member list (nobody answered): one row per endpoint
            [],
            [Answer("http://h:1", None, error="refused"), Answer("http://h:2", None, error="timed out")],
            [row("", False, False, "refused"), row("", False, False, "timed out")],
        ),
        (  # endpoints of nodes that hold no member (the embedded etcd names every node): not members
            [A, B],
            [Answer("http://h:1", "1", "1"), Answer("http://h:2", "2", "1"), Answer("http://h:9", None, error="refused")],
            [row("m1", True, True), row("m2", True, False)],
        ),
        (  # leader 0: an election in progress
            [A],
            [Answer("http://h:1", "1", "0")],
            [row("m1", True, False)],
        ),
    ],
)
def test_members(listed, answers, expected):
    assert short(members(listed, answers)) == expected


def rows(up: int, total: int, leader: bool = True) -> list[dict]:
    return [{"name": f"m{i}", "endpoint": f"e{i}", "answers": i < up, "leader": leader and i == 0} for i in range(total)]


@pytest.mark.parametrize(
    "up, total, leader, text",
    [
        (3, 3, True, "etcd: 3 of 3 member(s) answer, leader m0"),
        (2, 3, True, "etcd: 2 of 3 member(s) answer, leader m0 (degraded: 0 more loss(es) before etcd stops)"),
        (4, 5, True, "etcd: 4 of 5 member(s) answer, leader m0 (degraded: 1 more loss(es) before etcd stops)"),
        (1, 3, False, "etcd: 1 of 3 member(s) answer, no leader known (no quorum: etcd refuses writes)"),
        (1, 1, True, "etcd: 1 of 1 member(s) answer, leader m0"),
    ],
)
def test_summary(up, total, leader, text):
    assert summary(rows(up, total, leader)) == text


@pytest.fixture(scope="module")
def cluster():
    c = EtcdCluster().start()
    yield c
    c.stop()


def test_a_real_cluster_one_leader_then_a_member_down(cluster):
    options = EtcdOptions(endpoints=tuple(cluster.endpoints))
    up = etcd_members(options)
    assert [(r["name"], r["answers"]) for r in up] == [(m.name, True) for m in cluster.members]
    assert sum(r["leader"] for r in up) == 1 and all(r["version"].startswith("3.5") for r in up)
    leader = next(i for i, r in enumerate(up) if r["leader"])
    victim = (leader + 1) % 3
    cluster.members[victim].crash()
    try:
        down = etcd_members(options)
        assert [r["answers"] for r in down] == [i != victim for i in range(3)], down
        assert down[victim]["error"] and down[victim]["name"] == cluster.members[victim].name
        assert sum(r["leader"] for r in down) == 1
        assert "2 of 3 member(s) answer" in summary(down)
        # only one endpoint given: the others are still listed (from the member list), not asked
        one = etcd_members(EtcdOptions(endpoints=(cluster.endpoints[leader],)))
        assert one[0]["name"] == cluster.members[leader].name and one[0]["leader"]
        assert sorted(r["name"] for r in one) == sorted(m.name for m in cluster.members)
        assert {r["name"]: r["error"] for r in one}[cluster.members[victim].name] == "not asked (not in --rdzv-endpoint)"
    finally:
        cluster.restart(victim)


def test_ctl_status_prints_the_members(cluster):
    endpoints = ",".join(cluster.endpoints)
    cmd = [sys.executable, "-m", "tm_launch.cli", "ctl", "--rdzv-endpoint", endpoints, "--rdzv-id", f"t-{uuid.uuid4().hex[:8]}", "status"]
    done = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    etcd = json.loads(done.stdout)["etcd"]
    assert len(etcd) == 3 and all(r["answers"] for r in etcd) and sum(r["leader"] for r in etcd) == 1
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert "etcd: 3 of 3 member(s) answer, leader tm" in done.stdout, done.stdout + done.stderr


def test_the_v2_api_says_what_the_v3_gateway_says(cluster):
    """The v2 fallback (an etcd without the v3 gateway) names the same members and leader."""
    for endpoint in cluster.endpoints:
        v3, v2 = ask_v3(endpoint, None, 2.0), ask_v2(endpoint, None, 2.0)
        assert (v2.member_id, v2.leader_id) == (v3.member_id, v3.leader_id) and v3.member_id
    assert sorted(listed_v2(cluster.endpoints[0], None, 2.0), key=lambda m: m.id) == sorted(
        listed_v3(cluster.endpoints[0], None, 2.0), key=lambda m: m.id
    )
