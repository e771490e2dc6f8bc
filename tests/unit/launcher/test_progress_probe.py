"""The progress probe (tm_launch/launcher/progress_probe.py) on real processes: one computing,
one sleeping, one blocked reading a FIFO, one stopped, one whose work is in a child."""

import os
import signal
import subprocess
import sys
import time

import pytest

from health.progress import BUSY, FROZEN, STUCK
from tm_launch.launcher.progress_probe import ProgressProbe

PROGRAMS = {
    "compute": "while True: sum(i * i for i in range(10000))",
    "sleep": "import time; time.sleep(60)",
    "fifo": "import sys; open(sys.argv[1]).read()",
    "child": "import subprocess, sys; subprocess.run([sys.executable, '-c', 'while True: pass'])",
}


@pytest.fixture
def process(tmp_path):
    started = []

    def start(what):
        fifo = str(tmp_path / "fifo")
        if what == "fifo":
            os.mkfifo(fifo)
        p = subprocess.Popen([sys.executable, "-c", PROGRAMS[what], fifo], start_new_session=True)
        started.append(p)
        time.sleep(0.5)  # past the interpreter's start-up
        return p

    yield start
    for p in started:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def watch(pid, seconds):
    probe, end = ProgressProbe(), time.monotonic() + seconds
    while time.monotonic() < end:
        probe.look(pid)
        time.sleep(0.1)
    return probe.judge(pid, seconds)


@pytest.mark.parametrize("what, want", [("compute", BUSY), ("child", BUSY), ("sleep", STUCK), ("fifo", STUCK)])
def test_busy_or_stuck(process, what, want):
    p = process(what)
    kind, still, _ = watch(p.pid, 3.5)
    assert kind == want
    if want == STUCK:
        assert still >= 3.0


def test_a_stopped_process_is_frozen_at_once(process):
    p = process("compute")
    os.kill(p.pid, signal.SIGSTOP)
    try:
        kind, _, _ = watch(p.pid, 0.3)
        assert kind == FROZEN
    finally:
        os.kill(p.pid, signal.SIGCONT)


def test_a_gone_process_is_forgotten():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    probe = ProgressProbe()
    assert probe.look(p.pid) is None and probe.known(p.pid) is None
