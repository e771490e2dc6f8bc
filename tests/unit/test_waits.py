"""Progress lines of long waits (tm_launch.waits), used by every process."""

from tm_launch.waits import Every


def test_every_prints_at_most_once_per_interval():
    now = [0.0]
    ticker = Every(5.0, clock=lambda: now[0])
    seen = []
    for i in range(0, 260):
        now[0] = i * 0.1
        if ticker.due():
            seen.append(round(now[0], 1))
    assert seen == [5.0, 10.0, 15.0, 20.0, 25.0]
    now[0] = 100.0  # a loop that stalled: one line, not a burst of the missed ones
    assert ticker.due() and not ticker.due()
