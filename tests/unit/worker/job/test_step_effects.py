"""``step_effects``: how many optimizer steps a step has, and the copy a multi-effect step rolls
back to; ``StepCommit.next_vote``: a later optimizer step's own vote (a real store)."""

import torch
import torch.distributed as dist

from tm_launch.worker.generation.commit import StepCommit
from tm_launch.worker.job.step_effects import EffectCount, StartOfStep


def test_the_count_is_the_most_any_step_had():
    count = EffectCount()
    assert not count.several
    for per_step in (1, 2, 1):  # a discriminator updated every other step
        count.start()
        for _ in range(per_step):
            count.applied()
    assert count.expected == 2 and count.several


def test_the_ordinary_step_is_never_several():
    count = EffectCount()
    for _ in range(5):
        count.start()
        count.applied()
    assert not count.several


def test_restore_puts_back_parameters_buffers_optimizer_and_scheduler_state_bitwise():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def train():
        model(torch.randn(8, 4)).square().sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()

    train()
    objects = {"model": model, "opt": opt, "sched": sched}
    before = {n: o.state_dict() for n, o in objects.items()}
    before = {"model": {k: v.clone() for k, v in before["model"].items()}, "opt": str(before["opt"]), "sched": before["sched"]}
    copy = StartOfStep()
    copy.take(objects)
    train()  # the effects the rollback undoes
    assert not torch.equal(model[0].weight, before["model"]["0.weight"])
    copy.restore(objects)
    assert not copy.held
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before["model"].items())
    assert str(opt.state_dict()) == before["opt"]
    assert sched.state_dict() == before["sched"] and opt.param_groups[0]["lr"] == before["sched"]["_last_lr"][0]
    train()  # and training goes on from there with the same tensors the optimizer steps
    assert model[0].weight is opt.param_groups[0]["params"][0]


def test_a_later_vote_has_a_key_of_its_own_and_is_forgotten_with_its_step():
    store = dist.HashStore()
    commit = StepCommit()
    commit.use(store, rank=0, world=1, generation=0, abort_store=store)
    for step in range(4):
        commit.begin(step)
        assert commit.decide(True, lambda: False)
        commit.next_vote()
        assert commit.key == f"{step}e1" and commit.decision is None
        assert commit.decide(True, lambda: False)
    assert store.check(["3e1/d"]) and store.check(["2e1/d"])
    # steps 0 and 1 forgotten at the decisions of steps 2 and 3 (rank 0 of 1 forgets every step), their later votes too
    assert not any(store.check([k]) for k in ("0/d", "0e1/d", "1/d", "1e1/d"))
