"""Tensor parallelism under torch's DDP (``DDP(model, device_mesh=mesh["dp"])``): the parameters
torch's wrapper localizes (``state.ddp_tp``) are carried as the DTensors they stand for.

Built for real in one process on torch's ``fake`` backend (any rank of a 2 x 2 mesh, no peers).
"""

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tm_launch.worker.job.step_guard import StepGuard
from tm_launch.worker.state.ddp_tp import LocalizedTP, localized_parameters
from tm_launch.worker.state.replicas import replica_set

TP_KEYS = {"module.1.weight", "module.1.bias", "module.3.weight", "module.3.bias"}


def build(seed: int = 0):
    """A BatchNorm, an MLP split Colwise/Rowwise over ``tp``, DDP over ``dp``; AdamW over it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(net, mesh["tp"], {"1": ColwiseParallel(), "3": RowwiseParallel()})
    model = DDP(net, device_mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def train_one_step(model, opt):
    """A forward (which moves the TP parameters out of the module) and an optimizer step on
    made-up gradients (the fake backend cannot run DDP's backward)."""
    with torch.no_grad():
        model(torch.randn(4, 8))
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad()


def test_torch_leaves_the_tp_parameters_out_of_the_state_dict_after_a_forward(fake_world):
    """What the adapter is for (if torch fixes its wrapper, this fails and the adapter can go)."""
    fake_world(0, 4)
    model, opt = build()
    assert TP_KEYS <= set(model.state_dict())
    train_one_step(model, opt)
    assert not TP_KEYS & set(model.state_dict())
    assert set(localized_parameters(model)) == TP_KEYS  # found after the forward too, as the optimizer's own


@pytest.mark.parametrize("forward_first", [False, True], ids=["registered-before-a-forward", "after"])
def test_the_replicas_of_a_localized_tp_rank_are_its_dp_peers(fake_world, forward_first):
    want = {0: {0, 2}, 1: {1, 3}, 2: {0, 2}, 3: {1, 3}}
    for rank in range(4):
        fake_world(rank, 4)
        model, opt = build()
        if forward_first:
            train_one_step(model, opt)
        carried, holders = StepGuard(None, None, None, None).guard(model, rank)
        assert isinstance(carried, LocalizedTP) and holders is None
        train_one_step(model, opt)
        state = carried.state_dict()
        assert TP_KEYS <= set(state) and all(hasattr(state[k], "placements") for k in TP_KEYS)
        assert replica_set({"model": state}, {}, rank, 4) == frozenset(want[rank]), rank
        # The optimizer's state follows its parameters: the local ones, whose layout is in _st_info.
        params = [p for g in opt.param_groups for p in g["params"]]
        assert replica_set({"optimizer": [opt.state_dict(), params]}, {}, rank, 4) == frozenset(want[rank]), rank


def test_loading_writes_the_parameters_the_optimizer_trains(fake_world):
    fake_world(1, 4)
    source, source_opt = build(seed=1)
    train_one_step(source, source_opt)
    model, opt = build(seed=2)
    train_one_step(model, opt)
    LocalizedTP(model, localized_parameters(model)).load_state_dict(LocalizedTP(source, localized_parameters(source)).state_dict())
    mine = [p for g in opt.param_groups for p in g["params"]]
    theirs = [p for g in source_opt.param_groups for p in g["params"]]
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    assert torch.equal(model.state_dict()["module.0.running_mean"], source.state_dict()["module.0.running_mean"])
    # The DTensor the forward uses is a view of the trained parameter: it sees the load.
    up = model.module[1].weight
    assert hasattr(up, "to_local") and torch.equal(up.to_local(), localized_parameters(model)["module.1.weight"])


def test_a_module_without_tensor_parallelism_is_carried_as_it_is(fake_world):
    fake_world(0, 2)
    net = torch.nn.Linear(4, 4)
    assert localized_parameters(net) == {}
    assert StepGuard(None, None, None, None).guard(net, 0) == (net, None)
