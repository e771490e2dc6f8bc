"""Fixtures for the worker's parts: a fake world any rank of any size can join, in one process."""

import pytest
import torch.distributed as dist


def forget_dtensor_decisions() -> None:
    """Drop DTensor's cached decisions on this thread: meshes compare by value, so a decision
    cached in one test's world would hand the next one that world's mesh."""
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute._planner_cache.clear()


@pytest.fixture
def fake_world():
    """``join(rank, world, forget=True)``: this process becomes ``rank`` of a fake world of
    ``world`` ranks (torch's ``fake`` backend: any rank, no peers, collectives do nothing);
    ``forget=False`` keeps what DTensor cached before, as a promoted spare does."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def join(rank: int, world: int, forget: bool = True) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        if forget:
            forget_dtensor_decisions()
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())

    yield join
    if dist.is_initialized():
        dist.destroy_process_group()
