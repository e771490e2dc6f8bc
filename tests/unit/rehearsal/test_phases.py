"""Which phases a rehearsal kills at by default (``rehearsal.main.default_phases``): every phase,
the one between several effects of a step only where the fault-free run's step has more than one
optimizer step (it registered more than one optimizer)."""

import pytest

from tm_launch.rehearsal.main import default_phases, parse
from tm_launch.rehearsal.runs import PHASES, SEVERAL_EFFECTS


def dumps(*kinds):
    return {0: {"meta": {"objects": {f"o{i}": k for i, k in enumerate(kinds)}}}}


@pytest.mark.parametrize(
    "kinds, between",
    [
        (("module", "optim"), False),
        (("module", "optim", "sched", "rng"), False),
        (("module", "optim", "module", "optim"), True),  # a GAN: two optimizers
        ((), False),
    ],
)
def test_the_phase_between_effects_runs_only_where_a_step_has_several(kinds, between):
    phases = default_phases(dumps(*kinds))
    assert ("between-effects" in phases) == between
    assert [p for p in phases if p not in SEVERAL_EFFECTS] == [p for p in PHASES if p not in SEVERAL_EFFECTS]


def test_phases_asked_for_are_kept_and_none_asked_for_means_all_that_apply(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    assert parse([str(script)]).phases is None
    assert parse(["--phases", "between-effects,forward", str(script)]).phases == ["between-effects", "forward"]
