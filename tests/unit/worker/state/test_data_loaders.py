"""``job.data(loader)`` (``tm_launch.worker.state.data_loaders``): the position arithmetic (pure, table
tests) and the ``Batches`` wrapper in one process: a step that runs again gets its first attempt's
batch, a joiner continues at the lost rank's epoch and position without fetching the samples
before it, epochs run on with ``set_epoch``, and the global generator ends where the fault-free
run has it. What a rank does across processes (the mirror, the snapshot) is ``per_rank``'s and is
tested end to end in ``tests/e2e/test_data_live.py``."""

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from tm_launch.worker.state import data_loaders as dl
from tm_launch.worker.state.data_loaders import Batches, DataRefused, begin_epoch, kept, loader_kind, next_action, refuse_registered

# -- pure decisions ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "at, cached, iterator_at, exhausted, length, want",
    [
        ((0, 0), False, None, False, 6, "begin"),  # nothing drawn yet: the first epoch starts
        ((0, 3), True, (0, 4), False, 6, "cached"),  # a re-run: its first attempt's batch
        ((0, 3), False, (0, 3), False, 6, "draw"),  # the live iterator stands there
        ((0, 6), False, (0, 6), False, 6, "draw"),  # it does not know yet that the epoch ended
        ((0, 6), False, (0, 6), True, 6, "begin"),  # it ran out: the next epoch
        ((2, 6), False, None, False, 6, "begin"),  # a joiner at an epoch's end: no iterator needed to see it
        ((2, 4), False, None, False, 6, "rebuild"),  # a joiner mid-epoch
        ((2, 4), False, (2, 5), False, 6, "rebuild"),  # back to an older step, its batch no longer kept
        ((2, 4), False, None, False, None, "rebuild"),  # an iterable dataset: its end is found by iterating
        ((1, 0), False, (0, 6), True, None, "begin"),  # a state saved before its epoch began
    ],
)
def test_next_action(at, cached, iterator_at, exhausted, length, want):
    assert next_action(at, cached, iterator_at, exhausted, length) == want


@pytest.mark.parametrize("at, want", [((0, 0), 0), ((3, 0), 3), ((0, 6), 1), ((4, 2), 5)])
def test_begin_epoch(at, want):
    assert begin_epoch(at) == want


@pytest.mark.parametrize(
    "keys, at, want",
    [
        ([("t", 0, 3)], ("t", 0, 4), []),  # the step before: committed, not needed
        ([("t", 0, 3), ("t", 0, 4)], ("t", 0, 3), [("t", 0, 3), ("t", 0, 4)]),  # a re-run of a step drawing two batches
        ([("t", 0, 6)], ("t", 1, 0), []),  # the last batch of the previous epoch
        ([("t", 1, 0)], ("t", 0, 6), [("t", 1, 0)]),  # ordered by epoch first
        ([("u", 0, 3)], ("t", 0, 3), []),  # another lineage (a spare's own warm-up)
    ],
)
def test_kept(keys, at, want):
    assert kept(keys, at) == want


# -- loaders ----------------------------------------------------------------------------------------


class Samples(Dataset):
    """Sample i is a tensor made from i; every fetch is recorded (a joiner must fetch none before its position)."""

    def __init__(self, n=24):
        self.n, self.fetched = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.fetched.append(i)
        return torch.tensor([float(i)])


class Stream(IterableDataset):
    """An iterable dataset with its own position: iter() resumes from it (a state taken after the
    last sample ends at once), and set_epoch() of another epoch starts over."""

    def __init__(self, n=20):
        self.n, self.pos, self.epoch = n, 0, 0

    def __iter__(self):
        while self.pos < self.n:
            self.pos += 1
            yield torch.tensor([float(self.pos - 1 + 1000 * self.epoch)])

    def set_epoch(self, epoch):
        if epoch != self.epoch:
            self.pos = 0
        self.epoch = epoch

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


class Plain(IterableDataset):
    def __iter__(self):
        yield torch.zeros(1)


def sampler_loader(rank=1, workers=0, **kw):
    data = Samples()
    sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=7)
    return DataLoader(data, batch_size=2, sampler=sampler, num_workers=workers, **kw)


def stateful_loader(rank=1, workers=0):
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    data = Samples()
    sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=7)
    return sdl.StatefulDataLoader(data, batch_size=2, sampler=sampler, num_workers=workers)


def stream_loader():
    return DataLoader(Stream(), batch_size=3)


LOADERS = {
    "sampler": sampler_loader,
    "sampler-2-workers": lambda: sampler_loader(workers=2),
    "sampler-no-batching": lambda: DataLoader(Samples(12), batch_size=None, sampler=SequentialSampler(Samples(12))),
    "stateful": stateful_loader,
    "stateful-2-workers": lambda: stateful_loader(workers=2),
    "iterable": stream_loader,
}
# Worker processes start with every epoch and every repositioning (~1-2 s each on a loaded 2-core
# machine): the fast tier runs them in one joiner case each, the rest in the slow tier.
SLOW = pytest.mark.slow


def loaders(fast_workers=False):
    return [pytest.param(n, marks=() if "workers" not in n or fast_workers else SLOW) for n in LOADERS]


@pytest.mark.parametrize(
    "make, want",
    [
        (sampler_loader, dl.SAMPLER),
        (stream_loader, dl.STATEFUL_DATASET),
        (stateful_loader, dl.STATEFUL_LOADER),
    ],
)
def test_loader_kind(make, want):
    assert loader_kind(make()) == want


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda: DataLoader(Samples(), batch_size=2, shuffle=True), "RandomSampler is not a function of (seed, epoch, rank)"),
        (lambda: DataLoader(Plain(), batch_size=2), "Plain has no state_dict()/load_state_dict()"),
        (lambda: DataLoader(Stream(), batch_size=2, num_workers=2), "use torchdata's StatefulDataLoader"),
        (lambda: [1, 2, 3], "not list"),
        (
            lambda: pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader(
                Samples(), batch_size=2, sampler=RandomSampler(Samples())
            ),
            "keeps no state",
        ),
    ],
)
def test_loaders_that_cannot_be_exact_are_refused_in_one_line(make, says):
    with pytest.raises(DataRefused) as e:
        loader_kind(make())
    assert says in str(e.value) and "\n" not in str(e.value)


def test_registering_a_loader_or_sampler_as_state_is_refused_with_the_way_out():
    loader = sampler_loader()
    assert refuse_registered({"model": torch.nn.Linear(1, 1)}) is None
    for obj in (loader, loader.sampler, iter(loader)):
        why = refuse_registered({"data": obj})
        assert "job.data(loader)" in why and "\n" not in why


# -- the wrapper ------------------------------------------------------------------------------------

STEPS = 40  # several epochs of every loader above (6-12 batches each)


def flat(batch):
    return batch.flatten().tolist()


def fault_free(make, steps=STEPS):
    """(batch, epoch, global generator state after the draw) per step, as plain torchrun's loop sees them."""
    torch.manual_seed(0)
    batches = Batches(make(), cached=False)
    return [(flat(next(batches)), batches.epoch, torch.get_rng_state()) for _ in range(steps)]


def live(make, batches=None, start=0, steps=STEPS, rerun=(), joined=None):
    """The live loop: the per-rank machinery's snapshot at each step's start (this object and the
    global generator, as ``RNGState``), a re-run of each step in ``rerun`` from that snapshot."""
    if batches is None:
        torch.manual_seed(0)
        batches = Batches(make())
    seen = []
    for step in range(start, steps):
        batches.step_begins()
        snap, rng = batches.state_dict(), torch.get_rng_state()
        first = flat(next(batches))
        if step in rerun:
            torch.randn(3)  # the interrupted attempt drew more before it failed
            batches.load_state_dict(snap)
            torch.set_rng_state(rng)
            batches.step_begins()
            again = flat(next(batches))
            assert again == first, f"step {step} ran again on another batch"
        seen.append((first, batches.epoch, torch.get_rng_state()))
    return seen


def same(got, want):
    assert [g[:2] for g in got] == [w[:2] for w in want]
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if not torch.equal(g[2], w[2])]
    assert not bad, f"the global generator differs from the fault-free run after steps {bad}"


@pytest.mark.parametrize("name", loaders())
def test_the_live_loop_without_faults_sees_the_fault_free_batches(name):
    want = fault_free(LOADERS[name])
    assert max(w[1] for w in want) >= 2  # several epochs
    same(live(LOADERS[name]), want)


@pytest.mark.parametrize("name", loaders())
def test_a_step_that_runs_again_gets_its_first_batch_at_every_point_of_an_epoch(name):
    want = fault_free(LOADERS[name])
    same(live(LOADERS[name], rerun=set(range(STEPS))), want)


@pytest.mark.parametrize(
    "name, at",
    [(n, at) for n in LOADERS if "workers" not in n for at in (5, 6, 7, 11, 12, 13, 30)]
    + [("sampler-2-workers", 11), ("stateful-2-workers", 5)]
    + [pytest.param(n, at, marks=SLOW) for n in LOADERS if "workers" in n for at in (6, 12, 30)],
)
def test_a_joiner_continues_at_the_lost_ranks_epoch_and_position(name, at):
    """The lost rank's state at the start of step ``at`` (what its mirror holds) loaded into a
    fresh wrapper of a fresh loader that drew warm-up batches of its own: the same batches and
    generator from there on, and no sample fetched before its position (map-style)."""
    make = LOADERS[name]
    want = fault_free(make)
    torch.manual_seed(0)
    lost = Batches(make())
    live(make, lost, steps=at)
    state, rng = lost.state_dict(), torch.get_rng_state()

    loader = make()
    joiner = Batches(loader)
    for _ in range(3):  # its sandbox warm-up
        next(joiner)
    fetched = getattr(loader.dataset, "fetched", None)
    if fetched is not None:
        fetched.clear()
    joiner.load_state_dict(state)
    torch.set_rng_state(rng)
    got = live(make, joiner, start=at)
    same(got, want[at:])
    if fetched is not None and loader.num_workers == 0:
        assert len(fetched) == sum(len(b) for b, _, _ in got), "the joiner fetched samples before its position"


def test_epochs_set_the_samplers_epoch_and_the_epoch_is_told():
    loader = sampler_loader()
    batches = Batches(loader, cached=False)
    epochs = [(next(batches), batches.epoch, batches.index)[1:] for _ in range(13)]
    assert epochs[:7] == [(0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (0, 6), (1, 1)]
    assert epochs[-1] == (2, 1) and loader.sampler.epoch == 2


def test_a_plain_torchrun_loop_keeps_no_batch():
    batches = Batches(sampler_loader(), cached=False)
    for _ in range(20):
        next(batches)
    assert batches._cache == {}


def test_an_empty_epoch_is_one_clear_error():
    batches = Batches(DataLoader(Samples(0), batch_size=2, sampler=SequentialSampler(Samples(0))))
    with pytest.raises(RuntimeError, match="epoch 0 of the loader has no batch"):
        next(batches)
