"""The rehearsal's worker side: the state dump (what a rank ends with) and the phase kill points,
in one process (the kill is recorded instead of done)."""

import pickle
import types

import pytest
import torch

from tm_launch.worker import failpoints, phase_faults, rehearsal_dump
from tm_launch.worker.rehearsal_dump import Registry, collect, flatten, object_kind


class Cursor:
    def __init__(self):
        self.position = 3

    def state_dict(self):
        return {"position": self.position, "order": torch.arange(4)}


def model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    m.drift = torch.full((2,), 7.0)  # a plain attribute: state the runtime cannot see
    return m


def test_collect_names_every_registered_tensor_by_role():
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.randn(4, 3)).sum().backward()
    opt.step()
    reg = Registry()
    reg.objects = {"model": (m, False), "optimizer": (opt, False), "data": (Cursor(), True)}
    reg.steps = 5
    d = collect(1, 2, "plain", reg)
    roles = d["roles"]
    assert roles["model/0.weight"] == "param" and roles["model/1.running_mean"] == "buffer"
    assert roles["model/1.num_batches_tracked"] == "buffer"
    assert roles["optimizer/state.0.momentum_buffer"] == "optim"
    assert roles["data/position"] == "data" and d["entries"]["data/position"] == 3
    assert roles["~attr/Sequential.drift"] == "attr" and torch.equal(d["entries"]["~attr/Sequential.drift"], m.drift)
    assert roles["~rng/torch"] == "global-rng"
    assert d["meta"] == {
        "format": 1,
        "rank": 1,
        "world_size": 2,
        "mode": "plain",
        "steps": 5,
        "objects": {"model": "module", "optimizer": "optim", "data": "data"},
        "found": [],
        "effects": 0,  # no step counted its optimizer steps (the steps were set, not run)
    }
    m.drift += 1  # the dump holds copies
    assert torch.equal(d["entries"]["~attr/Sequential.drift"], torch.full((2,), 7.0))


def test_the_dump_holds_what_the_loop_keeps_unregistered():
    """An EMA and a GradScaler the script never registered, found at the loop's first step as
    live mode finds them, and the loop frame's plain variables (``~loop/``)."""
    from torch.optim.swa_utils import AveragedModel

    net = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ema = AveragedModel(net)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    tokens_seen = 96
    reg = Registry()
    reg.objects = {"model": (net, False), "optimizer": (opt, False)}

    def steps():  # as the job's steps(): the frame iterating it is the loop's
        import sys

        reg.discover(sys._getframe().f_back)
        yield 0

    for _ in steps():
        pass
    ema.update_parameters(net)
    d = collect(0, 2, "plain", reg)
    found = {n for n in d["meta"]["found"] if "#" not in n}
    assert found == {"ema", "scaler"}
    assert d["roles"]["ema/n_averaged"] == "buffer" and int(d["entries"]["ema/n_averaged"]) == 1
    assert d["entries"]["scaler/scale"] == 8.0
    assert d["entries"]["~loop/tokens_seen"] == 96 and d["roles"]["~loop/tokens_seen"] == "loop"
    assert scaler is not None and tokens_seen == 96


class Wrapper(torch.optim.Optimizer):
    """A ZeRO-shaped optimizer: its step steps the inner optimizer it holds as ``optim``."""

    def __init__(self, params):
        self.optim = torch.optim.SGD(params, lr=0.1)
        super().__init__(self.optim.param_groups[0]["params"], {"lr": 0.1})

    def step(self, closure=None):
        self.optim.step()


def test_the_dump_counts_every_optimizer_step_of_a_step_registered_or_not():
    """The effects per step come from what ran: a second optimizer the script never registered
    is a second effect (the rehearsal then kills between them), a wrapper stepping its inner
    optimizer is one, a step outside the loop counts nowhere, and the most any step had stands."""
    a, b, c = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    opt_a, opt_b, zero = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1), Wrapper(c.parameters())
    reg = Registry()
    reg.objects = {"model": (a, False), "optimizer": (opt_a, False)}
    from tm_launch.worker import torch_patches

    handle = torch_patches.after_every_optimizer_step(lambda opt, args, kwargs: reg.optimizer_stepped(opt))
    try:
        for p in [*a.parameters(), *b.parameters(), *c.parameters()]:
            p.grad = torch.ones_like(p)
        opt_b.step()  # before the loop: not a step's effect
        reg.start_step()
        opt_a.step()
        assert reg.effects.expected == 1
        reg.start_step()
        zero.step()  # the wrapper and its inner optimizer: one effect
        assert reg.effects.expected == 1
        reg.start_step()
        opt_a.step()
        opt_b.step()  # unregistered, a second effect all the same
        reg.start_step()
        opt_a.step()
        reg.in_loop = False
        opt_b.step()
    finally:
        handle.remove()
    reg.steps = 4
    assert reg.effects.expected == 2 and collect(0, 1, "plain", reg)["meta"]["effects"] == 2


def test_a_framework_loop_without_steps_counts_its_registered_optimizers_as_a_step_s_effects():
    a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    reg = Registry()
    reg.objects = {"a": (a, False), "b": (b, False)}
    reg.objects |= {"opt_a": (torch.optim.SGD(a.parameters(), lr=0.1), False), "opt_b": (torch.optim.SGD(b.parameters(), lr=0.1), False)}
    assert collect(0, 1, "plain", reg)["meta"]["effects"] == 2


def test_collect_saves_a_dtensor_as_its_local_shard():
    class FakeDTensor(torch.Tensor):
        pass

    t = torch.ones(2).as_subclass(FakeDTensor)
    t.to_local = lambda: torch.zeros(1)
    assert torch.equal(flatten({"w": t})["w"], torch.zeros(1))


@pytest.mark.parametrize(
    "value,flat",
    [
        ({"a": {"b": 1, "c": [2, 3]}}, {"a.b": 1, "a.c.0": 2, "a.c.1": 3}),
        ({"f": print}, {"f": "<builtin_function_or_method>"}),  # no repr: it may hold an address
        ({"n": None, "s": "x"}, {"n": None, "s": "x"}),
        ({"rest": pickle.dumps({"loops": {"ready": 3}})}, {"rest.loops.ready": 3}),  # a pickled part, by its keys
        ({"raw": b"\x80not a pickle"}, {"raw": b"\x80not a pickle"}),
    ],
)
def test_flatten(value, flat):
    assert flatten(value) == flat


@pytest.mark.parametrize(
    "obj,per_rank,name,kind",
    [
        (torch.nn.Linear(1, 1), False, "model", "module"),
        (torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1), False, "opt", "optim"),
        (Cursor(), True, "data", "data"),
        (Cursor(), False, "sampler", "data"),
        (Cursor(), False, "counter", "other"),
    ],
)
def test_object_kind(obj, per_rank, name, kind):
    assert object_kind(obj, per_rank, name) == kind


def test_rng_state_is_the_rng_kind():
    from tm_launch.worker.state.per_rank import RNGState

    assert object_kind(RNGState(), True, "rng") == "rng"


@pytest.fixture
def fired(monkeypatch):
    """The phase points' kills, recorded: [(point, rank, step)]."""
    calls = []
    monkeypatch.setattr(failpoints, "reached", lambda name, rank, step: calls.append((name, rank, step)))
    yield calls
    phase_faults.uninstall()


def live_job(rank=1, step=3):
    state = types.SimpleNamespace(step=step)
    return types.SimpleNamespace(rank=rank, state=state, in_sandbox=False, _in_step=True)


def armed(monkeypatch, point, job, rank=1, step=3):
    monkeypatch.setenv("TM_FAILPOINT", f"{point}:{rank}:{step}")
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    reg = Registry()
    reg.objects = {"model": (m, False), "optimizer": (opt, False)}
    assert phase_faults.armed_point() == point
    phase_faults.install(job, reg, point)
    return m, opt


def one_step(m, opt, log=None):
    loss = m(torch.randn(4, 3)).sum()
    loss.backward()
    opt.step()
    if log is not None:
        log.append("collective")
        phase_faults.at_collective()


@pytest.mark.parametrize("point", ["forward", "backward", "optimizer", "after-step"])
def test_each_phase_point_fires_on_its_rank_at_its_step(monkeypatch, fired, point):
    job = live_job()
    m, opt = armed(monkeypatch, point, job)
    one_step(m, opt, log=[])
    assert fired == [(point, 1, 3)]


@pytest.mark.parametrize(
    "change",
    [
        {"rank": 0},  # another rank
        {"step": 2},  # before the step
        {"in_sandbox": True},  # a spare warming up
        {"_in_step": False},  # outside a step
    ],
)
def test_a_phase_point_stays_quiet_elsewhere(monkeypatch, fired, change):
    job = live_job()
    step = change.pop("step", None)
    if step is not None:
        job.state.step = step
    for k, v in change.items():
        setattr(job, k, v)
    m, opt = armed(monkeypatch, "forward", job)
    one_step(m, opt)
    assert fired == []


def test_after_step_without_a_collective_fires_at_the_next_forward(monkeypatch, fired):
    job = live_job()
    m, opt = armed(monkeypatch, "after-step", job)
    one_step(m, opt)
    assert fired == []
    job.state.step = 4
    m(torch.randn(4, 3))
    assert fired == [("after-step", 1, 4)]


def test_nothing_is_armed_without_the_variables(monkeypatch):
    for name in ("TM_FAILPOINT", "TM_REHEARSAL_DUMP", "TM_REHEARSAL_HOLD"):
        monkeypatch.delenv(name, raising=False)
    job = live_job()
    assert rehearsal_dump.arm(job) is job and not hasattr(job, "_tm_rehearsal")
    monkeypatch.setenv("TM_FAILPOINT", "vote:1:3")  # a runtime point: not a phase
    assert phase_faults.armed_point() is None


def test_the_dump_says_where_the_loops_loader_stands():
    """A loader the loop iterates itself: its iterator's position in the pass and its sampler's
    epoch (``~data/``, role data), so that a recovery that left it elsewhere is named."""
    from torch.utils.data import DataLoader, DistributedSampler

    data = [torch.tensor([float(i)]) for i in range(8)]
    sampler = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=1)
    sampler.set_epoch(3)
    loader = DataLoader(data, batch_size=2, sampler=sampler)
    it = iter(loader)
    net = torch.nn.Linear(1, 1)
    reg = Registry()
    reg.objects = {"model": (net, False)}

    def steps():
        import sys

        reg.discover(sys._getframe().f_back)
        yield 0

    for _ in steps():
        next(it)
    d = collect(0, 2, "plain", reg)
    assert d["entries"]["~data/it"] == 1 and d["roles"]["~data/it"] == "data"
    assert d["entries"]["~data/loader.epoch"] == 3 and d["roles"]["~data/loader.epoch"] == "data"


def test_a_script_run_again_from_the_top_leaves_nothing_of_its_first_run_in_the_record():
    """``Discovery.forget`` (a spare promoted to a rank it did not warm up as runs the script
    again): the rehearsal's record drops the first run's objects and loop frame, which kept that
    run's model alive for live mode's discovery to find as the joiner's own."""
    import gc
    import sys
    import weakref

    from tm_launch.worker.job.discovery import Discovery

    first = {}

    def run_once():
        net = torch.nn.Linear(2, 2)
        first["net"] = weakref.ref(net)
        rehearsal_dump.REGISTRY.objects["model"] = (net, False)
        rehearsal_dump.REGISTRY.loop_frame = sys._getframe()

    saved = rehearsal_dump.REGISTRY
    rehearsal_dump.REGISTRY = Registry()
    try:
        run_once()
        gc.collect()
        assert first["net"]() is not None  # held by the record
        Discovery(types.SimpleNamespace()).forget()
        gc.collect()
        assert first["net"]() is None
        assert rehearsal_dump.REGISTRY.objects == {} and rehearsal_dump.REGISTRY.loop_frame is None
    finally:
        rehearsal_dump.REGISTRY = saved


def test_a_joiner_that_entered_at_the_last_step_dumps_the_jobs_steps(tmp_path):
    """A spare promoted after the job's last commit yields only its sandbox's steps: its dump
    counts the committed steps it holds, as the rank it replaced would have."""
    saved = rehearsal_dump.REGISTRY
    rehearsal_dump.REGISTRY = Registry()
    try:
        rehearsal_dump.REGISTRY.steps = 2  # its warm-up steps in the sandbox
        job = types.SimpleNamespace(in_sandbox=False, rank=0, world_size=2, state=types.SimpleNamespace(step=10))
        rehearsal_dump._dump_at_exit(job, str(tmp_path))
        assert torch.load(tmp_path / "rank0.pt", weights_only=False)["meta"]["steps"] == 10
    finally:
        rehearsal_dump.REGISTRY = saved
