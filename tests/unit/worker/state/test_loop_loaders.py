"""A DataLoader the script iterates itself in live mode (``tm_launch.worker.state.loop_loaders``),
in one process with torch's ``DataLoader.__iter__`` routed as live mode routes it: the kind of a
loader (table), a step that runs again replays its batches and its epoch end, a joiner continues
at the lost rank's pass and position without fetching the samples before it, and the global
generator ends where a plain torch loop leaves it. Across processes: ``tests/e2e/test_loop_data_live.py``."""

import gc
import sys
import weakref

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from tm_launch.worker import torch_patches
from tm_launch.worker.state import data_loaders, loop_loaders
from tm_launch.worker.state.data_loaders import DataRefused
from tm_launch.worker.state.loop_variables import LoopVariables
from tm_launch.worker.state.per_rank import PerRankState
from tm_launch.worker.state.transfer import cpu_copy


class Counted(Dataset):
    """Sample i is i; ``fetched`` counts the samples loaded."""

    def __init__(self, n: int):
        self.n, self.fetched = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.fetched += 1
        return torch.tensor([i])


class Stream(IterableDataset):
    def __init__(self, stateful: bool):
        if stateful:
            self.state_dict = lambda: {}
            self.load_state_dict = lambda s: None

    def __iter__(self):
        return iter(range(3))


@pytest.mark.parametrize(
    "make, want",
    [
        (lambda d: DataLoader(d, batch_size=2, sampler=DistributedSampler(d, 2, 0, shuffle=True)), loop_loaders.SAMPLER),
        (lambda d: DataLoader(d, batch_size=2), loop_loaders.SAMPLER),  # SequentialSampler
        (lambda d: DataLoader(d, batch_size=2, shuffle=True), loop_loaders.REFUSE),  # RandomSampler
        (lambda d: DataLoader(Stream(True), batch_size=2), loop_loaders.STATEFUL_DATASET),
        (lambda d: DataLoader(Stream(False), batch_size=2), loop_loaders.REFUSE),
        (lambda d: DataLoader(Stream(True), batch_size=2, num_workers=2), loop_loaders.REFUSE),
        (lambda d: DataLoader(d, batch_sampler=[[0, 1], [2, 3]]), loop_loaders.LEAVE),  # a batch sampler of its own
    ],
)
def test_direct_kind(make, want):
    kind, why = loop_loaders.direct_kind(make(Counted(12)))
    assert kind == want
    assert (why is None) == (kind in (loop_loaders.SAMPLER, loop_loaders.STATEFUL_DATASET))


class Worker:
    """One live worker's view: torch's DataLoader.__iter__ routed, a per-rank state, a step flag."""

    def __init__(self):
        self.per_rank = PerRankState()
        self.in_step = False
        self.refused = []
        self.loops = loop_loaders.LoopLoaders(lambda: self.per_rank, lambda: self.in_step, self._refuse, print)

    def _refuse(self, refused):
        self.refused.append(str(refused))
        raise SystemExit(3)


@pytest.fixture
def worker():
    w = Worker()
    torch_patches.route_loader_iteration(w.loops.iterate)
    yield w
    torch_patches.undo_all()


def script(loader, sampler, steps, per_epoch, on_step=None):
    """The torchrun loop (``tests/scripts/loop_data.py --loop next``): the batches of ``steps``."""
    it, got = iter(loader), []
    for step in range(steps):
        if on_step:
            on_step(step)
        try:
            batch = next(it)
        except StopIteration:
            sampler.set_epoch(step // per_epoch)
            it = iter(loader)
            batch = next(it)
        got.append(batch.tolist())
    return got


def make(n=12):
    data = Counted(n)
    sampler = DistributedSampler(data, 2, 0, shuffle=True, seed=3)
    return data, sampler, DataLoader(data, batch_size=2, sampler=sampler)  # 3 batches per epoch


def plain(steps):
    """The batches torch's own iterators give (a loader marked owned is left to torch)."""
    _, sampler, loader = make()
    data_loaders.owned.add(loader)
    return script(loader, sampler, steps, 3)


def test_the_routed_loop_hands_out_torchs_batches_and_leaves_the_generator_as_torch_does(worker):
    torch.manual_seed(1)
    want = plain(10)
    rng = torch.get_rng_state()
    torch.manual_seed(1)
    _, sampler, loader = make()
    assert script(loader, sampler, 10, 3) == want
    assert torch.equal(torch.get_rng_state(), rng)
    assert [k for k in worker.per_rank.objects] == ["tm-loop"]


@pytest.mark.parametrize("again", [1, 2, 3, 4, 6])  # mid-epoch, the last batch of an epoch, the first of the next
def test_a_step_that_runs_again_gets_its_first_attempts_batch(worker, again):
    """The step ``again`` runs twice (per-rank state restored at its start), as after a failure
    before its commit: the batches are the fault-free ones, epoch ends included."""
    want = plain(9)
    _, sampler, loader = make()
    it, got, step = iter(loader), [], 0
    ran_again = False
    while step < 9:
        worker.per_rank.begin_step(step, None)
        try:
            batch = next(it)
        except StopIteration:
            sampler.set_epoch(step // 3)
            it = iter(loader)
            batch = next(it)
        if step == again and not ran_again:  # interrupted: the step runs again
            ran_again = True
            worker.per_rank.restore()
            continue
        got.append(batch.tolist())
        step += 1
    assert got == want


@pytest.mark.parametrize("at", [2, 3, 4, 7])
def test_a_joiner_continues_at_the_lost_ranks_pass_and_position_without_fetching_before_it(worker, at):
    """The lost rank's per-rank state at the start of step ``at`` is loaded into a process that ran
    the script from the top (its own iterator, a pass of its own): the next batches are the
    lost rank's, and no sample before the position is fetched."""
    want = plain(9)
    _, sampler, loader = make()
    lost = script(loader, sampler, at, 3)
    state = cpu_copy(worker.per_rank.objects["tm-loop"].state_dict())
    worker.per_rank = PerRankState()  # the joiner: the script from the top
    data, sampler2, loader2 = make()
    it = iter(loader2)  # before job.steps(), as the script does
    worker.per_rank.load({"tm-loop": state})
    got = []
    for step in range(at, 9):
        try:
            batch = next(it)
        except StopIteration:
            sampler2.set_epoch(step // 3)
            it = iter(loader2)
            batch = next(it)
        got.append(batch.tolist())
    assert lost + got == want
    assert data.fetched == 2 * len(got)  # nothing before the position was loaded


def test_for_batch_in_loader_inside_a_step_runs_again_with_the_same_batches(worker):
    def one_step(loader, sampler, step):
        sampler.set_epoch(step)
        return [b.tolist() for b in loader]

    _, s0, l0 = make()
    data_loaders.owned.add(l0)
    want = [one_step(l0, s0, step) for step in range(3)]
    worker.per_rank = PerRankState()
    _, sampler, loader = make()
    got = []
    for step in range(3):
        worker.per_rank.begin_step(step, None)
        sampler.set_epoch(step)
        first = []
        for i, b in enumerate(loader):  # interrupted half-way, then run again
            first.append(b.tolist())
            if i == 1:
                break
        worker.per_rank.restore()
        got.append(one_step(loader, sampler, step))
        assert got[-1][:2] == first
    assert got == want


def test_a_loader_that_cannot_be_exact_is_refused_at_its_first_use_in_a_step(worker):
    data = Counted(8)
    loader = DataLoader(data, batch_size=2, shuffle=True)
    it = iter(loader)
    next(it)  # before job.steps(): torch's own iterator, nothing refused
    worker.in_step = True
    with pytest.raises(SystemExit):
        next(it)
    assert len(worker.refused) == 1 and "RandomSampler" in worker.refused[0] and "\n" not in worker.refused[0]


def test_loaders_job_data_or_a_framework_owns_are_left_to_torch(worker):
    _, _, loader = make()
    torch_patches.keep_rng_across_iterators(loader)
    assert not isinstance(iter(loader), loop_loaders.PassIterator)
    assert not worker.per_rank.objects


def test_refused_lines_are_one_line():
    for make_loader in (lambda d: DataLoader(d, shuffle=True), lambda d: DataLoader(Stream(False))):
        _, why = loop_loaders.direct_kind(make_loader(Counted(4)))
        assert "\n" not in why and isinstance(DataRefused(why), ValueError)


def test_a_loader_a_joiner_first_iterates_after_it_entered_takes_the_lost_ranks_state(worker):
    """Rank 0 alone iterates a second loader (its evaluation), and a joiner in rank 0's place
    reaches it only after entering: the state loaded at entry waits for it."""
    want = plain(6)
    _, sampler, loader = make()
    script(loader, sampler, 2, 3)
    data_eval = Counted(4)
    evaluation = DataLoader(data_eval, batch_size=2)
    [b.tolist() for b in evaluation]
    lost = cpu_copy({name: obj.state_dict() for name, obj in worker.per_rank.objects.items()})
    worker.per_rank = PerRankState()  # the joiner
    _, sampler2, loader2 = make()
    it = iter(loader2)
    worker.per_rank.load(lost)
    assert set(worker.per_rank.objects) == {"tm-loop"} and set(worker.per_rank.pending) == {"tm-loop.1"}
    got = [next(it).tolist() for _ in range(1)]
    assert [b.tolist() for b in DataLoader(Counted(4), batch_size=2)] == [[[0], [1]], [[2], [3]]]
    assert not worker.per_rank.pending
    assert plain(6)[:3] == want[:2] + got


def test_a_batch_drawn_between_two_steps_is_refused(worker):
    """``for batch in loader: step = next(steps)``: the batch comes before the step that would
    run again; refused in one line (before the loop, and inside a step, drawing is fine)."""
    _, _, loader = make()
    it = iter(loader)
    next(it)  # before job.steps()
    worker.loops.between_steps = lambda: True
    with pytest.raises(SystemExit):
        next(it)
    assert len(worker.refused) == 1 and "drawn between two steps of job.steps()" in worker.refused[0]


class Positioned(IterableDataset):
    """An iterable dataset with its own position: its iter() resumes from it, a new epoch starts over."""

    def __init__(self, n: int):
        self.n, self.pos, self.epoch = n, 0, 0

    def __iter__(self):
        while self.pos < self.n:
            self.pos += 1
            yield torch.tensor([self.epoch * 100 + self.pos - 1])

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.pos = 0
        self.epoch = epoch

    def state_dict(self) -> dict:
        return {"pos": self.pos, "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.pos, self.epoch = state["pos"], state["epoch"]


def test_an_iterable_dataset_with_state_runs_again_and_carries_to_a_joiner(worker):
    def loop(loader, dataset, steps, it=None, start=0, on_step=None):
        it, got = (it if it is not None else iter(loader)), []
        for step in range(start, steps):
            if on_step:
                on_step(step)
            try:
                batch = next(it)
            except StopIteration:
                dataset.set_epoch(step // 3)
                it = iter(loader)
                batch = next(it)
            got.append(batch.tolist())
        return got, it

    plain_ds = Positioned(6)
    plain_loader = DataLoader(plain_ds, batch_size=2)
    data_loaders.owned.add(plain_loader)  # torch's own iterators: the fault-free batches
    want, _ = loop(plain_loader, plain_ds, 8)
    ds = Positioned(6)
    loader = DataLoader(ds, batch_size=2)
    first, it = loop(loader, ds, 4)
    worker.per_rank.begin_step(4, None)
    next(it)
    worker.per_rank.restore()  # step 4 runs again
    lost = cpu_copy(worker.per_rank.objects["tm-loop"].state_dict())
    again, _ = loop(loader, ds, 8, it=it, start=4)
    assert first + again == want
    worker.per_rank = PerRankState()  # a joiner at step 4
    ds2 = Positioned(6)
    loader2 = DataLoader(ds2, batch_size=2)
    it2 = iter(loader2)
    worker.per_rank.load({"tm-loop": lost})
    joined, _ = loop(loader2, ds2, 8, it=it2, start=4)
    assert first + joined == want


class _RanAgain(BaseException):
    """What a spare promoted to other ranks raises to run the script again (``RankChanged``)."""


def test_a_script_run_again_from_the_top_leaves_nothing_of_its_first_run_alive(worker):
    """A spare warmed up as rank 1 and promoted to rank 0 runs the script again in the same
    process (``Spare.take_other_ranks``: a fresh ``PerRankState``). Its first run's loader was
    iterated in the loop, so its loop held that run's per-rank state, whose loop variables hold
    the first run's frame: its model and optimizer stayed alive, and the new run's discovery
    (``gc.get_objects()``) found them as state of the joiner's own that no survivor holds ("no
    live rank and no snapshot holds the state of rank(s) [0]", every worker restarted)."""
    first: dict = {}

    def run_once():
        model = torch.nn.Linear(3, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        first.update(model=weakref.ref(model), opt=weakref.ref(opt))
        _, sampler, loader = make()
        it = iter(loader)
        worker.per_rank.objects["tm:loop"] = LoopVariables(sys._getframe(), skip=set())  # Discovery.at_loop_start
        worker.per_rank.begin_step(0, None)
        next(it)
        first["state"] = weakref.ref(worker.per_rank)
        raise _RanAgain()

    with pytest.raises(_RanAgain):
        run_once()
    worker.per_rank = worker.per_rank.fresh()  # TrainingState.forget_script
    gc.collect()
    assert first["state"]() is None and first["model"]() is None and first["opt"]() is None  # nothing left to find
    _, sampler, loader = make()  # the second run iterates its own loader: per-rank state of the new run
    it = iter(loader)
    assert next(it).tolist() == plain(1)[0]
    assert list(worker.per_rank.objects) == ["tm-loop"]


def test_positions_say_where_the_loops_loaders_stand_as_torchs_iterators_count_them(worker):
    """What ``tm-launch rehearse`` compares of a loop's loaders (``~data/<name>``): the batches
    drawn from an iterator's pass, live mode's view and torch's own iterator alike, and the
    sampler's epoch of a loader."""
    _, s0, plain_loader = make()
    data_loaders.owned.add(plain_loader)  # torch's own iterator
    torch_it = iter(plain_loader)
    _, sampler, loader = make()
    sampler.set_epoch(4)
    it = iter(loader)
    for _ in range(2):
        next(torch_it), next(it)
    assert isinstance(it, loop_loaders.PassIterator) and not isinstance(torch_it, loop_loaders.PassIterator)
    got = loop_loaders.positions({"it": it, "torch_it": torch_it, "loader": loader, "plain_loader": plain_loader, "n": 3})
    assert got == {"it": 2, "torch_it": 2, "loader.epoch": 4, "plain_loader.epoch": 0}
