"""The loop's own plain variables as per-rank state (``state.loop_variables``): in a function's
frame (CPython 3.11 writes them back with ``PyFrame_LocalsToFast``) and at module level."""

import io
import sys

import pytest
import torch

from tm_launch.worker.state.loop_variables import MAX_NUMEL, LoopVariables, cannot_carry, carriable


@pytest.mark.parametrize(
    "value, ok",
    [
        (3, True),
        (0.5, True),
        ("warm-up", True),
        (None, True),
        ((1, 2.0, "a"), True),
        ({"best": 1.5, "seen": [1, 2]}, True),
        (torch.tensor(7), True),
        (torch.zeros(MAX_NUMEL + 1), False),
        (torch.zeros(3, requires_grad=True), False),  # a loss with its graph: a result, not state
        (torch.nn.Parameter(torch.zeros(2)), False),
        (list(range(5000)), False),
        ([object()], False),
        (print, False),
    ],
)
def test_what_is_carried(value, ok):
    assert carriable(value) is ok


def test_what_cannot_be_carried_is_named():
    f = io.StringIO()
    assert cannot_carry(f) == "an open file"
    assert cannot_carry(torch.zeros(MAX_NUMEL + 1)) == f"a tensor of {MAX_NUMEL + 1} elements"
    assert cannot_carry(list(range(5000))) == "a list of more than 1024 values"
    assert cannot_carry(3) is None and cannot_carry(torch.nn.Linear(1, 1)) is None


def test_a_functions_variables_are_put_back_and_a_list_in_place():
    tokens_seen, best, history = 0, float("inf"), [1.0]
    alias = history
    here = LoopVariables(sys._getframe(), skip=set())
    here.step_begins()
    saved = here.state_dict()
    tokens_seen += 128
    best = 0.25
    history.append(2.0)
    here.load_state_dict(saved)
    assert (tokens_seen, best, history) == (0, float("inf"), [1.0]) and alias is history


def test_a_variable_the_step_rebound_is_rebound_and_its_new_object_left_alone():
    x = torch.zeros(4)  # the batch of the step before
    replayed = torch.ones(4)  # the batch a loader holds to hand to the step that runs again
    here = LoopVariables(sys._getframe(), skip=set())
    here.step_begins()
    saved = here.state_dict()
    x = replayed  # the step's batch
    here.load_state_dict(saved)
    assert torch.equal(x, torch.zeros(4)) and x is not replayed
    assert torch.equal(replayed, torch.ones(4))  # what job.data() replays is untouched


def test_a_variable_the_saved_state_does_not_hold_is_removed():
    here = LoopVariables(sys._getframe(), skip=set())
    saved = here.state_dict()
    late = 5  # first assigned after the state was taken (in a step the lost rank never ran)
    here.load_state_dict(saved)
    assert "late" not in sys._getframe().f_locals
    with pytest.raises(UnboundLocalError):  # the frame's fast local itself was cleared
        print(late)


def test_a_module_level_loop_writes_its_globals(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(
        "import sys\n"
        "from tm_launch.worker.state.loop_variables import LoopVariables\n"
        "tokens = 10\n"
        "here = LoopVariables(sys._getframe(), skip=set())\n"
        "saved = here.state_dict()\n"
        "tokens += 5\n"
        "here.load_state_dict(saved)\n"
        "print(tokens, here.module_level)\n"
    )
    import subprocess

    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["10", "True"]


def test_a_variable_changed_after_the_vote_leaves_a_vote_time_mirror_that_names_it():
    """The loop's variables may move after the vote (a loss kept for logging): a rank taking over
    after the commit gets their vote-time values with a warning naming them, where the RNG moving
    there makes the vote-time mirror inexact (live mode would end)."""
    import pickle

    from tm_launch.worker.state.per_rank import PerRankState

    logged = 0.0
    per_rank = PerRankState(rng=True)
    per_rank.objects["tm:loop"] = LoopVariables(sys._getframe(), skip=set())
    published = []
    for step in range(3):
        per_rank.begin_step(step, lambda *a: published.append(a) or True)
        tag, exact, record = per_rank.vote_mirror(step)
        logged = float(step)  # after the vote
    assert exact and "logged" in pickle.loads(record)["approximate"]
    assert published and all(e for _, e, _ in published)  # each step's exact start, published
    torch.rand(1)  # the RNG moves after a vote too
    per_rank.begin_step(3, lambda *a: True)
    assert per_rank.vote_mirror(3)[1] is False
    assert logged == 2.0
