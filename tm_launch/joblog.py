"""The job's history as the agents leave it in etcd for operators: what ``tm-launch ctl``
(``status``, ``timeline``) and the demo read, and what every agent writes. The keys are
``rendezvous.membership``'s; this module owns the records' meaning, so that the agent and the
operator's commands share it without importing each other.

**Step samples** (``log/steps/<node>``): a bounded per-node series of worker samples, appended by
each agent with its once-a-second progress publish (``append_samples``), and ``cause_kind``, the
short label of why a generation exists.

**Downtime breakdown** (``log/breakdown/<gen>/``): where a generation change's downtime went,
every millisecond of it under a name.

Agents stamp what they saw (wall-clock seconds) once per generation change, in etcd under
``log/breakdown/<gen>/`` (``rendezvous.membership``): the planner that published the plan
writes when the failure was first reported and when it sent the plan (``plan_stamps``); every
active node of a live generation writes, once its workers completed their first step in it, the
stamps of its slowest worker (``node_stamps``). ``breakdown`` turns them into phases, each from
the previous stamp to its own:

=============  ==========================================================================
detect         the last step every surviving rank completed -> the first failure report
plan           -> the planner sent the new plan (its compare-and-swap)
seen           -> this node's agent read the plan
directed       -> it handed the generation to its workers
communicator   -> its workers' communicators were built (picking the directive up included)
state          -> they agreed on the step and the state was transferred (they entered)
first_step     -> they completed their first step in the new generation
=============  ==========================================================================

The downtime starts at the *origin*, the last step completed before the change (TrainMover's
measure, the one ``localjob.downtime`` reads from a step log), and ends at the slowest node's
first step. A stamp earlier than the origin happened while training went on (a planned switch
prepares everything beforehand): its phase costs 0. A node's phases add up to its total, and the
job's total is the total of the node that resumed last (``critical_node``), so that node's
phases name every millisecond of the downtime. Stamps come from each machine's own clock: the
phases that cross machines (plan -> seen) absorb the machines' clock offset.
"""

from __future__ import annotations

import math

# -- step samples ---------------------------------------------------------------------------

# One sample per worker per progress publish: [time, generation, rank, step, step_time, state].
SAMPLE_FIELDS = ("time", "generation", "rank", "step", "step_time", "state")
SERIES_CAP = 600  # rows per node key: ~40 bytes each, so one put stays ~25 KB


def append_samples(series: list, rows: list, cap: int = SERIES_CAP) -> list:
    """Append ``rows`` and keep at most ``cap`` rows by thinning the *older* half by two.

    Why thinning instead of a ring buffer: a timeline of a week-long job must still show the
    start of the run; old samples lose resolution, recent ones keep it, and the size (hence the
    cost of the one etcd put per second) stays bounded."""
    out = list(series) + list(rows)
    while len(out) > cap:
        half = len(out) // 2
        out = out[:half][::2] + out[half:]
    return out


def cause_kind(plan: dict, reports: dict) -> str:
    """A short label for why generation ``plan`` exists (metrics label and legend text).

    ``reports`` are the failure reports of the previous generation ({node: {"kind", ...}}); a
    primary kind ("signal", "lost", "alarm") beats "exit" (a worker that exited only because a
    peer died)."""
    if plan.get("generation", 0) == 0:
        return "start"
    if plan.get("state") == "succeeded":
        return "finished"
    if plan.get("state") == "failed":
        return "failed"
    if plan.get("planned"):
        return "drain"
    cause = str(plan.get("cause", ""))
    if cause.startswith("scale up"):
        return "scale_up"
    kinds = {str(r.get("kind", "lost")) for r in reports.values()}
    for kind in ("alarm", "lost", "signal", "exit"):
        if kind in kinds:
            return kind
    return "failure" if cause else "unknown"


# -- downtime breakdown ----------------------------------------------------------------------

PHASES = ("detect", "plan", "seen", "directed", "communicator", "state", "first_step")
NODE_STAMPS = ("seen", "directed", "communicator", "entered", "first_step")  # end of the node's phases


def _time(value) -> float | None:
    """A stamp read back from etcd (input): a finite number, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _latest(values) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def plan_stamps(planner: str, published: float, report_times: dict[str, float]) -> dict:
    """The publishing planner's record: the first failure report it planned on (none for a
    planned change or a cordon) and when it sent the plan."""
    first = min(report_times, key=report_times.get) if report_times else None
    return {"planner": planner, "published": published, "detected": report_times[first] if first else None, "detected_by": first}


def node_stamps(seen: float, directed: float | None, entered: list, first_steps: list) -> dict:
    """One node's record from its agent's stamps and its workers' reports (``entered/<gen>``:
    ``began`` wall clock, ``communicator`` and ``state`` seconds, ``last_step_at``;
    ``first_step/<gen>``: ``time``). At every stamp the slowest local worker counts: a phase
    ends for the node when its last worker is through it."""
    return {
        "seen": seen,
        "directed": directed,
        "last_step": _latest(_time(e.last_step_at) for e in entered),
        "communicator": _latest(e.began + e.communicator for e in entered),
        "entered": _latest(e.began + e.communicator + e.state for e in entered),
        "first_step": _latest(_time(f.time) for f in first_steps),
    }


def breakdown(plan_record: dict | None, nodes: dict[str, dict], digits: int = 3) -> dict | None:
    """The phases of one generation change from its records (see the module docstring); None
    when nothing was recorded. ``phases``: in order, each with the slowest node's seconds and
    that node (for detect, the node that reported; for plan, the planner); ``nodes``: every
    node's phases and total; None marks a stamp nobody recorded (its time falls to the next)."""
    plan_record = plan_record if isinstance(plan_record, dict) else {}
    nodes = {n: r for n, r in nodes.items() if isinstance(r, dict)}
    detected, published = _time(plan_record.get("detected")), _time(plan_record.get("published"))
    last_steps = [t for t in (_time(r.get("last_step")) for r in nodes.values()) if t is not None]
    origin = max(last_steps) if last_steps else detected if detected is not None else published
    if origin is None:
        return None

    def chain(stamps, at, phases):
        for phase, t in stamps:
            if t is None:
                phases[phase] = None
                continue
            t = max(t, origin)  # before the origin: it overlapped training and cost nothing
            phases[phase], at = round(t - at, digits), t
        return at

    head: dict = {}
    head_end = chain([("detect", detected if last_steps else None), ("plan", published)], origin, head)
    per_node = {}
    for node, record in sorted(nodes.items()):
        phases = dict(head)
        end = chain([(p, _time(record.get(s))) for p, s in zip(PHASES[2:], NODE_STAMPS)], head_end, phases)
        per_node[node] = {"phases": phases, "total_s": round(end - origin, digits) if phases["first_step"] is not None else None}
    resumed = {n: v["total_s"] for n, v in per_node.items() if v["total_s"] is not None}
    critical = max(resumed, key=resumed.get) if resumed else None
    who = {"detect": plan_record.get("detected_by"), "plan": plan_record.get("planner")}
    summary = []
    for phase in PHASES:
        if phase in head:
            node = who[phase] if isinstance(who[phase], str) and head[phase] is not None else None
            summary.append({"phase": phase, "seconds": head[phase], "node": node})
            continue
        known = {n: v["phases"][phase] for n, v in per_node.items() if v["phases"][phase] is not None}
        slowest = max(known, key=known.get) if known else None
        summary.append({"phase": phase, "seconds": known.get(slowest), "node": slowest})
    return {"origin": origin, "total_s": resumed.get(critical), "critical_node": critical, "phases": summary, "nodes": per_node}
