"""tm_launch.worker.job.optimizer_steps: the step of a script that never reports it, from its
optimizers (real torch optimizers, a real checkpoint round trip)."""

import pytest
import torch

from tm_launch.worker.job import optimizer_steps
from tm_launch.worker.job.optimizer_steps import OptimizerSteps, optimizer_step


def _train(optimizer, model, steps: int) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()


@pytest.mark.parametrize(
    "make, own_count",
    [
        pytest.param(lambda ps: torch.optim.AdamW(ps, lr=0.1), True, id="AdamW keeps its step: loaded with a checkpoint"),
        pytest.param(lambda ps: torch.optim.Adam(ps, lr=0.1), True, id="Adam"),
        pytest.param(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), False, id="SGD keeps none: calls counted"),
    ],
)
def test_a_resumed_optimizer_reports_the_global_step_where_it_keeps_one(make, own_count):
    model = torch.nn.Linear(2, 1)
    first = make(model.parameters())
    _train(first, model, 5)
    resumed = make(model.parameters())
    resumed.load_state_dict(first.state_dict())
    reported = []
    hook = OptimizerSteps(reported.append).install()
    try:
        _train(resumed, model, 2)
    finally:
        hook.stop()
    assert reported == ([6, 7] if own_count else [1, 2])
    assert optimizer_step(resumed, 2) == (7 if own_count else 2)


def test_optimizers_stepping_together_are_one_step_and_stop_ends_the_reports():
    a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.Adam(b.parameters(), lr=0.1)
    reported = []
    hook = OptimizerSteps(reported.append).install()
    for _ in range(3):
        _train(opt_a, a, 1)
        _train(opt_b, b, 1)
    assert reported == [1, 1, 2, 2, 3, 3]
    hook.stop()
    _train(opt_a, a, 1)
    assert reported[-1] == 3 and len(reported) == 6


def test_the_script_reporting_its_steps_turns_the_count_off():
    reported = []
    optimizer_steps.install(reported.append)
    try:
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _train(opt, model, 1)
        optimizer_steps.the_script_reports()
        _train(opt, model, 1)
    finally:
        optimizer_steps.the_script_reports()
    assert reported == [1]
