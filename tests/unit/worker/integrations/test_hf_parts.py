"""tm_launch.huggingface's logging state on its own (the Trainer runs end to end in
tests/e2e/test_frameworks.py and under tm-launch rehearse): a joiner continues the lost rank's
loss sums, put in place when the Trainer's loop has set its own."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from tm_launch.worker.integrations.huggingface import LoggingState  # noqa: E402


def trainer():
    return SimpleNamespace(args=SimpleNamespace(device=torch.device("cpu")))


def loop_starts(t):
    """What ``Trainer._inner_training_loop`` sets before its first step."""
    t._tr_loss, t._total_loss_scalar, t._globalstep_last_logged, t._initial_global_step = torch.tensor(0.0), 0.0, 7, 7


LOST_RANKS = {"_tr_loss": torch.tensor(2.5), "_total_loss_scalar": 0.0, "_globalstep_last_logged": 0, "_initial_global_step": 0}


def test_a_joiner_gets_the_lost_ranks_logging_state_once_its_loop_started():
    t = trainer()
    state = LoggingState(t)
    assert state.state_dict() == {}  # a spare before the loop: nothing yet
    state.load_state_dict(LOST_RANKS)
    assert state.state_dict()["_tr_loss"].item() == 2.5  # what it holds is what it loaded (the per-rank check)
    loop_starts(t)
    state.on_train_begin(None, None, None)
    assert (t._tr_loss.item(), t._globalstep_last_logged, t._initial_global_step) == (2.5, 0, 0)
    t._tr_loss += 1.0  # the loop sums into its own tensor, not into what was received
    assert LOST_RANKS["_tr_loss"].item() == 2.5 and state.state_dict()["_tr_loss"].item() == 3.5


def test_inside_the_loop_a_restore_takes_effect_at_once():
    t = trainer()
    loop_starts(t)
    state = LoggingState(t)
    saved = state.state_dict()
    t._tr_loss += 4.0
    state.load_state_dict(saved)
    assert t._tr_loss.item() == 0.0 and state.pending is None
