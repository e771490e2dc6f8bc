"""How a running agent retries etcd (pure): one policy for every request it makes once it runs.

A running agent asks etcd for many things: its lease's renewal (the keeper thread), a new lease
after one expired, the job's state (the loop's reads), its reports, plans, the store a
generation uses, progress records, events (the event thread) and a watch stream (the watch
thread). Each of them can meet an etcd that does not answer: a member restarted, a leader
election, the whole cluster stopped for maintenance. None of that may end a training job, so
none of those requests may end the agent: each one is retried under this policy, with a delay
that starts small (an election takes a fraction of a second, and every retry that comes later
than needed is training without a control plane) and grows to a cap (a cluster that is away for
a minute is asked once a second by every agent, not flooded).

Only two things end the retrying:

* the fencing rule (``fencing.lease_decision``): this node's ranks may be taken while etcd does
  not answer it, so its workers stop. The main loop applies it between retries;
* ``outage_decision``: etcd has been silent for ``gone_after`` seconds and this node has nothing
  left to protect (no worker of its runs: its job ended or failed, or it is a spare that holds
  no rank). It exits with one line instead of retrying for ever (an etcd torn down after its
  job, say); a node whose workers still train keeps retrying, because they keep training.

The start-up refusal ("cannot reach etcd at ...: start etcd or fix --rdzv-endpoint") is for a
user whose etcd never answered; it is said before the agent runs, never by this policy.
"""

from __future__ import annotations

RETRY = "retry"
GIVE_UP = "give_up"

FIRST_S = 0.05  # the first retry: a leader election or a member's restart is over in well under a second
MAX_S = 1.0  # the cap: once a second at most, whatever the outage's length


def retry_delay(attempt: int, ttl: float, jitter: float = 0.0) -> float:
    """Seconds to wait before retrying, after ``attempt`` failures in a row (1: the first).

    Doubles from ``FIRST_S`` up to min(``MAX_S``, ttl / 3): a lease is renewed every ttl / 3,
    so a retry never waits longer than a renewal would, and a lease that etcd renews when it
    comes back is renewed well inside its TTL. ``jitter`` (0 to 1, the caller's random draw)
    takes up to a fifth off, so that a job's agents do not all ask at the same instant when
    etcd comes back."""
    if attempt < 1:
        return 0.0
    cap = min(MAX_S, max(ttl, 0.0) / 3)
    delay = min(cap, FIRST_S * 2 ** min(attempt - 1, 30))
    return max(delay * (1 - 0.2 * min(max(jitter, 0.0), 1.0)), 0.0)


def gone_after(ttl: float) -> float:
    """Seconds of etcd's silence after which an agent with nothing left to run stops asking:
    max(60 s, 12 lease TTLs), well past any restart, upgrade or leader election."""
    return max(60.0, 12 * ttl)


def outage_decision(*, silent_for: float | None, ttl: float, workers_running: bool) -> str:
    """RETRY or GIVE_UP, for an agent whose request to etcd failed.

    silent_for       seconds since etcd last answered this agent (None: it just did)
    workers_running  this node holds ranks in the generation it follows and a worker of its
                     still runs (trains, or recovers and waits for etcd's next plan); a
                     spare's parked workers hold no rank and do not count
    """
    if silent_for is None or workers_running:
        return RETRY
    return GIVE_UP if silent_for >= gone_after(ttl) else RETRY
