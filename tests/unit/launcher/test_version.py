"""``tm-launch --version``: the installed package's version and the torch beside it."""

import re
from importlib.metadata import version

from tm_launch import cli


def test_version_names_the_package_and_torch(capsys):
    assert cli.main(["--version"]) == 0
    line = capsys.readouterr().out.strip()
    assert line == f"tm-launch {version('tm-launch')} (torch {version('torch')})"
    assert re.fullmatch(r"tm-launch \d+\.\d+\.\d+\S* \(torch \d+\.\d+\.\d+\S*\)", line)
