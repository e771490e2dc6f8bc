"""The supported torch releases: the warning a worker on another gives, the refusal where live mode's internals are gone."""

import logging
import os
import re

import pytest

from tm_launch.worker import torch_support


@pytest.mark.parametrize(
    "version, release, tested",
    [
        ("2.13.0", "2.13", True),
        ("2.14.1+cu130", "2.14", True),
        ("2.15.0+cu132", "2.15", True),
        ("2.16.0.dev20261201+cpu", "2.16", False),
        ("2.12.1", "2.12", False),
    ],
)
def test_a_release_is_tested_or_named_in_one_warning_line(version, release, tested):
    assert torch_support.release(version) == release
    line = torch_support.warning(version)
    assert (line is None) == tested
    if not tested:
        assert "\n" not in line and version in line and "2.13, 2.14, 2.15" in line


def test_the_tested_releases_are_pyprojects_lower_bound_and_no_upper_one():
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "..", "pyproject.toml")) as f:
        torch_requirement = re.search(r'"torch([^"]*)"', f.read()).group(1)
    assert torch_requirement == f">={torch_support.TESTED[0]}", torch_requirement  # no cap: pip would replace the user's torch


def test_an_untested_torch_warns_once_and_goes_on(caplog):
    log = logging.getLogger("test.torch_support")
    with caplog.at_level(logging.WARNING, logger="test.torch_support"):
        torch_support.check("2.16.0", log)
        torch_support.check("2.14.1", log)
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "2.16.0" in caplog.records[0].getMessage()


def test_an_untested_torch_without_the_internals_live_mode_patches_is_refused(monkeypatch):
    from torch.distributed import distributed_c10d as c10d

    assert torch_support.missing() == []
    monkeypatch.delattr(c10d, "_update_default_pg")
    assert torch_support.missing() == ["torch.distributed.distributed_c10d._update_default_pg"]
    with pytest.raises(SystemExit, match=r"^tm-launch: error: torch 2\.16\.0 lacks .*_update_default_pg.*--no-live$"):
        torch_support.check("2.16.0", logging.getLogger("test.torch_support"))
    torch_support.check("2.14.1", logging.getLogger("test.torch_support"))  # a tested release: nothing to say
