"""tm_launch.lightning's pure parts: which loops can be live, and train loaders resumed mid-epoch."""

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("lightning")

from tm_launch.worker.integrations.lightning import not_live_reason, resumable  # noqa: E402


def _trainer(epoch=0, processed=0):
    progress = SimpleNamespace(current=SimpleNamespace(processed=processed))
    return SimpleNamespace(current_epoch=epoch, fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)))


def _firsts(loader):
    return [int(batch[0][0]) for batch in loader]


@pytest.mark.parametrize(
    "automatic, accumulate, live",
    [
        (True, 1, True),
        (False, 1, False),  # manual optimization: forward and backward run outside optimizer_step
        (True, 4, False),  # a step's earlier micro-batches would be lost on a joiner
    ],
)
def test_which_lightning_loops_can_be_live(automatic, accumulate, live):
    trainer = SimpleNamespace(lightning_module=SimpleNamespace(automatic_optimization=automatic), accumulate_grad_batches=accumulate)
    assert (not_live_reason(trainer) is None) == live


@pytest.mark.parametrize(
    "saved_epoch, batches, expected",
    [
        (2, 3, [6, 8, 10, 12, 14, 16, 18]),  # mid-epoch: the first 3 batches are left out, once
        (2, 0, list(range(0, 20, 2))),  # at the epoch's start: nothing to leave out
        (2, 10, list(range(0, 20, 2))),  # saved at the epoch's end: the next epoch starts whole
        (1, 3, list(range(0, 20, 2))),  # saved in an earlier epoch: not this epoch's position
    ],
)
def test_a_resumed_loader_skips_the_batches_used_this_epoch_once(saved_epoch, batches, expected):
    loader = resumable(DataLoader(TensorDataset(torch.arange(20)), batch_size=2), _trainer(epoch=2))
    loader.load_state_dict({"epoch": saved_epoch, "batches": batches})
    assert len(loader) == 10  # Lightning counts the batches left out as done
    assert _firsts(loader) == expected
    assert _firsts(loader) == list(range(0, 20, 2))  # the next epoch is whole


def test_a_resumable_loader_reports_the_batches_processed_this_epoch():
    loader = resumable(DataLoader(TensorDataset(torch.arange(8)), batch_size=2), _trainer(epoch=1, processed=3))
    assert loader.state_dict() == {"epoch": 1, "batches": 3}
    assert type(loader).__name__ == "DataLoader" and isinstance(loader, DataLoader)


def test_a_resumed_loader_continues_the_saved_epochs_order():
    """Lightning starts a resumed run's first iterator before it sets the sampler's epoch: the
    resumed loader sets it, or the rest of the epoch would follow epoch 0's order."""
    from torch.utils.data.distributed import DistributedSampler

    data = TensorDataset(torch.arange(20))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    sampler.set_epoch(2)
    expected = _firsts(DataLoader(data, batch_size=2, sampler=sampler))[3:]
    sampler.set_epoch(0)  # a fresh process's sampler, as Lightning leaves it at that point
    loader = resumable(DataLoader(data, batch_size=2, sampler=sampler), _trainer(epoch=2))
    loader.load_state_dict({"epoch": 2, "batches": 3})
    assert _firsts(loader) == expected


def test_loader_iterators_leave_the_global_rng_alone():
    from tm_launch.worker.torch_patches import keep_rng_across_iterators

    loader = keep_rng_across_iterators(DataLoader(TensorDataset(torch.arange(8)), batch_size=2, shuffle=True))
    before = torch.random.get_rng_state()
    iter(loader)
    assert torch.equal(before, torch.random.get_rng_state())
