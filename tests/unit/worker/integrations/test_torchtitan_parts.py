"""tm_launch.torchtitan's pieces on their own (torchtitan's trainer runs end to end in
tests/e2e/test_torchtitan.py): which jobs can be live, what the model's tensors are, the
checkpointer's rules, the data position's reload."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("torchtitan.trainer", reason="torchtitan is not installed (pip install -e '.[torchtitan]': make test-all)")

from tm_launch.worker.integrations.torchtitan import Batches, CommittedCheckpoints, DataPosition, ModelTensors, not_live_reason  # noqa: E402


def config(pp=1, enable=True, async_mode="disabled", replicate=1, shard=-1, tp=1, cp=1, ep=1, schedule="1F1B", csv=""):
    parallelism = SimpleNamespace(
        pipeline_parallel_degree=pp,
        data_parallel_replicate_degree=replicate,
        data_parallel_shard_degree=shard,
        tensor_parallel_degree=tp,
        context_parallel_degree=cp,
        expert_parallel_degree=ep,
        pipeline_parallel_schedule=schedule,
        pipeline_parallel_schedule_csv=csv,
    )
    return SimpleNamespace(parallelism=parallelism, checkpoint=SimpleNamespace(enable=enable, async_mode=async_mode))


@pytest.mark.parametrize(
    "cfg, world, why",
    [
        (config(), 2, None),
        (config(enable=False, async_mode="async"), 2, None),  # no checkpoints: their mode does not matter
        (config(async_mode="async"), 2, "--checkpoint.async-mode async"),
        (config(async_mode="async_with_pinned_mem"), 2, "--checkpoint.async-mode async_with_pinned_mem"),
        # pipeline parallelism: live with each stage on one rank or with replicas of each stage, under a tested schedule
        (config(pp=2), 2, None),  # dp_shard -1 resolves to 1
        (config(pp=2, shard=1), 2, None),
        (config(pp=4, shard=1), 4, None),
        (config(pp=2, replicate=2, shard=1), 4, None),  # each stage's replica: live
        (config(pp=2, replicate=2, shard=1, tp=2), 8, "tensor parallelism 2"),
        (config(pp=2, replicate=2, schedule="ZBVZeroBubble", shard=1), 4, "pipeline schedule ZBVZeroBubble"),
        (config(pp=2, schedule="GPipe"), 2, None),
        (config(pp=2, schedule="Interleaved1F1B"), 2, None),
        (config(pp=2, schedule="InterleavedZeroBubble"), 2, None),
        (config(pp=2), 4, "FSDP sharding 2 of a stage"),  # dp_shard -1 resolves to 2
        (config(pp=2, shard=2), 4, "FSDP sharding 2"),
        (config(pp=2, shard=1, tp=2), 4, "tensor parallelism 2"),
        (config(pp=2, shard=1, cp=2), 4, "context parallelism 2"),
        (config(pp=2, shard=1, ep=2), 2, "expert parallelism 2"),
        (config(pp=2, schedule="ZBVZeroBubble"), 2, "pipeline schedule ZBVZeroBubble (not tested live"),
        (config(pp=2, csv="/tmp/schedule.csv"), 2, "CSV file"),
        (config(pp=2, async_mode="async"), 2, "--checkpoint.async-mode async"),
        (config(tp=2, shard=1), 2, None),  # tensor parallelism without a pipeline: not this rule's
    ],
)
def test_which_torchtitan_jobs_run_live(cfg, world, why):
    reason = not_live_reason(cfg, world, torch_version="2.13.0+cpu")
    assert (reason is None) if why is None else (why in reason), reason


@pytest.mark.parametrize(
    "version, why",
    [("2.13.0+cpu", None), ("2.14.1+cu130", None), ("2.15.0+cu132", "pipeline parallelism on torch 2.15"), ("2.16.0", "torch 2.16")],
)
def test_torchtitans_pipeline_is_live_on_the_torch_releases_tested(version, why):
    reason = not_live_reason(config(pp=2), 2, torch_version=version)
    assert (reason is None) if why is None else (why in reason), reason
    assert not_live_reason(config(), 2, torch_version=version) is None  # without a pipeline: not this rule's


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.register_buffer("kept", torch.arange(2.0))
        self.register_buffer("recomputed", torch.ones(2), persistent=False)
        # a state-dict hook that runs something a recovery must not (torchtitan's is a collective)
        self._register_state_dict_hook(lambda *a: (_ for _ in ()).throw(AssertionError("state_dict() was called")))


def test_model_tensors_are_the_parameters_and_persistent_buffers_loaded_in_place():
    model, other = Model(), Model()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
        other.kept.add_(5.0)
    tensors = ModelTensors(model)
    assert sorted(tensors.state_dict()) == ["kept", "lin.bias", "lin.weight"]
    weight = model.lin.weight
    tensors.load_state_dict(ModelTensors(other).state_dict())
    assert model.lin.weight is weight and torch.equal(weight, other.lin.weight) and torch.equal(model.kept, other.kept)
    assert tensors.parts() == [model]  # carried: its gradients are dropped with an interrupted step's
    with pytest.raises(RuntimeError, match="differ"):
        tensors.load_state_dict({"lin.weight": weight})


@pytest.fixture
def one_rank():
    """A real gloo world of one rank (FSDP2's all-gathers then copy, as at degree 1)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def test_a_stage_a_dropped_step_left_unsharded_returns_to_its_snapshot(one_rank):
    """torchtitan wraps each pipeline stage in FSDP2 (degree 1 too) and, under pipeline
    parallelism, does not reshard after forward: a step dropped after a forward leaves the
    module holding FSDP's plain unsharded copies. A survivor's return to its own snapshot then
    failed (``aten.copy_`` of a DTensor into a plain tensor). Now the model's tensors are the
    sharded parameters whatever FSDP left, and the next forward runs on the snapshot's values,
    not on the unsharded copies of the step the rank returned from."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from tm_launch.worker.snapshots.image import Capture

    torch.manual_seed(0)
    world = init_device_mesh("cpu", (1,), mesh_dim_names=("world",))
    mesh = world._unflatten(0, (1, 1), ("pp", "fsdp"))["fsdp"]  # as torchtitan's ParallelDims builds it
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fully_shard(model[0], mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(3, 4)

    def step():
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    tensors = ModelTensors(model)
    image = Capture(1, {"model": tensors, "optimizer": optimizer}, None, None).copy()
    with torch.no_grad():
        want = model(x)
    step()
    model(x)  # the next step's forward; the step is dropped there
    assert not any(isinstance(p, DTensor) for p in model.parameters())  # FSDP's unsharded copies
    assert all(isinstance(t, DTensor) for t in tensors.state_dict().values())
    model(x)
    image.load_into({"model": tensors, "optimizer": optimizer})
    got = tensors.state_dict()
    assert all(torch.equal(got[n].to_local(), t) for n, t in image.states()["model"].items())
    with torch.no_grad():
        assert torch.equal(model(x), want)


class FakeCheckpointer:
    def __init__(self, tmp_path, enable=True, fail=False):
        self.enable, self.fail, self.tmp = enable, fail, tmp_path
        self.loaded, self.saved = [], []

    def load(self, step=-1):
        self.loaded.append(step)
        return True

    def _should_save(self, step, last_step=False):
        return step % 2 == 0 or last_step

    def _create_checkpoint_id(self, step):
        return str(self.tmp / f"step-{step}")

    def save(self, step, last_step=False):
        if not self._should_save(step, last_step):
            return False
        (self.tmp / f"step-{step}").mkdir()
        self.saved.append(step)
        if self.fail:
            raise EOFError("Ran out of input")  # DCP unpickling a failed step's placeholder
        return True


class Job:
    def __init__(self, in_sandbox=False, step_ok=True):
        self.in_sandbox, self.step_ok = in_sandbox, step_ok


def test_a_spare_neither_loads_nor_saves(tmp_path):
    inner = FakeCheckpointer(tmp_path)
    ckpt = CommittedCheckpoints(inner, Job(in_sandbox=True))
    assert not ckpt.load() and not ckpt.save(2) and inner.loaded == inner.saved == []
    assert ckpt.enable  # everything else is torchtitan's checkpointer's


def test_a_committed_steps_checkpoint_is_written(tmp_path):
    inner = FakeCheckpointer(tmp_path)
    ckpt = CommittedCheckpoints(inner, Job())
    assert ckpt.load(4) and inner.loaded == [4]
    assert ckpt.save(2) and (tmp_path / "step-2").is_dir()


def test_no_checkpoint_in_a_step_whose_collective_failed(tmp_path):
    inner = FakeCheckpointer(tmp_path)
    assert not CommittedCheckpoints(inner, Job(step_ok=False)).save(2) and inner.saved == []


@pytest.mark.parametrize("fail", [False, True], ids=["written", "raised"])
def test_a_checkpoint_a_failure_interrupted_is_removed(tmp_path, fail):
    """The collective failed while the save ran (the job's step_ok turns false under it)."""
    job = Job()
    inner = FakeCheckpointer(tmp_path, fail=fail)
    real_save = inner.save

    def failing_midway(step, last_step=False):
        job.step_ok = False
        return real_save(step, last_step)

    inner.save = failing_midway
    assert not CommittedCheckpoints(inner, job).save(2)
    assert inner.saved == [2] and not (tmp_path / "step-2").exists()


def test_a_save_that_raises_in_a_healthy_step_raises(tmp_path):
    with pytest.raises(EOFError):
        CommittedCheckpoints(FakeCheckpointer(tmp_path, fail=True), Job()).save(2)


def test_a_loaded_data_position_starts_the_batches_again_from_it():
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(list(range(10)), batch_size=2)
    trainer = SimpleNamespace(dataloader=loader, ntokens_seen=0)
    trainer._batches = Batches(lambda: iter(loader))
    position = DataPosition(trainer)
    assert next(trainer._batches).tolist() == [0, 1]
    at_step = position.state_dict()
    trainer.ntokens_seen = 4
    assert next(trainer._batches).tolist() == [2, 3]
    position.load_state_dict(at_step)  # the step runs again
    assert next(trainer._batches).tolist() == [2, 3] and trainer.ntokens_seen == 0
