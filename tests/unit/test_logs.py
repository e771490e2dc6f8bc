"""Table tests for ``tm_launch.logs``: the lines tm-launch's processes write, one formatter."""

from __future__ import annotations

import io
import logging
import os
import sys
import time

import pytest

from tm_launch import logs

AT = time.mktime((2026, 11, 29, 3, 4, 5, 0, 0, -1)) + 0.0678  # local 03:04:05.067

LINES = [
    pytest.param(
        "tm_launch.launcher.events", logging.INFO, {"node": "n1", "at": AT}, "tm-launch", "[tm-launch n1 03:04:05.067] hello", id="said"
    ),
    pytest.param("tm_launch.cli", logging.ERROR, {}, "tm-launch", "tm-launch: error: hello", id="the command's error"),
    pytest.param("tm_launch.cli", logging.INFO, {}, "tm-launch", "[tm-launch] hello", id="a note"),
    pytest.param("tm_launch.ctl.commands", logging.WARNING, {}, "tm-launch ctl", "tm-launch ctl: warning: hello", id="ctl warning"),
    pytest.param("tm_launch.ctl.commands", logging.ERROR, {}, "tm-launch ctl", "tm-launch ctl: error: hello", id="ctl error"),
    pytest.param("rendezvous.membership", logging.WARNING, {}, "tm-launch", "[tm-launch] WARNING hello", id="a library's warning"),
    pytest.param("health.nvml_monitor", logging.INFO, {}, "tm-launch", "[tm-launch] INFO hello", id="a library's info"),
    pytest.param("tm_launch.worker.agent_client", logging.INFO, {}, "tm-launch worker 3", "[tm-launch worker 3] hello", id="a worker"),
    pytest.param("tm_launch.local.demo", logging.INFO, {}, "demo", "[demo] hello", id="the demo"),
    pytest.param("tm_launchers", logging.INFO, {}, "tm-launch", "[tm-launch] INFO hello", id="a name that only starts alike"),
]


@pytest.mark.parametrize("name, level, extra, prog, want", LINES)
def test_lines(name, level, extra, prog, want):
    record = logging.LogRecord(name, level, __file__, 1, "%s", ("hello",), None)
    record.__dict__.update(extra)
    assert logs.Formatter(prog).format(record) == want


def test_a_process_name_may_change_line_by_line(monkeypatch):
    """A worker's lines carry its rank as it is now (a promoted spare takes another)."""
    formatter = logs.Formatter(lambda: f"tm-launch worker {os.environ.get('RANK', '?')}")
    record = logging.LogRecord("tm_launch.worker.agent_client", logging.INFO, __file__, 1, "hello", (), None)
    monkeypatch.delenv("RANK", raising=False)
    assert formatter.format(record) == "[tm-launch worker ?] hello"
    monkeypatch.setenv("RANK", "5")
    assert formatter.format(record) == "[tm-launch worker 5] hello"


def test_lines_reach_the_current_stderr_once(monkeypatch):
    """Written to ``sys.stderr`` as it is at the time (a benchmark redirects it), once, whatever
    the root logger does; libraries' records only once a process asked for them."""
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        log = logs.logger("tm_launch.test", prog="tm-launch")
        log.info("one")
        logging.getLogger("rendezvous.test").warning("not asked for")
        logs.logger(libraries=logging.WARNING)
        logging.getLogger("rendezvous.test").warning("two")
        logging.getLogger("rendezvous.test").info("below the level")
        log.info("three")
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    lines = [l for l in out.getvalue().splitlines() if "not asked for" not in l]  # lastResort may write it
    assert lines == ["[tm-launch] one", "[tm-launch] WARNING two", "[tm-launch] three"]
