"""pipeline_stages: what a schedule's step does with its stages' set-up (a table), and a real
schedule (two stages on one gloo rank) whose set-up, forgotten and redone, changes no number."""

import pytest
import torch
import torch.distributed as dist

from tm_launch.worker.comms.groups import LocalBackend, StepPoison
from tm_launch.worker.spare.pipeline_stages import (
    KEEP,
    REDO,
    SKIP,
    PipelineSteps,
    discard_leftovers,
    drops_failure,
    forget_set_up,
    set_up_decision,
)


@pytest.mark.parametrize(
    "in_sandbox, set_up_at, now, expected",
    [
        (True, None, (0,), SKIP),  # a spare: no neighbours to set up with
        (True, (0,), (1,), SKIP),
        (False, None, (0,), REDO),  # the first step anywhere (or a joiner's)
        (False, (0,), (0,), KEEP),  # nothing changed
        (False, (0,), (1,), REDO),  # its group was rebuilt: a neighbour may be new
        (False, (3, 1), (3, 2), REDO),  # one stage's group of two
        (False, (3, 1), (3, 1), KEEP),
    ],
)
def test_set_up_decision(in_sandbox, set_up_at, now, expected):
    assert set_up_decision(in_sandbox, set_up_at, now) == expected


def test_only_a_poisoned_steps_failure_is_dropped():
    assert drops_failure(True) and not drops_failure(False)


def test_a_local_backends_receive_hands_zeros_not_uninitialised_memory():
    """A poisoned step's receives are served locally: an object's size read from them is 0."""
    buf = torch.full((2,), 7, dtype=torch.long)
    LocalBackend(0, 2).recv([buf], 1, 0).wait()
    assert buf.tolist() == [0, 0]


@pytest.fixture
def world():
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def schedule():
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    torch.manual_seed(0)
    mods = [torch.nn.Linear(6, 6), torch.nn.Linear(6, 4)]
    stages = [PipelineStage(m, i, 2, torch.device("cpu")) for i, m in enumerate(mods)]
    return ScheduleInterleaved1F1B(stages, n_microbatches=2, loss_fn=torch.nn.functional.mse_loss), mods


def grads_after_steps(redo: bool) -> list:
    sched, mods = schedule()
    x, y = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)), torch.randn(4, 4, generator=torch.Generator().manual_seed(2))
    for _ in range(2):
        sched.step(x, target=y, losses=[])
        if redo:
            forget_set_up(sched)
            assert not sched._stages_forward_initialized and not sched._stages_backward_initialized
    return [p.grad.clone() for m in mods for p in m.parameters()]


def test_a_set_up_done_again_changes_no_gradient(world):
    """A survivor beside a joiner redoes its stages' set-up (vote, shapes, buffers) in the step
    that runs again: the gradients are bitwise those of a schedule that kept it."""
    kept, redone = grads_after_steps(False), grads_after_steps(True)
    assert all(torch.equal(a, b) for a, b in zip(kept, redone))


def test_in_the_sandbox_a_schedules_step_does_not_run(world):
    sched, mods = schedule()
    steps = PipelineSteps(in_sandbox=lambda: True, poisoned=lambda: False)
    ran, losses = [], []
    assert steps.around(sched, lambda *a, **k: ran.append(1), losses=losses) is None
    assert ran == [] and [loss.item() for loss in losses] == [0.0, 0.0]  # one per microbatch, as torch fills them


def test_a_failure_is_dropped_only_in_a_poisoned_step(world):
    sched, _ = schedule()

    def fails(*args, **kwargs):
        raise RuntimeError("what a dead neighbour left")

    sched._internal_losses.append(torch.ones(()))  # a microbatch's loss of the step that failed
    abandoned = []
    steps = PipelineSteps(in_sandbox=lambda: False, poisoned=lambda: True, abandon=lambda: abandoned.append(1))
    assert steps.around(sched, fails) is None
    assert sched._internal_losses == []  # the step that runs again starts from none
    assert abandoned == [1]  # its actions left undone: the rank closes its subgroups at its boundary
    with pytest.raises(RuntimeError):
        PipelineSteps(in_sandbox=lambda: False, poisoned=lambda: False, abandon=lambda: abandoned.append(1)).around(sched, fails)
    assert abandoned == [1]


def test_an_abandoned_step_is_forgotten_with_its_poison():
    """``StepPoison.abandon`` marks the poisoned step left part-way until the boundary clears it."""
    poison = StepPoison()
    poison.set(RuntimeError("Connection closed by peer"))
    poison.abandon()
    assert poison.active and poison.abandoned
    poison.clear()
    assert not poison.active and not poison.abandoned


def two_steps(interrupted: bool) -> list:
    """Two steps, gradients zeroed between them; ``interrupted``: the second begins where a
    step that failed part-way left a microbatch's loss in the schedule, then discarded."""
    sched, mods = schedule()
    x, y = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)), torch.randn(4, 4, generator=torch.Generator().manual_seed(2))
    sched.step(x, target=y, losses=[])
    for m in mods:
        m.zero_grad()
    if interrupted:
        out = sched._stages[-1].submod(torch.randn(2, 6, requires_grad=True))
        sched._internal_losses.append(torch.nn.functional.mse_loss(out, torch.zeros(2, 4)))
        discard_leftovers(sched)
    sched.step(x, target=y, losses=[])
    return [p.grad.clone() for m in mods for p in m.parameters()]


def test_a_step_run_again_after_a_part_way_failure_gives_a_clean_steps_gradients(world):
    clean, again = two_steps(False), two_steps(True)
    assert all(torch.equal(a, b) for a, b in zip(clean, again))


def fsdp_two_steps(cut_off: str | None) -> list:
    """Two steps of two FSDP2 stages (``fully_shard`` on a (dp, shard) mesh of 1 x 1, as a
    stage over its replicas) through ``PipelineSteps``, gradients zeroed between them;
    ``cut_off``: the second step first fails in its second microbatch's loss, after the first
    microbatch's backward ran (FSDP holds the stages unsharded, mid-step, their first
    microbatch's gradients on the unsharded parameters), then runs again. ``"dropped"``: the
    step was poisoned, its failure dropped; ``"raised"``: the failure is raised to the loop (the
    first failed collective's own, or the script's, caught by it), and the next step, in the same
    generation, starts where it left."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "shard"))
    mods = [fully_shard(torch.nn.Linear(6, 6), mesh=mesh), fully_shard(torch.nn.Linear(6, 4), mesh=mesh)]
    calls, armed = [0], [False]

    def loss_fn(out, target):
        calls[0] += 1
        if armed[0] and calls[0] == 2:
            raise RuntimeError("a dead neighbour's receive")
        return torch.nn.functional.mse_loss(out, target)

    stages = [PipelineStage(m, i, 2, torch.device("cpu")) for i, m in enumerate(mods)]
    sched = ScheduleInterleaved1F1B(stages, n_microbatches=2, loss_fn=loss_fn)
    poisoned = [False]
    steps = PipelineSteps(in_sandbox=lambda: False, poisoned=lambda: poisoned[0])
    x, y = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)), torch.randn(4, 4, generator=torch.Generator().manual_seed(2))
    steps.around(sched, type(sched).step, x, target=y, losses=[])
    for m in mods:
        m.zero_grad()
    if cut_off:
        calls[0], armed[0], poisoned[0] = 0, True, cut_off == "dropped"
        if cut_off == "dropped":
            assert steps.around(sched, type(sched).step, x, target=y, losses=[]) is None
        else:
            with pytest.raises(RuntimeError, match="dead neighbour"):
                steps.around(sched, type(sched).step, x, target=y, losses=[])
            unsharded = [p._unsharded_param.grad for m in mods for g in m._get_fsdp_state()._fsdp_param_groups for p in g.fsdp_params]
            assert any(g is not None for g in unsharded)  # the first microbatch's, held for the last one's reduction
        armed[0], poisoned[0] = False, False
    steps.around(sched, type(sched).step, x, target=y, losses=[])
    return [p.grad.to_local().clone() for m in mods for p in m.parameters()]


@pytest.mark.parametrize("cut_off", ["dropped", "raised"])
def test_a_stages_fsdp2_state_is_put_back_after_a_step_left_part_way(world, cut_off):
    """A step left in the middle of its backward, FSDP2's stages unsharded and their gradients
    of the microbatches run so far held on the unsharded parameters: its step run again gives a
    clean step's gradients, bitwise, whether the failure was dropped or raised to the loop."""
    clean, again = fsdp_two_steps(None), fsdp_two_steps(cut_off)
    assert len(clean) == len(again) == 4 and all(torch.equal(a, b) for a, b in zip(clean, again))


def test_a_schedules_stage_groups_are_noted_and_snapshots_chosen_again_once(world):
    """Each step notes its stages' groups (who holds other stages, not copies of this rank's);
    the first time they are new, what this rank snapshots is chosen again."""
    sched, _ = schedule()
    noted, chosen = set(), []
    steps = PipelineSteps(
        in_sandbox=lambda: True, poisoned=lambda: False, stage_groups=lambda: noted, on_new_stage_groups=lambda: chosen.append(1)
    )
    for _ in range(2):
        steps.around(sched, lambda *a, **k: None, losses=[])
    assert noted == {frozenset({0})} and chosen == [1]
