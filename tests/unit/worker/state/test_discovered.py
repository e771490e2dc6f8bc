"""Training state found without registration (``state.discovered``): what is found, how it is
named, and when each object is copied so that a step that runs again starts from its state."""

import sys

import pytest
import torch
from torch.optim.swa_utils import AveragedModel

from tm_launch.worker.state.discovered import AT_VOTE, START, Rollback, at_failed_vote, copy_policy, find, frame_variables, versions_known


class Counter:
    """A ``Stateful`` the script keeps (torch's protocol: state_dict / load_state_dict)."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def names(found):
    """What was found under a variable's name (objects other tests left alive get ``Type#i``)."""
    return {f.name: f.kind for f in found if "#" not in f.name}


def watched(rollback, name: str):
    return next(w for w in rollback.watched if w.name == name)


def test_what_a_script_keeps_is_found_and_named_by_its_variables():
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    ddp_like = torch.nn.ModuleDict({"module": net})  # holds only the registered model's tensors
    ema = AveragedModel(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    opt_ema = torch.optim.SGD(ema.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    scaler = torch.amp.GradScaler("cpu")
    loss_fn = torch.nn.MSELoss()  # stateless
    counter = Counter()
    trainer = type("Trainer", (), {})()
    trainer.teacher = torch.nn.Linear(4, 1)
    left_out = torch.nn.Linear(2, 2)
    found = find(frame_variables(sys._getframe()), registered=[net, opt], excluded=[left_out])
    assert names(found) == {
        "ema": "module",
        "opt_ema": "optimizer",
        "sched": "scheduler",
        "scaler": "scaler",
        "counter": "stateful",
        "trainer.teacher": "module",
    }
    # ddp_like and loss_fn are in the frame and not found: registered state, no state
    assert all(v is not None for v in (ddp_like, loss_fn, opt_ema, sched, scaler, counter))


def test_a_module_inside_a_found_one_is_its_state_not_an_object_of_its_own():
    teacher = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    inner = teacher[0]
    found = find(frame_variables(sys._getframe()), registered=[])
    assert names(found) == {"teacher": "module"} and inner is teacher[0]


@pytest.mark.parametrize(
    "history, versions, policy",
    [
        ([], True, START),  # nothing seen yet: copy at the start
        ([(False, True)], True, AT_VOTE),  # an EMA: changes after the vote only
        ([(False, False), (False, False)], True, AT_VOTE),  # a frozen teacher
        ([(False, True), (True, True)], True, START),  # once seen changing before a vote
        ([(False, True)], False, START),  # a Stateful: its changes cannot be seen cheaply
    ],
)
def test_when_an_object_is_copied(history, versions, policy):
    assert copy_policy(history, versions) == policy


@pytest.mark.parametrize(
    "policy, changed, action",
    [(START, False, "have"), (START, True, "have"), (AT_VOTE, False, "copy"), (AT_VOTE, True, "lost")],
)
def test_what_a_failed_vote_does(policy, changed, action):
    assert at_failed_vote(policy, changed) == action


def test_versions_see_a_modules_parameters_and_buffers_only():
    assert versions_known(AveragedModel(torch.nn.Linear(2, 2)))

    class Extra(torch.nn.Linear):
        def get_extra_state(self):
            return {"calls": 1}

        def set_extra_state(self, state):
            pass

    assert not versions_known(Extra(2, 2))


def one_step(rollback, model, ema, committed: bool, ema_before_vote: bool = False):
    rollback.begin_step()
    if ema_before_vote:
        ema.update_parameters(model)
    rollback.at_decision(committed)
    if committed:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    if not ema_before_vote:
        ema.update_parameters(model)
    rollback.end_step(committed)


def ema_state(ema):
    return {k: v.clone() for k, v in ema.state_dict().items()}


@pytest.mark.parametrize("ema_before_vote", [False, True], ids=["after-the-vote", "before-the-vote"])
def test_a_step_that_runs_again_starts_from_the_ema_it_started_with(ema_before_vote):
    """An EMA updated after the optimizer step is copied only when a vote fails (it still holds
    the start's value then); one updated before the vote is copied at every step's start.
    Either way the step that runs again finds it as it began."""
    model = torch.nn.Linear(3, 2)
    ema = AveragedModel(model)
    rollback = Rollback(find(frame_variables(sys._getframe()), registered=[model]))
    one_step(rollback, model, ema, True, ema_before_vote)
    assert watched(rollback, "ema").policy == (START if ema_before_vote else AT_VOTE)
    before = ema_state(ema)
    one_step(rollback, model, ema, False, ema_before_vote)  # the vote failed: nothing applied
    assert not rollback.lost
    assert all(torch.equal(before[k], v) for k, v in ema.state_dict().items())
    one_step(rollback, model, ema, True, ema_before_vote)
    assert int(ema.n_averaged) == 2


def test_an_object_that_starts_changing_before_a_failed_vote_ends_live_mode():
    model = torch.nn.Linear(3, 2)
    ema = AveragedModel(model)
    rollback = Rollback(find(frame_variables(sys._getframe()), registered=[model]))
    one_step(rollback, model, ema, True)  # learned: after the vote only
    one_step(rollback, model, ema, False, ema_before_vote=True)
    assert "ema" in rollback.lost


def test_a_stateful_object_is_copied_at_every_start_and_put_back():
    model = torch.nn.Linear(3, 2)
    counter = Counter()
    rollback = Rollback(find(frame_variables(sys._getframe()), registered=[model]))
    for committed in (True, False):
        rollback.begin_step()
        counter.n += 1
        rollback.at_decision(committed)
        rollback.end_step(committed)
    assert counter.n == 1
