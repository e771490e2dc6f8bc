"""The embedded etcd's pure parts: Slurm's node list, the layout every agent computes alike, what an
agent does at start, which dead member is replaced and by whom, and when the agents run it."""

import pytest

from rendezvous.rdzv_conf import UsageError
from tm_launch.launcher.embedded_etcd.decisions import BOOTSTRAP, CLIENT, REPLACE_SELF, Member, on_start, replacement, rounds_apart
from tm_launch.launcher.embedded_etcd.keeper import initial_cluster
from tm_launch.launcher.embedded_etcd.layout import Layout
from tm_launch.launcher.embedded_etcd.service import layout_of, node_list_text, wanted
from tm_launch.launcher.slurm import expand_hostlist


@pytest.mark.parametrize(
    "text, names",
    [
        ("node1", ["node1"]),
        ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
        ("a,b[2,4],c", ["a", "b2", "b4", "c"]),
        ("train-0.train,train-1.train", ["train-0.train", "train-1.train"]),
        (" a , b ", ["a", "b"]),
    ],
)
def test_slurm_hostlists_expand_in_slurms_order(text, names):
    assert expand_hostlist(text) == names


@pytest.mark.parametrize(
    "text, error",
    [
        ("n[1-3", "brackets do not match"),
        ("n1-3]", "brackets do not match"),
        ("n[3-1]", "rising range"),
        ("n[a-b]", "not a number"),
        ("n[1-2],n1", "names a node twice"),
    ],
)
def test_a_malformed_hostlist_is_one_usage_error(text, error):
    with pytest.raises(UsageError, match=error):
        expand_hostlist(text)


def test_the_layout_puts_members_on_the_first_three_nodes_and_every_node_in_the_endpoints():
    lay = Layout(("n1", "n2", "n3", "n4"), port=2379)
    assert lay.first_members == ("n1", "n2", "n3") and lay.size == 3
    assert lay.initial_cluster == "n1=http://n1:2380,n2=http://n2:2380,n3=http://n3:2380"
    assert lay.client_urls == ("http://n1:2379", "http://n2:2379", "http://n3:2379", "http://n4:2379")
    assert lay.node_of(["http://n4:2380"]) == "n4" and lay.node_of(["http://elsewhere:2380"]) is None


def test_a_small_job_has_as_many_members_as_nodes():
    assert Layout(("only",)).first_members == ("only",)
    assert Layout(("a", "b")).size == 2


def test_on_loopback_each_node_has_three_ports_of_its_own():
    lay = Layout(("a", "b", "c"), port=20000, loopback=True)
    assert [(x.host, x.client_port, x.peer_port, x.metrics_port) for x in map(lay.address, lay.nodes)] == [
        ("127.0.0.1", 20000, 20001, 20002),
        ("127.0.0.1", 20003, 20004, 20005),
        ("127.0.0.1", 20006, 20007, 20008),
    ]
    assert lay.node_of(["http://127.0.0.1:20007"]) == "c"


@pytest.mark.parametrize(
    "nodes, names, own",
    [
        (("a", "b"), ["", "b", "host"], "b"),
        (("gpu01", "gpu02"), ["gpu02", "gpu02-77", "x"], "gpu02"),  # Slurm's node name before a spanning node id
        (("train-0.train", "train-1.train"), ["train-1"], "train-1.train"),  # a pod's host name, the list's DNS name
        (("a", "b"), ["c", "d"], None),  # a spare from another allocation: a client only
    ],
)
def test_an_agent_finds_its_own_entry(nodes, names, own):
    assert Layout(nodes).own_node(names) == own


def test_a_layout_needs_nodes_named_once():
    with pytest.raises(ValueError, match="node list"):
        Layout(())
    with pytest.raises(ValueError, match="twice"):
        Layout(("a", "a"))


LAY = Layout(("a", "b", "c", "d", "e"), port=30000, loopback=True)


def member(node, started=True, answering=True):
    address = LAY.address(node)
    return Member(f"id-{node}", node, (address.peer_url,), answering, (address.client_url,) if started else ())


@pytest.mark.parametrize(
    "me, cluster, role",
    [
        ("a", None, BOOTSTRAP),  # no cluster yet: the first three start it
        ("c", None, BOOTSTRAP),
        ("d", None, CLIENT),  # the others wait for it
        (None, None, CLIENT),
        ("c", [member("a"), member("b"), member("c", started=False, answering=False)], BOOTSTRAP),  # a first member that came late
        ("b", [member("a"), member("b", answering=False), member("c")], REPLACE_SELF),  # its previous agent's member
        ("d", [member("a"), member("b"), member("c")], CLIENT),
        ("d", [member("b"), member("c"), member("d", answering=False)], REPLACE_SELF),  # a replacer that came back
    ],
)
def test_what_an_agent_does_at_its_start(me, cluster, role):
    assert on_start(LAY, me, cluster) == role


@pytest.mark.parametrize(
    "members, alive, expected",
    [
        ([member("a"), member("b"), member("c")], {"a", "b", "c", "d"}, None),  # all well
        ([member("a", answering=False), member("b"), member("c")], {"b", "c", "d", "e"}, ("a", "d")),  # the first spare
        ([member("a", answering=False), member("b"), member("c")], {"a", "b", "c", "d"}, None),  # its agent lives: slow, not dead
        ([member("a", answering=False), member("b"), member("c")], {"b", "c"}, None),  # no node to take its place
        ([member("a", answering=False), member("b"), member("c")], {"b", "c", "e"}, ("a", "e")),  # d is gone too
        ([member("b", answering=False), member("c"), member("d")], {"c", "d", "e"}, ("b", "e")),  # the second loss
        # two dead: the first in list order first, one at a time
        ([member("a", answering=False), member("b", answering=False), member("c")], {"c", "d", "e"}, ("a", "d")),
        # a member that was added and never started, its node gone: dead as well
        ([member("b"), member("c"), member("d", started=False, answering=False)], {"b", "c", "e"}, ("d", "e")),
        # a member this job did not place is never touched
        ([member("b"), member("c"), Member("x", "x", ("http://10.0.0.9:2380",), False)], {"b", "c", "d"}, None),
        # a place left empty (the dead one removed, the add refused): the first free node fills it
        ([member("b"), member("c")], {"b", "c", "d", "e"}, (None, "d")),
        ([member("b"), member("c")], {"b", "c"}, None),
    ],
)
def test_which_dead_member_is_replaced_and_by_whom(members, alive, expected):
    got = replacement(LAY, members, alive)
    assert (None if got is None else (got.dead_node, got.by)) == expected
    if got is not None and got.dead is not None:
        assert got.dead in members


def test_a_joining_member_is_told_every_member_by_its_node_name():
    peers = [(LAY.address("b").peer_url,), (LAY.address("c").peer_url,), (LAY.address("d").peer_url,)]
    assert initial_cluster(LAY, peers) == "b=http://127.0.0.1:30004,c=http://127.0.0.1:30007,d=http://127.0.0.1:30010"


@pytest.mark.parametrize(
    "backend, endpoint, nodes, result",
    [
        ("embedded-etcd", "", "a,b,c", True),
        ("etcd-v3", "", "n[1-4]", True),  # no etcd named, under an allocation
        ("etcd-v3", "etcd:2379", "n[1-4]", False),  # the user's own etcd always wins
        ("etcd-v3", "", None, False),  # not under an allocation: the usual error about --rdzv-endpoint
        ("embedded-etcd", "etcd:2379", "a", "give no --rdzv-endpoint"),
        ("embedded-etcd", "", None, "--etcd-nodes"),
    ],
)
def test_when_the_agents_run_the_embedded_etcd(backend, endpoint, nodes, result):
    if isinstance(result, str):
        with pytest.raises(UsageError, match=result):
            wanted(backend, endpoint, nodes)
    else:
        assert wanted(backend, endpoint, nodes) is result


def test_the_node_list_comes_from_the_option_or_from_slurm_under_srun():
    env = {"SLURM_JOB_NODELIST": "gpu[1-3]"}
    assert node_list_text("a,b", True, env) == "a,b"
    assert node_list_text(None, True, env) == "gpu[1-3]"
    assert node_list_text(None, False, env) is None  # the batch script itself, or not Slurm
    assert layout_of("gpu[1-3]", 2379, False).nodes == ("gpu1", "gpu2", "gpu3")
    with pytest.raises(UsageError, match="names a node twice"):
        layout_of("a,a", 2379, False)


def test_nodes_further_down_the_list_look_less_often():
    big = Layout(tuple(f"n{i}" for i in range(1000)))
    assert [rounds_apart(big, f"n{i}") for i in (0, 2, 3, 5, 6, 999)] == [1, 1, 2, 2, 3, 334]
    assert rounds_apart(big, None) == 0 and rounds_apart(big, "elsewhere") == 0
