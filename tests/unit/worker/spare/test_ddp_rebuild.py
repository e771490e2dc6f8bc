"""ddp_rebuild: one step and the rebuild leave DDP as two steps would, two steps a static graph
as three would (real DDP, one gloo rank); which DDPs have first-step work left (a table)."""

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tm_launch.worker.spare.ddp_rebuild import first_step_work_left, settle_now


@pytest.fixture
def world():
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def ddp(**kwargs) -> DistributedDataParallel:
    """Three layers of different sizes, one bucket each once rebuilt (in backward order, the
    reverse of parameter order): a layout that visibly changes at the rebuild."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Linear(512, 8), torch.nn.Linear(8, 300))
    return DistributedDataParallel(model, bucket_cap_mb=0.01, **kwargs)


def step(model: DistributedDataParallel) -> None:
    model(torch.ones(4, 64)).sum().backward()


def rebuilt(model: DistributedDataParallel) -> bool:
    """Whether ``settle_now`` rebuilt ``model`` (other tests' DDPs may still be alive)."""
    before = model._has_rebuilt_buckets
    settle_now()
    return model._has_rebuilt_buckets and not before


def settled(model: DistributedDataParallel) -> bool:
    return all(d is not model for d in settle_now())


def layout(model: DistributedDataParallel) -> list[int]:
    return [b.buffer().numel() for b in model.reducer._get_zeros_like_grad_buckets()]


def test_one_step_and_the_rebuild_lay_buckets_out_as_two_steps(world):
    two_steps = ddp()
    step(two_steps)
    step(two_steps)
    one_step = ddp()
    step(one_step)
    before = layout(one_step)
    assert rebuilt(one_step) and not rebuilt(two_steps)
    assert layout(one_step) == layout(two_steps) != before
    step(one_step)  # the second forward finds nothing to do: no broadcast
    assert layout(one_step) == layout(two_steps)
    assert not one_step.reducer._rebuild_buckets()


def test_a_ddp_the_script_never_registered_is_found(world):
    held = {"model": ddp()}  # e.g. a framework's wrapper, out of the runtime's sight
    step(held["model"])
    assert rebuilt(held["model"])


def test_nothing_to_rebuild_before_a_backward_or_without_one(world):
    fresh = ddp()
    assert not rebuilt(fresh)
    unused = ddp(find_unused_parameters=True)  # DDP never rebuilds these (torch's rule)
    step(unused)
    assert not rebuilt(unused)
    step(fresh)
    assert rebuilt(fresh)


def test_after_the_sandboxs_freeze_a_ddp_leaves_the_collector_little_to_scan():
    """A promoted spare's collection and its scan for DDP instances see only what was built
    after ``freeze_what_exists``: building a DDP must not bring tens of thousands of objects into
    their sight (its constructor imports torch._dynamo: ~50,000 objects unless imported first)."""
    code = (
        "import gc, torch, torch.distributed as dist\n"
        "from tm_launch.worker.spare.sandbox import freeze_what_exists\n"
        "freeze_what_exists()\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "before = len(gc.get_objects())\n"
        "ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))\n"
        "ddp(torch.ones(2, 4)).sum().backward()\n"
        "print(len(gc.get_objects()) - before)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) < 2000, out.stdout


def test_a_static_graph_settles_after_two_steps_as_three_would_leave_it(world):
    """A static graph's first backward records the graph and no gradient order: its rebuild
    (and broadcast) comes in the third forward; two steps and the rebuild leave that layout."""
    options = {"static_graph": True, "gradient_as_bucket_view": True}
    three_steps = ddp(**options)
    for _ in range(3):
        step(three_steps)
    two_steps = ddp(**options)
    step(two_steps)
    assert not settled(two_steps)  # one step: nothing to rebuild yet, another step needed
    step(two_steps)
    before = layout(two_steps)
    assert settled(two_steps) and two_steps._has_rebuilt_buckets
    assert layout(two_steps) == layout(three_steps) != before
    step(two_steps)  # the third forward finds nothing to do: no broadcast
    assert layout(two_steps) == layout(three_steps) and not two_steps.reducer._rebuild_buckets()


def test_a_ddp_that_never_rebuilds_is_settled_at_once(world):
    unused = ddp(find_unused_parameters=True)
    assert settled(unused)
    step(unused)
    assert settled(unused) and not unused._has_rebuilt_buckets


@pytest.mark.parametrize(
    "python_reducer, delay_all_params, static_graph, find_unused, rebuilt, left",
    [
        (False, False, False, False, False, True),  # plain DDP before its rebuild
        (False, False, False, False, True, False),  # plain DDP rebuilt
        (False, False, True, False, False, True),  # static graph before its rebuild (two backwards)
        (False, False, True, False, True, False),
        (False, False, False, True, False, False),  # find_unused_parameters: never rebuilds
        (False, False, True, True, False, True),  # ... unless the graph is static
        (True, False, False, False, False, False),  # the Python reducer: no C++ rebuild
        (False, True, False, False, False, False),  # every parameter's reduction delayed
    ],
)
def test_first_step_work_left(python_reducer, delay_all_params, static_graph, find_unused, rebuilt, left):
    got = first_step_work_left(
        python_reducer=python_reducer,
        delay_all_params=delay_all_params,
        static_graph=static_graph,
        find_unused=find_unused,
        rebuilt=rebuilt,
    )
    assert got is left
