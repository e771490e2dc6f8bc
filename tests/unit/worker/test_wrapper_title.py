"""``python -m tm_launch.worker``'s process title: ``ps`` shows the worker as torchrun starts it."""

import os
import subprocess
import sys

import pytest

from tm_launch.local.localjob import REPO
from tm_launch.worker.__main__ import title_without_wrapper


@pytest.mark.parametrize(
    "argv, title",
    [
        (["/v/bin/python", "-u", "-m", "tm_launch.worker", "train.py", "--lr", "1"], "/v/bin/python -u train.py --lr 1"),
        (
            ["python", "-u", "-m", "tm_launch.worker", "-m", "torchtitan.train", "--job.config_file", "c.toml"],
            "python -u -m torchtitan.train --job.config_file c.toml",
        ),
        (["python", "-u", "train.py"], None),  # no wrapper: nothing to change
    ],
)
def test_the_title_is_the_command_line_without_the_wrapper(argv, title):
    assert title_without_wrapper(argv) == title


def test_a_wrapped_script_shows_as_python_script_with_the_environment_it_was_given(tmp_path):
    script = tmp_path / "show.py"
    script.write_text("import os; print(open('/proc/self/cmdline').read().rstrip('\\0')); print('SPT_NOENV' in os.environ)\n")
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("SPT_NOENV", None)
    out = subprocess.run(
        [sys.executable, "-u", "-m", "tm_launch.worker", str(script), "a b"], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == [f"{sys.executable} -u {script} a b", "False"]
