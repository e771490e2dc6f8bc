import dataclasses

import pytest

from health.config import HealthConfig

SIMPLE_TYPES = (bool, int, float, str, list[int])


def test_every_field_has_default_simple_type_and_help():
    cfg = HealthConfig()
    for f in dataclasses.fields(HealthConfig):
        assert f.type in SIMPLE_TYPES, f.name
        assert f.metadata.get("help"), f.name
        assert "\n" not in f.metadata["help"], f.name
        value = getattr(cfg, f.name)
        if f.type == list[int]:
            assert isinstance(value, list) and all(type(v) is int for v in value)
        else:
            assert type(value) is f.type, f.name


def test_list_defaults_are_not_shared():
    a, b = HealthConfig(), HealthConfig()
    a.fatal_xids.append(1)
    assert 1 not in b.fatal_xids


def test_issue_defaults():
    cfg = HealthConfig()
    assert (cfg.nvml, cfg.poll_interval, cfg.hang_timeout) == (True, 5.0, 0.0)
    assert (cfg.straggler, cfg.straggler_z, cfg.straggler_ratio) == (True, 3.5, 1.2)
    assert (cfg.straggler_need, cfg.straggler_of) == (3, 5)
    assert cfg.straggler_mad_floor == 0.01


def test_from_dict_sets_and_coerces():
    cfg = HealthConfig.from_dict({"poll_interval": 2, "nvml": False, "ignored_xids": [13, 45], "repeat_count": 4.0, "hang_timeout": 30})
    assert cfg.poll_interval == 2.0 and type(cfg.poll_interval) is float
    assert cfg.nvml is False
    assert cfg.ignored_xids == [13, 45]
    assert cfg.repeat_count == 4 and type(cfg.repeat_count) is int
    assert cfg.hang_timeout == 30.0
    assert HealthConfig.from_dict(None) == HealthConfig()
    assert HealthConfig.from_dict({}) == HealthConfig()


def test_round_trip():
    cfg = HealthConfig(poll_interval=1.5, fatal_xids=[79])
    assert HealthConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "d, message",
    [
        ({"poll_intervall": 1}, "health.poll_intervall: unknown key; did you mean 'poll_interval'?"),
        ({"hang-timeout": 1}, "health.hang-timeout: unknown key; did you mean 'hang_timeout'?"),
        ({"zzz": 1}, "health.zzz: unknown key"),
        ({"nvml": "yes"}, "health.nvml: expected true or false, got 'yes'"),
        ({"nvml": 1}, "health.nvml: expected true or false, got 1"),
        ({"repeat_count": True}, "health.repeat_count: expected an integer, got True"),
        ({"repeat_count": 2.5}, "health.repeat_count: expected an integer, got 2.5"),
        ({"poll_interval": "5s"}, "health.poll_interval: expected a number, got '5s'"),
        ({"poll_interval": False}, "health.poll_interval: expected a number, got False"),
        ({"fatal_xids": 79}, "health.fatal_xids: expected a list of integers, got 79"),
        ({"fatal_xids": [79, "48"]}, "health.fatal_xids: expected a list of integers, got item '48'"),
        ({"fatal_xids": [True]}, "health.fatal_xids: expected a list of integers, got item True"),
        ({"poll_interval": 0}, "health.poll_interval: must be > 0, got 0.0"),
        ({"hang_floor": -1}, "health.hang_floor: must be >= 0, got -1.0"),
        ({"straggler_of": 0}, "health.straggler_of: must be >= 1, got 0"),
        ({"straggler_need": 6}, "health.straggler_need: must be <= straggler_of (5), got 6"),
    ],
)
def test_from_dict_errors_are_one_line(d, message):
    with pytest.raises(ValueError) as e:
        HealthConfig.from_dict(d)
    assert str(e.value) == message
    assert "\n" not in str(e.value)


def test_not_a_mapping():
    with pytest.raises(ValueError, match=r"^health: expected a mapping, got list$"):
        HealthConfig.from_dict([1])
