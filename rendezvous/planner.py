"""The planner: given what etcd says about the job, what is the next generation's plan?

A pure function with table tests (tests/unit/rendezvous/test_planner.py). Every agent runs it on its own view
and tries to publish the result with compare-and-swap; whichever publish lands first is the
plan, and the others re-read and agree. Keeping it pure is what makes that safe: the decision
depends only on the view, never on which agent computes it.

Rules, in order:

1. Job finished: every active node reported its workers done -> SUCCEEDED.
2. Unplanned loss: an active node whose lease expired, that is cordoned, or that reported a
   failure (worker exit, fatal alarm). A report that the live state of some rank exists nowhere
   any more (no replica survived) blames nobody but restarts every worker from the script's
   checkpoint: continuing live would train on wrong weights. Each loss consumes one restart of the job-wide
   ``--max-restarts`` budget. A warm spare takes the lost node's group rank; with no spare, a
   node that is still alive restarts its own workers in place (torchrun's behaviour), and a dead
   node is dropped if the job may shrink (``--nnodes MIN:MAX``). Otherwise the job FAILS with a
   reason, never waits forever.
3. Planned migration (drain, degraded alarm): a draining node hands its ranks to a spare. Without
   a spare the drain waits; it never takes the job below its size and costs no restart.
4. Restart mode only: grow back towards MAX nodes when spares exist (torchrun's scale-up).

Live mode (the job's workers use ``tm_launch.init``) keeps survivors' processes whenever the
world size is unchanged and at least one active node keeps its workers (someone must hold the
training state); otherwise every worker restarts from the script's own start or checkpoint.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from . import script_errors
from .plan import FAILED, SUCCEEDED, NodeInfo, Plan


@dataclass(frozen=True)
class Limits:
    min_nodes: int
    max_nodes: int
    nproc: int
    max_restarts: int


@dataclass(frozen=True)
class View:
    """Everything the planner looks at, read from etcd by the membership adapter."""

    plan: Plan | None
    alive: dict[str, NodeInfo]  # registered nodes whose lease is alive
    failed: dict[str, str] = field(default_factory=dict)  # cordoned node -> reason
    reports: dict[str, str] = field(default_factory=dict)  # node -> failure in this generation
    drains: dict[str, str] = field(default_factory=dict)  # node -> why it should leave
    done: frozenset[str] = frozenset()  # nodes whose workers finished in this generation
    warm: frozenset[str] = frozenset()  # spares whose workers warmed up and parked (their agents' markers)
    # What kind of failure each report is: "exit" (a worker exited non-zero: perhaps only
    # because a peer died), a primary failure ("signal", "lost", "alarm"; missing = primary),
    # "state": the live state of some rank exists nowhere any more (every worker restarts), or
    # "refused": a worker refused to run as configured (the job fails: no restart would help),
    # "script": a worker's script raised (``script_errors``: the job fails when it is a bug).
    report_kinds: dict[str, str] = field(default_factory=dict)
    report_times: dict[str, float] = field(default_factory=dict)
    now: float = 0.0
    live: bool = False  # the job's workers use the live API
    last_call_passed: bool = False  # MIN <= alive < MAX and the join window has closed


def spares(view: View) -> list[str]:
    """Alive, not cordoned, not draining, not active: the nodes a plan may promote, in the order
    it promotes them. Warm ones first (their workers parked: a promotion waits for no warm-up),
    then in join order. Join order alone made the job wait for a spare still warming up (a node
    whose worker was killed parks again, and keeps its early join time) while a warm one
    waited behind it."""
    active = set(view.plan.nodes) if view.plan else set()
    removed = set(view.plan.removed) if view.plan else set()
    candidates = [
        n for n in view.alive.values() if n.id not in active and n.id not in view.failed and n.id not in view.drains and n.id not in removed
    ]
    return [n.id for n in sorted(candidates, key=lambda n: (n.id not in view.warm, n.joined, n.id))]


def _store_for(nodes: tuple[str, ...], joiners: tuple[str, ...], alive: dict[str, NodeInfo], previous: dict | None = None) -> dict:
    """Where the generation's bootstrap store lives, and its standby. On a surviving node (its
    agent is known good), else the first live one. It stays on the node of ``previous`` (the
    last plan's store) while that node survives, and moves to the standby ``previous`` named when
    it is lost: the workers keep connections ready to both (``tm_launch.worker.comms.store_clients``), so a
    change opens none on its way. The standby is the first other live node in the plan's order."""
    survivors = [n for n in nodes if n not in joiners and n in alive]
    previous = previous or {}
    kept = [n for n in (previous.get("node"), (previous.get("standby") or {}).get("node")) if n in survivors]
    host = (kept or survivors or [n for n in nodes if n in alive] or list(nodes))[0]
    store = _store_record(host, alive)
    standby = next((n for n in nodes if n != host and n in alive), None)
    if standby is not None:
        store["standby"] = _store_record(standby, alive)
    return store


def _store_record(node: str, alive: dict[str, NodeInfo]) -> dict:
    info = alive.get(node)
    return {"node": node, "addr": info.addr if info else "", "port": info.store_port if info else 0}


def first_plan(view: View, limits: Limits) -> Plan | None:
    """Generation 0: the first MAX nodes in join order, or MIN..MAX once the join window closed."""
    candidates = spares(view)
    if len(candidates) >= limits.max_nodes:
        nodes = tuple(candidates[: limits.max_nodes])
    elif len(candidates) >= limits.min_nodes and view.last_call_passed:
        nodes = tuple(candidates)
    else:
        return None
    return Plan(
        generation=0,
        nodes=nodes,
        nproc=limits.nproc,
        store=_store_for(nodes, nodes, view.alive),
        cause="initial rendezvous",
        joiners=nodes,
        created=time.time(),
    )


EXIT_GRACE = 0.5  # seconds a lone "exit" report waits for the report of the failure that caused it


def _lost(view: View) -> tuple[dict[str, str], set[str]] | None:
    """Active nodes that must leave now (with the reason) and collateral nodes that stay but
    restart their workers; None while a lone non-zero exit waits for its cause to be reported.

    When a peer dies, the survivors' workers of a restart-mode script exit non-zero too: those
    nodes are collateral, not culprits, whenever a primary failure explains them."""
    lost, exits = {}, {}
    for node in view.plan.nodes:
        if node not in view.alive:
            lost[node] = "node lost (lease expired)"
        elif node in view.failed:
            lost[node] = f"cordoned: {view.failed[node]}"
        elif node in view.reports:
            if view.report_kinds.get(node) == "exit":
                exits[node] = view.reports[node]
            elif view.report_kinds.get(node) != "state":  # state: the node is fine (see next_plan)
                lost[node] = view.reports[node]
    if lost:
        return lost, set(exits)
    if exits and any(view.now - view.report_times.get(n, 0.0) < EXIT_GRACE for n in exits):
        return None
    return exits, set()


def finished_without(view: View, node: str) -> bool:
    """True when ``node`` joins the current live generation and every node that kept its workers
    has finished: training is complete without it.

    The keepers can only finish the last step through collectives with every rank of a complete
    world. A drain agreed near the end may switch at a step after the last one: the keepers then
    finish in the old communicator, and the promoted spare, still waiting to enter, has nothing
    left to do (its agent then reports it done instead of waiting out the setup timeout)."""
    plan = view.plan
    if plan is None or plan.finished or not plan.live or node not in plan.joiners:
        return False
    keepers = [n for n in plan.nodes if n not in plan.joiners]
    return bool(keepers) and all(n in view.done for n in keepers)


def next_plan(view: View, limits: Limits) -> Plan | None:
    """The next generation, or None when the current plan stands."""
    plan = view.plan
    if plan is None:
        return first_plan(view, limits)
    if plan.finished:
        return None
    if all(n in view.done for n in plan.nodes):
        return plan.next(state=SUCCEEDED, cause="all workers finished", reason="training finished")
    refused = [n for n in plan.nodes if view.report_kinds.get(n) == "refused" and n in view.reports]
    if refused:
        why = f"{refused[0]}: {view.reports[refused[0]]}"
        return plan.next(state=FAILED, cause=why, reason=why)
    raised = {n: view.reports[n] for n in plan.nodes if view.report_kinds.get(n) == "script" and n in view.reports}
    if raised:
        ranks_of = {n: plan.ranks(n) for n in plan.nodes}
        verdict, why = script_errors.decide(plan.nodes, raised, view.report_times, set(view.failed), plan.cause, view.now, ranks_of)
        if verdict == script_errors.FAIL:
            return plan.next(state=FAILED, cause=why, removed=(), reason=why)
        if verdict == script_errors.WAIT:
            return None  # FAULT: replaced below like any failure, once
    found = _lost(view)
    if found is None:
        return None
    lost, collateral = found
    # A live rank found that some rank's state exists nowhere any more (no replica): nobody is
    # to blame, but continuing live would train on wrong weights; every worker restarts.
    state_lost = [n for n in plan.nodes if view.report_kinds.get(n) == "state" and n in view.reports]
    if lost or state_lost:
        return _replace_lost(view, limits, lost, collateral, state_lost=view.reports[state_lost[0]] if state_lost else "")
    drains = [n for n in plan.nodes if n in view.drains]
    if drains:
        return _migrate(view, drains)
    if not view.live and len(plan.nodes) < limits.max_nodes and spares(view):
        grow = tuple(spares(view)[: limits.max_nodes - len(plan.nodes)])
        nodes = plan.nodes + grow
        return plan.next(
            nodes=nodes,
            joiners=nodes,
            store=_store_for(nodes, nodes, view.alive, view.plan.store),
            cause=f"scale up: {', '.join(grow)} joined",
            live=False,
            restart_why=f"the job grows from {len(plan.nodes)} to {len(nodes)} node(s)",
        )
    return None


def _describe(lost: dict[str, str]) -> str:
    return "; ".join(f"{node}: {why}" for node, why in lost.items())


def _replace_lost(view: View, limits: Limits, lost: dict[str, str], collateral: set[str] = frozenset(), state_lost: str = "") -> Plan:
    """Replace the lost nodes; ``state_lost`` (a reason) makes every worker restart."""
    plan = view.plan
    cause = "; ".join(filter(None, [_describe(lost), state_lost]))
    restarts = plan.restarts + 1
    if restarts > limits.max_restarts:
        return plan.next(
            state=FAILED,
            restarts=restarts,
            cause=cause,
            removed=tuple(lost),
            reason=f"max restarts ({limits.max_restarts}) exhausted; last failure: {cause}",
        )
    free = spares(view)
    nodes, joiners, replaced, removed = [], [], {}, []
    for node in plan.nodes:
        if node not in lost:
            nodes.append(node)
            if node in collateral:
                joiners.append(node)  # its workers exited: they start again
        elif free:
            spare = free.pop(0)
            nodes.append(spare)
            joiners.append(spare)
            replaced[spare] = node
            removed.append(node)
        elif node in view.alive and node not in view.failed and view.report_kinds.get(node) != "lost":
            # no spare: the node restarts its own workers in place (not a node whose agent was
            # found dead: its lease outlives it by a few seconds, but nobody is there to restart)
            nodes.append(node)
            joiners.append(node)
        else:
            removed.append(node)
    if len(nodes) < limits.min_nodes:
        return plan.next(
            state=FAILED,
            restarts=restarts,
            cause=cause,
            removed=tuple(removed),
            reason=(f"no spare left: {len(nodes)} node(s) remain, --nnodes needs at least {limits.min_nodes}; last failure: {cause}"),
        )
    nodes_t, joiners_t = tuple(nodes), tuple(joiners)
    # Live needs the same world size and a surviving process that holds the training state;
    # otherwise every worker starts afresh (from the script's own start or checkpoint).
    why = why_restart(view.live, state_lost, len(plan.nodes), len(nodes), any(n not in joiners for n in nodes))
    live = not why
    if not live:
        joiners_t = nodes_t
    return plan.next(
        nodes=nodes_t,
        joiners=joiners_t,
        replaced=replaced,
        removed=tuple(removed),
        restarts=restarts,
        cause=cause,
        live=live,
        restart_why=why,
        store=_store_for(nodes_t, joiners_t, view.alive, plan.store),
    )


NOT_LIVE_YET = (
    "no worker has entered tm_launch's live loop (job.steps() or a framework integration): the script does not "
    "use tm_launch.init(), or tm-launch runs with --no-live (README: Live mode)"
)


def why_restart(live_seen: bool, state_lost: str, before: int, after: int, survivor: bool) -> str:
    """Why a generation replacing nodes restarts every worker instead of substituting ranks in
    place ('' when it can be live): said in the plan, the agents' logs and ``ctl status``, so
    that a job running in restart mode says what would make it live. ``live_seen``: a worker
    entered the live loop; ``state_lost``: a live rank's report that some rank's state exists
    nowhere; ``before``/``after``: the node count; ``survivor``: a node keeps its workers."""
    if not live_seen:
        return NOT_LIVE_YET
    if state_lost:
        return f"the training state of some rank is lost ({state_lost})"
    if after != before:
        return f"no spare left: the job goes from {before} to {after} node(s), and live substitution keeps the world size"
    if not survivor:
        return "no node keeps its workers: none is left to hand the training state over"
    return ""


def _migrate(view: View, drains: list[str]) -> Plan | None:
    plan = view.plan
    free = spares(view)
    moves = {}
    for node in drains:
        if free:
            moves[node] = free.pop(0)
    if not moves:
        return None  # a drain waits for a spare; it never shrinks the job
    nodes = tuple(moves.get(n, n) for n in plan.nodes)
    why = why_restart(view.live, "", len(plan.nodes), len(nodes), len(moves) < len(plan.nodes))  # someone must stay to hand over the state
    live = not why
    joiners = tuple(moves.values()) if live else nodes
    return plan.next(
        nodes=nodes,
        joiners=joiners,
        replaced={new: old for old, new in moves.items()},
        removed=tuple(moves),
        live=live,
        restart_why=why,
        planned=True,
        cause="; ".join(f"{old}: drain ({view.drains[old]})" for old in moves),
        store=_store_for(nodes, joiners, view.alive, plan.store),
    )


PLANNERS = 3  # agents that run the planner and try the CAS; the others only follow


def planners(view: View, k: int = PLANNERS) -> tuple[str, ...]:
    """Which agents plan: the first ``k`` alive nodes in join order, cordoned nodes last.

    Every agent computing and CASing the same plan is correct but costs, per event, one failed
    compare-and-swap (plus a history write) per node: ~2N writes at N nodes. Any agent's plan is
    the same (the planner is pure), so a few designated ones suffice; more than one, so that a
    planner that is slow or just died does not delay the next plan. The choice is made from
    the same view by everyone, and a planner that dies drops out of ``alive``, so the next node
    in the order takes over at its next read, with no election. The CAS still guarantees one
    plan per generation if views briefly disagree. Cordoned nodes plan only when nothing else is
    alive (someone must publish the FAILED plan)."""
    order = sorted(view.alive.values(), key=lambda n: (n.id in view.failed, n.joined, n.id))
    return tuple(n.id for n in order[:k])


def follows_only(view: View, node: str, planning: bool) -> bool:
    """True when ``node`` needs nothing from etcd but the next plan (and whether it must start
    planning): it does not plan, is not group rank 0 (which reports drains waiting for a spare),
    is not a joiner of a live generation (which watches its keepers finish), and is active or a
    spare of a job known to be live (a spare of any other job must see the job turn live to warm
    up). Such a node waits only for a new plan or planner and reads only what changed
    (``Membership.refresh``), so that a join or a loss costs the other agents nothing."""
    plan = view.plan
    if planning:
        return False
    if plan is None:
        return True
    rank0 = plan.nodes[:1] == (node,)
    joining = plan.live and node in plan.joiners
    return not rank0 and not joining and (node in plan.nodes or view.live)
