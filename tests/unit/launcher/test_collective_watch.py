"""The agent's adapter around the culprit rule: records from a page, and back from the exchange."""

import json
import os
import signal
import subprocess
import sys
import time

from health.culprit import KILL, judge
from tm_launch.collective_page import PageView, SlotView
from tm_launch.launcher.collective_watch import frozen_process, rank_record, record_from_page


def slot(group, entered, done, t_pending, typical=0.01, members=None):
    return SlotView(group, members, 1, entered, done, t_pending, t_pending, t_pending - 0.5, typical, 0, 0, 0.0)


def test_a_record_survives_the_exchange_and_feeds_the_rule():
    now = 100.0
    waiting = PageView(11, 0, (slot("tm-world", 8, 7, now - 3.0),))
    frozen = PageView(12, 1, (slot("tm-world", 7, 7, now - 4.0),))
    exchanged = [
        json.loads(json.dumps(record_from_page(waiting, "a", 0, now, False, 0.05))),
        json.loads(json.dumps(record_from_page(frozen, "b", 1, now, True, 0.05))),
    ]
    records = {d["rank"]: rank_record(d) for d in exchanged}
    assert records[0].groups["tm-world"].waiting == 3.0 and records[1].groups["tm-world"].waiting == 0.0
    assert records[1].idle == 4.0
    v = judge(records, [0, 1], {0: "a", 1: "b"})
    assert (v.action, v.ranks) == (KILL, (1,))


def test_a_stopped_process_is_frozen():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not frozen_process(child.pid)
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.time() + 5
        while not frozen_process(child.pid) and time.time() < deadline:
            time.sleep(0.01)
        assert frozen_process(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not frozen_process(child.pid)


def test_a_saving_rank_is_judged_against_the_checkpoint_limit_after_the_exchange():
    now = 100.0
    waiting = PageView(11, 0, (slot("tm-world", 8, 7, now - 12.0),))
    saving = PageView(12, 1, (slot("tm-world", 7, 7, now - 12.0),), saving_since=now - 11.0)
    exchanged = [
        json.loads(json.dumps(record_from_page(waiting, "a", 0, now, False, 0.05))),
        json.loads(json.dumps(record_from_page(saving, "b", 1, now, False, 0.05))),
    ]
    assert exchanged[1]["saving"] == 11.0 and exchanged[0]["saving"] == 0.0
    records = {d["rank"]: rank_record(d) for d in exchanged}
    assert judge(records, [0, 1], {0: "a", 1: "b"}).action == "wait"  # 11 s of a save: not stuck
    del exchanged[1]["saving"]  # a record from an agent without checkpoint marks: the alive limit
    records = {d["rank"]: rank_record(d) for d in exchanged}
    assert judge(records, [0, 1], {0: "a", 1: "b"}).ranks == (1,)


def test_a_save_that_just_ended_is_activity_not_a_stall():
    """The save ended, the rank has not entered the next collective yet: its time outside
    collectives counts from the save's end (it was replaced in that instant once)."""
    now = 100.0
    waiting = PageView(11, 0, (slot("tm-world", 8, 7, now - 15.0),))
    saved = PageView(12, 1, (slot("tm-world", 7, 7, now - 15.0),), saving_since=0.0, saved_at=now - 0.2)
    records = {
        d["rank"]: rank_record(d)
        for d in (record_from_page(waiting, "a", 0, now, False, 0.05), record_from_page(saved, "b", 1, now, False, 0.05))
    }
    assert records[1].idle == 0.2 and judge(records, [0, 1], {0: "a", 1: "b"}).action == "wait"
