"""The collective-telemetry page: what a worker writes on each collective, as its agent reads it."""

import types

import pytest

from tm_launch import collective_page
from tm_launch.worker.comms import telemetry as ct


@pytest.fixture
def page_file(tmp_path, monkeypatch):
    path = str(tmp_path / "collectives-0")
    monkeypatch.setenv("TM_TELEMETRY", path)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(ct, "_page", None)
    monkeypatch.setattr(ct, "_opened", False)
    return path


def group(name="tm-world", members=None, generation=1):
    return types.SimpleNamespace(group_name=name, member_ranks=members, generation=generation)


def slots(path):
    view = collective_page.read(path)
    return view, {s.group: s for s in view.slots}


def test_entered_and_completed_are_counted_per_group(page_file):
    w, tp = group(), group("tp", (2, 3))
    a = ct.entered(w, "allreduce")
    b = ct.entered(w, "allreduce")
    c = ct.entered(tp, "_allgather_base")
    ct.completed(a)
    view, s = slots(page_file)
    assert view.rank == 3 and view.pid > 0
    assert (s["tm-world"].entered, s["tm-world"].done, s["tm-world"].pending) == (2, 1, True)
    assert s["tm-world"].members is None and s["tp"].members == (2, 3)
    assert s["tm-world"].t_pending >= s["tm-world"].t_done  # the chain moved: the next one waits from the completion
    ct.completed(b)
    ct.completed(c)
    _, s = slots(page_file)
    assert not s["tm-world"].pending and not s["tp"].pending and s["tp"].typical > 0


def test_p2p_is_counted_apart_and_a_new_communicator_starts_over(page_file):
    g = group()
    ct.completed(ct.entered(g, "allreduce"))
    ct.completed(ct.entered(g, "send"))
    _, s = slots(page_file)
    assert (s["tm-world"].entered, s["tm-world"].p2p_entered, s["tm-world"].p2p_done) == (1, 1, 1)
    g.generation = 2
    old = ct.entered(g, "allreduce")
    _, s = slots(page_file)
    assert (s["tm-world"].generation, s["tm-world"].entered) == (2, 1)
    g.generation = 3
    ct.entered(g, "barrier")
    ct.completed(old)  # settles after the swap: it says nothing of the new communicator
    _, s = slots(page_file)
    assert (s["tm-world"].generation, s["tm-world"].done) == (3, 0)


def test_the_commit_vote_is_a_group_of_the_world(page_file):
    ct.vote_done(ct.vote_entered(4, 5))
    view, s = slots(page_file)
    assert s[collective_page.COMMIT_GROUP].done == 1 and view.rank == 5


def test_without_a_page_nothing_is_recorded(monkeypatch):
    monkeypatch.delenv("TM_TELEMETRY", raising=False)
    monkeypatch.setattr(ct, "_page", None)
    monkeypatch.setattr(ct, "_opened", False)
    assert ct.entered(group(), "allreduce") is None
    ct.completed(None)


def test_a_member_list_too_long_is_written_as_unknown():
    raw = collective_page.describe("big", range(200))
    assert len(raw) <= collective_page.DESC and b'"m": []' in raw


def test_a_checkpoint_save_is_marked_on_the_page_and_nested_saves_count_once(page_file):
    with ct.checkpointing():
        started = collective_page.read(page_file).saving_since
        assert started > 0
        with ct.checkpointing():  # a framework's save inside the script's own
            assert collective_page.read(page_file).saving_since == started
        assert collective_page.read(page_file).saving_since == started
    view = collective_page.read(page_file)
    assert view.saving_since == 0.0 and view.saved_at > started  # the rank's idle time counts from the save's end
    with pytest.raises(OSError), ct.checkpointing():
        raise OSError("disk full")
    assert collective_page.read(page_file).saving_since == 0.0  # a failed save ends the mark too


def test_the_main_threads_moves_are_counted_and_its_place_named(page_file):
    """The position sampler: Python code that runs moves the count, a sleep does not; the place
    is the innermost frame of this file (the script's), not the standard library's."""
    import time

    ct.entered(group(), "allreduce")  # opens the page, starts the sampler

    def forward(x):
        return sum(range(x))

    def backward(x):
        return sum(range(x, 0, -1))

    def spin_here(seconds):  # an evaluation loop: calls into layers (a tight loop on one line would not move)
        end, n = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            n += forward(200) - backward(200)
        return collective_page.read(page_file)

    before = spin_here(1.5)
    assert before.moves >= 2
    assert before.where.split(" at ")[0] in ("spin_here()", "forward()", "backward()"), before.where
    time.sleep(1.5)
    after = collective_page.read(page_file)
    # at most the changes out of spin_here's last sample: into the page read, then into the sleep
    # (the spinning above moved it every sample)
    assert after.moves - before.moves <= 2
    assert after.where.startswith("test_the_main_threads_moves_are_counted_and_its_place_named() at test_telemetry.py:"), after.where


def test_the_collective_timeout_goes_on_the_page(page_file):
    ct.collective_timeout(1800.0)
    assert collective_page.read(page_file).timeout == 1800.0
