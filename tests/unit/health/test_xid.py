import pytest

from health.alarms import DEGRADED, FATAL, INFO
from health.config import HealthConfig
from health.xid import classify_xid, xid_name

CFG = HealthConfig()
# the fatal column of the checks table in ARCHITECTURE.md
TABLE_FATAL = [46, 48, 62, 64, 74, 79, 95, 109, 110, 119, 120, 136, 140, 143, *range(144, 151), 155, 156, 158]


def test_default_lists_match_the_table_and_are_disjoint():
    assert sorted(CFG.fatal_xids) == sorted(TABLE_FATAL)
    lists = [CFG.fatal_xids, CFG.degraded_xids, CFG.repeat_xids, CFG.ignored_xids]
    seen = set()
    for xs in lists:
        assert not seen & set(xs)
        seen |= set(xs)
    # the table's "degraded when repeating" XIDs repeat, except 45 (see ignored)
    assert {13, 31, 43, 68} <= set(CFG.repeat_xids)


@pytest.mark.parametrize("xid", TABLE_FATAL)
def test_fatal_class(xid):
    assert classify_xid(xid, CFG) == FATAL
    assert classify_xid(xid, CFG, recent_count=10) == FATAL


@pytest.mark.parametrize("xid", [63, 92, 94])
def test_degraded_class(xid):
    assert classify_xid(xid, CFG) == DEGRADED


@pytest.mark.parametrize("xid", [8, 13, 31, 32, 43, 61, 68, 69])
@pytest.mark.parametrize("count, expected", [(1, INFO), (2, INFO), (3, DEGRADED), (7, DEGRADED)])
def test_repeat_class(xid, count, expected):
    assert classify_xid(xid, CFG, recent_count=count) == expected


@pytest.mark.parametrize("xid", [45])
def test_ignored_class(xid):
    assert classify_xid(xid, CFG) is None
    assert classify_xid(xid, CFG, recent_count=100) is None


@pytest.mark.parametrize("xid", [1, 121, 154, 999, 12345])
def test_unknown_is_info(xid):
    assert classify_xid(xid, CFG) == INFO
    assert classify_xid(xid, CFG, recent_count=50) == INFO


@pytest.mark.parametrize(
    "override, xid, count, expected",
    [
        ({"ignored_xids": [79]}, 79, 1, None),  # ignored beats fatal
        ({"fatal_xids": [13]}, 13, 1, FATAL),  # fatal beats repeat
        ({"degraded_xids": [154]}, 154, 1, DEGRADED),
        ({"repeat_count": 2}, 13, 2, DEGRADED),
        ({"repeat_count": 5}, 13, 4, INFO),
        ({"repeat_xids": []}, 13, 9, INFO),
        ({"ignored_xids": []}, 45, 1, INFO),
    ],
)
def test_config_overrides(override, xid, count, expected):
    assert classify_xid(xid, HealthConfig.from_dict(override), count) == expected


def test_names():
    assert xid_name(79) == "XID 79 (GPU has fallen off the bus)"
    assert xid_name(4242) == "XID 4242"
