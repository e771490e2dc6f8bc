"""``Audit.due``: the audit checks live recoveries, never a generation every worker started fresh in."""

from types import SimpleNamespace

import pytest

from tm_launch.worker.generation.audit import AFTER_CHANGE, Audit


@pytest.mark.parametrize(
    "generation, fresh, want",
    [
        (0, 0, False),  # the job's start
        (3, 3, False),  # every worker restarted from the script's checkpoint (restart mode)
        (4, 3, True),  # a live change after that restart
        (1, 0, True),  # a live change
    ],
)
def test_due_only_after_a_live_change(generation, fresh, want):
    state = SimpleNamespace(world=SimpleNamespace(generation=generation), fresh_generation=fresh)
    audit = Audit(state, exchange=None)
    assert [audit.due(step) for step in range(2)] == [want, want]
    if want:
        audit._left = 0
        assert not audit.due(2) and AFTER_CHANGE == 2
