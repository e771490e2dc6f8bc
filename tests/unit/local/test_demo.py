"""`make demo`'s report reads ranks from the plan and processes from the step log, never assumes.

On a fresh machine node0 joined second and held rank 1: the report said its process changed
while it had kept it (it looked at rank 0's process). These tables pin the readings down.
"""

import pytest

from tm_launch.joblog import breakdown
from tm_launch.local.demo import breakdown_table, processes, ranks

# step log rows: (time, rank, step, generation, pid); the fault at t=10
ROWS = [(9.0, 0, 39, 0, 200), (9.0, 1, 39, 0, 100), (11.0, 0, 40, 1, 300), (11.0, 1, 40, 1, 100)]


@pytest.mark.parametrize(
    "held, before, after",
    [
        ([1], [100], [100]),  # node0 holds rank 1 and kept its process
        ([0], [200], [300]),  # rank 0 moved to the spare's process
        ([0, 1], [100, 200], [100, 300]),
        ([], [], []),
    ],
)
def test_processes_follow_the_ranks_a_node_held(held, before, after):
    assert processes(ROWS, held, 10.0) == (before, after)


def test_ranks_come_from_the_plan_status_shows():
    status = {"nodes": [{"id": "node1", "ranks": [0]}, {"id": "node0", "ranks": [1]}, {"id": "node2", "ranks": []}]}
    assert ranks(status) == {"node1": [0], "node0": [1]}


def test_breakdown_table_has_a_column_per_node_and_names_who_did_what():
    t = 1000.0
    parts = breakdown(
        {"planner": "node0", "published": t + 0.07, "detected": t + 0.05, "detected_by": "node1"},
        {
            "node0": {
                "last_step": t,
                "seen": t + 0.08,
                "directed": t + 0.09,
                "communicator": t + 0.2,
                "entered": t + 0.25,
                "first_step": t + 0.3,
            },
            "node2": {"seen": t + 0.08, "directed": t + 0.09, "communicator": t + 0.3, "entered": t + 0.35, "first_step": t + 0.4},
        },
    )
    lines = breakdown_table(parts, 0.42)
    assert lines[0].split()[-2:] == ["node0", "node2"]
    assert "node1 reported the failure" in lines[1] and "node0 published the plan" in lines[2]
    assert lines[-1].split()[1:3] == ["0.300s", "0.400s"] and lines[-1].endswith(
        "node2 resumed last; step log: 0.420s from the last step every rank logged"
    )
    assert len(lines) == 9  # header, seven phases, total
