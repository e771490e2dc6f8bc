"""Which phases a rehearsal kills at by default (``rehearsal.main.default_phases``): every phase,
the one between several effects of a step only where a step of the fault-free run took more than
one optimizer step (counted as it ran, every optimizer's, registered or not)."""

import pytest

from tm_launch.rehearsal.main import default_phases, parse
from tm_launch.rehearsal.runs import PHASES, SEVERAL_EFFECTS


def dumps(*effects, kinds=("module", "optim")):
    """One rank's dump meta per count of optimizer steps per step (``rehearsal_dump``'s ``effects``)."""
    return {r: {"meta": {"objects": {f"o{i}": k for i, k in enumerate(kinds)}, "effects": e}} for r, e in enumerate(effects)}


@pytest.mark.parametrize(
    "ranks, kinds, between",
    [
        ((1, 1), ("module", "optim"), False),
        ((1, 1), ("module", "optim", "module", "optim"), False),  # two registered optimizers stepping on alternate steps
        ((2, 2), ("module", "optim", "module", "optim"), True),  # a GAN: two optimizer steps per step
        ((2, 2), ("module", "optim", "module"), True),  # a GAN whose second optimizer is not registered
        ((1, 2), ("module", "optim"), True),  # one rank's steps had two
        ((0,), (), False),
    ],
)
def test_the_phase_between_effects_runs_only_where_a_step_has_several(ranks, kinds, between):
    phases = default_phases(dumps(*ranks, kinds=kinds))
    assert ("between-effects" in phases) == between
    assert [p for p in phases if p not in SEVERAL_EFFECTS] == [p for p in PHASES if p not in SEVERAL_EFFECTS]


def test_phases_asked_for_are_kept_and_none_asked_for_means_all_that_apply(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    assert parse([str(script)]).phases is None
    assert parse(["--phases", "between-effects,forward", str(script)]).phases == ["between-effects", "forward"]
