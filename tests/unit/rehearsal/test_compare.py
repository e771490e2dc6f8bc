"""The rehearsal's comparison and cause classification: pure, on small dumps."""

import pytest
import torch

from tm_launch.rehearsal.compare import (
    CAUSES,
    Difference,
    FileBytes,
    cause_of,
    classify,
    compare_files,
    compare_rank,
    compare_runs,
    describe,
    maybe_unseeded,
    unstable_keys,
)


def dump(steps=4, **entries):
    """A dump as rehearsal_dump writes it: entries given as key=(role, value), "__" for "/"."""
    flat = {k.replace("__", "/"): v for k, (_, v) in entries.items()}
    roles = {k.replace("__", "/"): r for k, (r, _) in entries.items()}
    return {"meta": {"rank": 0, "steps": steps, "objects": {}}, "entries": flat, "roles": roles}


W = torch.arange(4.0)
BASE = {
    "model__0.weight": ("param", W),
    "model__bn.running_mean": ("buffer", torch.zeros(2)),
    "optimizer__state.0.momentum_buffer": ("optim", W / 2),
    "optimizer__state.0.step": ("optim", torch.tensor(4.0)),
    "scheduler__last_epoch": ("sched", 4),
    "rng__torch": ("rng", torch.arange(3, dtype=torch.uint8)),
    "data__generator": ("data", torch.arange(3, dtype=torch.uint8)),
    "~rng__torch": ("global-rng", torch.arange(5, dtype=torch.uint8)),
    "~attr__Sequential.drift": ("attr", torch.ones(2)),
    "~loop__tokens_seen": ("loop", 96),
}


def changed(**changes):
    return dump(**{**BASE, **changes})


CASES = [
    ("identical", {}, []),
    (
        "buffer and the parameters it steered",
        {"model__bn.running_mean": ("buffer", torch.ones(2)), "model__0.weight": ("param", W + 1)},
        ["buffer"],
    ),
    (
        "unregistered global RNG",
        {"~rng__torch": ("global-rng", torch.zeros(5, dtype=torch.uint8)), "model__0.weight": ("param", W + 1)},
        ["rng"],
    ),
    ("registered RNG", {"rng__torch": ("rng", torch.zeros(3, dtype=torch.uint8))}, ["rng"]),
    ("data position", {"data__generator": ("data", torch.zeros(3, dtype=torch.uint8)), "model__0.weight": ("param", W + 1)}, ["data"]),
    (
        "a tensor in a plain attribute",
        {"~attr__Sequential.drift": ("attr", torch.zeros(2)), "model__0.weight": ("param", W + 1)},
        ["unregistered"],
    ),
    (
        "only parameters and optimizer state: something unregistered",
        {"model__0.weight": ("param", W + 1), "optimizer__state.0.momentum_buffer": ("optim", W)},
        ["unregistered"],
    ),
    ("an optimizer step count", {"optimizer__state.0.step": ("optim", torch.tensor(5.0)), "model__0.weight": ("param", W + 1)}, ["steps"]),
    ("a scheduler step count", {"scheduler__last_epoch": ("sched", 5)}, ["steps"]),
    (
        "a loop variable and the parameters it steered (a tokens-seen count driving the learning rate)",
        {"~loop__tokens_seen": ("loop", 104), "model__0.weight": ("param", W + 1)},
        ["loop"],
    ),
    (
        "two causes, most specific first",
        {"~attr__Sequential.drift": ("attr", torch.zeros(2)), "model__bn.running_mean": ("buffer", torch.ones(2))},
        ["buffer", "unregistered"],
    ),
]


@pytest.mark.parametrize("name,changes,causes", CASES, ids=[c[0] for c in CASES])
def test_causes(name, changes, causes):
    verdict = compare_rank(0, dump(**BASE), changed(**changes))
    assert verdict.causes == causes
    assert verdict.equal == (not causes)
    assert {d.key.replace("/", "__") for d in verdict.differences} == set(changes) - {
        k for k, v in changes.items() if torch.equal(torch.as_tensor(v[1]), torch.as_tensor(BASE[k][1]))
    }


def test_steps_that_differ_name_the_step_count():
    verdict = compare_rank(0, dump(steps=4, **BASE), dump(steps=5, **BASE))
    assert verdict.causes == ["steps"] and [d.key for d in verdict.differences] == ["~meta/steps"]


def test_an_object_registered_in_one_run_only():
    extra = dump(**BASE, extra__x=("other", torch.ones(1)))
    verdict = compare_rank(0, dump(**BASE), extra)
    assert [(d.key, d.detail) for d in verdict.differences] == [("extra/x", "only in the run with the fault")]
    assert verdict.causes == ["unregistered"]


@pytest.mark.parametrize(
    "a,b,said",
    [
        (torch.ones(2), torch.ones(2), None),
        (torch.tensor([float("nan")]), torch.tensor([float("nan")]), None),  # bitwise: the same NaN is equal
        (torch.ones(2), torch.tensor([1.0, 1.5]), "max |diff| 0.5"),
        (torch.ones(2), torch.ones(3), "shape (2,) -> (3,)"),
        (torch.ones(2), torch.ones(2, dtype=torch.float64), "dtype torch.float32 -> torch.float64"),
        (torch.tensor([1, 2]), torch.tensor([1, 3]), "1 of 2 elements"),
        (3, 3, None),
        (3, 4, "3 -> 4"),
        ("<function>", "<function>", None),
    ],
)
def test_describe(a, b, said):
    assert describe(a, b) == said


@pytest.mark.parametrize(
    "role,key,cause",
    [
        ("param", "model/0.weight", None),
        ("buffer", "model/bn.num_batches_tracked", "buffer"),
        ("optim", "optimizer/state.0.exp_avg", None),
        ("optim", "optimizer/state.0.step", "steps"),
        ("sched", "scheduler/_step_count", "steps"),
        ("sched", "scheduler/base_lrs.0", None),
        ("other", "lightning/state_dict.w", None),
        ("loop", "~loop/best_loss", "loop"),
        ("data", "~data/it", "data"),
    ],
)
def test_cause_of_one_difference(role, key, cause):
    assert cause_of(Difference(key, role, "max |diff| 1")) == cause


def test_a_loop_variable_is_named_as_the_loop_s_and_suggests_where_to_change_it():
    d = Difference("~loop/tokens_seen", "loop", "96 -> 104")
    assert (d.obj, d.tensor) == ("the loop's variables", "tokens_seen")
    title, suggestion = CAUSES[cause_of(d)]
    assert "loop that runs job.steps()" in title and "before the step's first optimizer step" in suggestion


def test_a_loop_loader_at_another_position_is_named_as_the_loop_s_loader_and_its_data_position():
    d = Difference("~data/it", "data", "5 -> 1")
    assert (d.obj, d.tensor) == ("the loop's data loaders", "it")
    title, suggestion = CAUSES[cause_of(d)]
    assert "data position" in title and "DistributedSampler" in suggestion and "job.data(loader)" in suggestion


def test_classify_nothing():
    assert classify([]) == []


def test_a_rank_without_state_is_named():
    verdicts = compare_runs({0: dump(**BASE), 1: dump(**BASE)}, {0: dump(**BASE)})
    assert [v.equal for v in verdicts] == [True, False]
    assert "no state written" in verdicts[1].missing


def test_keys_that_differ_without_a_fault_are_left_out():
    noisy = changed(**{"~rng__torch": ("global-rng", torch.zeros(5, dtype=torch.uint8))})
    unstable = unstable_keys({0: dump(**BASE)}, {0: noisy})
    assert unstable == {"~rng/torch"}
    assert compare_rank(0, dump(**BASE), noisy, unstable).equal


def test_generators_the_script_may_never_have_seeded_can_be_left_out():
    """A registered RNGState's Python and numpy generators start from OS entropy unless seeded:
    without a control run they are left out; they name the RNG when they count."""
    base = dump(**BASE, rng__python=("rng-os", 5))
    other = dump(**BASE, rng__python=("rng-os", 6))
    assert maybe_unseeded({0: base}) == {"rng/python"}
    assert compare_rank(0, base, other, maybe_unseeded({0: base})).equal
    assert compare_rank(0, base, other).causes == ["rng"]


def _progress(**counts):
    """A Lightning-style progress tracker in a framework checkpoint ("other" role), flattened."""
    return dump(**{f"lightning__rest.loops.fit_loop.batch_progress.total.{k}": ("other", v) for k, v in counts.items()})


def test_attempt_counts_a_re_run_raised_are_named_apart_and_fail_nothing():
    ref = _progress(ready=16, started=16, processed=15, completed=15)
    got = _progress(ready=17, started=17, processed=15, completed=15)
    v = compare_rank(1, ref, got)
    assert v.equal and v.causes == []
    assert [d.key.rsplit(".", 1)[1] for d in v.attempts] == ["ready", "started"]


@pytest.mark.parametrize(
    "got",
    [
        pytest.param(dict(ready=17, started=17, processed=16, completed=16), id="a completed count differs: work, not attempts"),
        pytest.param(dict(ready=15, started=15, processed=15, completed=15), id="fewer attempts than the fault-free run"),
        pytest.param(dict(ready=17.0, started=16, processed=15, completed=15), id="not an integer count"),
    ],
)
def test_counts_that_are_not_just_attempts_still_differ(got):
    ref = _progress(ready=16, started=16, processed=15, completed=15)
    v = compare_rank(1, ref, _progress(**got))
    assert not v.equal and v.differences


def test_a_tensor_named_like_an_attempt_count_is_never_one():
    ref = dump(**{"model__x.ready": ("buffer", torch.tensor(1)), "model__x.completed": ("buffer", torch.tensor(1))})
    got = dump(**{"model__x.ready": ("buffer", torch.tensor(2)), "model__x.completed": ("buffer", torch.tensor(1))})
    v = compare_rank(0, ref, got)
    assert not v.equal and v.causes == ["buffer"] and not v.attempts


def test_wall_clock_measurements_are_named_apart_and_the_losses_beside_them_compared():
    def history(loss, runtime):
        return dump(
            **{
                "trainer__rest.trainer_state.log_history.1.train_loss": ("other", loss),
                "trainer__rest.trainer_state.log_history.1.train_runtime": ("other", runtime),
                "trainer__rest.trainer_state.log_history.1.train_samples_per_second": ("other", 1000 / runtime),
            }
        )

    v = compare_rank(0, history(0.5, 50.2), history(0.5, 38.8))
    assert v.equal and [d.key.rsplit(".", 1)[1] for d in v.timings] == ["train_runtime", "train_samples_per_second"]
    v = compare_rank(0, history(0.5, 50.2), history(0.25, 38.8))
    assert not v.equal and [d.key.rsplit(".", 1)[1] for d in v.differences] == ["train_loss"]


def test_a_tensor_named_like_a_timing_is_compared():
    v = compare_rank(0, dump(model__x_runtime=("buffer", torch.ones(1))), dump(model__x_runtime=("buffer", torch.zeros(1))))
    assert not v.equal and not v.timings


# -- the files a run leaves in its working directory ------------------------------------------------


def files(**entries):
    """What ``files.read_files`` returns: entries given as key=value, "__" for "/", "_c_" for ":"."""
    flat = {"~file/" + k.replace("__", "/").replace("_c_", ":"): v for k, v in entries.items()}
    return {"entries": flat, "roles": dict.fromkeys(flat, "file")}


TEXT = FileBytes(6, "a", b"0.125\n")
FILE_CASES = [
    ("identical", {}, [], []),
    ("a value in a checkpoint", {"final.pt_c_seen": 9}, ["~file/final.pt:seen"], ["file final.pt"]),
    ("a tensor in a checkpoint", {"final.pt_c_model.w": torch.ones(2)}, ["~file/final.pt:model.w"], ["file final.pt"]),
    ("a text file", {"loss.txt": FileBytes(6, "b", b"0.126\n")}, ["~file/loss.txt"], ["file loss.txt"]),
    ("a file only one run wrote", {"extra.log": FileBytes(1, "c", b"x")}, ["~file/extra.log"], ["file extra.log"]),
    ("a DCP checkpoint's tensor", {"ckpt__step-8_c_model.w": torch.zeros(2)}, ["~file/ckpt/step-8:model.w"], ["file ckpt/step-8"]),
]
FILES_REF = files(**{"final.pt_c_seen": 8, "final.pt_c_model.w": torch.zeros(2), "loss.txt": TEXT, "ckpt__step-8_c_model.w": torch.ones(2)})


@pytest.mark.parametrize("name,changes,keys,objects", FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_files_that_differ_are_named_with_the_file_as_their_cause(name, changes, keys, objects):
    got = {**FILES_REF["entries"], **files(**changes)["entries"]}
    verdict = compare_files(FILES_REF, {"entries": got, "roles": dict.fromkeys(got, "file")})
    assert [d.key for d in verdict.differences] == keys
    assert [d.obj for d in verdict.differences] == objects
    assert verdict.causes == (["file"] if keys else [])
    assert verdict.equal == (not keys) and verdict.title == "files in the working directory"


def test_files_that_differ_without_a_fault_are_left_out():
    noisy = files(**{"times.log": FileBytes(3, "z", b"2 s")})
    verdict = compare_files(files(**{"times.log": FileBytes(3, "y", b"1 s")}), noisy, frozenset({"~file/times.log"}))
    assert verdict.equal


@pytest.mark.parametrize(
    "a,b,said",
    [
        (TEXT, FileBytes(6, "a", b"0.125\n"), None),
        (TEXT, FileBytes(6, "b", b"0.126\n"), "6 bytes, first difference at byte 4 (line 1)"),
        (FileBytes(4, "a", b"a\nb\n"), FileBytes(6, "b", b"a\nb\nc\n"), "4 -> 6 bytes, first difference at byte 4 (line 3)"),
        (FileBytes(2 << 20, "a"), FileBytes(2 << 20, "b"), "2097152 bytes, contents differ"),
    ],
)
def test_describe_bytes(a, b, said):
    assert describe(a, b) == said


def test_a_working_directory_not_read_is_named():
    assert "not read" in compare_files(None, files()).missing


ONLY_TRAINED = {"model__0.weight": ("param", W + 1), "optimizer__state.0.momentum_buffer": ("optim", W)}


@pytest.mark.parametrize(
    "effects, changes, causes",
    [
        (None, ONLY_TRAINED, ["unregistered"]),
        ("several", ONLY_TRAINED, ["effects", "unregistered"]),  # two optimizers registered: either
        ("between", ONLY_TRAINED, ["effects"]),  # killed between two optimizer steps, every registered object carried
        ("between", {"model__bn.running_mean": ("buffer", torch.ones(2))}, ["buffer"]),  # a specific cause stays specific
        ("between", {}, []),
    ],
)
def test_a_step_with_several_effects_names_them_where_only_trained_state_differs(effects, changes, causes):
    verdict = compare_runs({0: dump(**BASE)}, {0: changed(**changes)}, effects=effects)[0]
    assert verdict.causes == causes
