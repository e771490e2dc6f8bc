"""Entering a generation: which step the job continues from, and where each rank's state comes from.

A pure function of what every rank says about itself (``Holding``), table-tested: every rank
computes the same plan from the same allgathered holdings. For each step the job could continue
from, newest first, a rank is *at* that step when it holds it (its live state) or can return to
it (its own local snapshot, ``Holding.local``). Every other rank (a joiner, or a survivor
behind) must assemble each registered object from one of:

* a **live replica** at that step: a rank holding an identical copy (mutual replica sets, same
  module shapes), spread over the candidates so several joiners receive in parallel;
* its **snapshot** at that step, kept by the rank that holds its snapshots (the lost rank's
  buddy, ``snapshots.placement``): the objects no live rank replicates;
* or, with ``--snapshot-parity``, its snapshot **rebuilt** from its group's parity at that step
  (every stripe on a live rank) and the own snapshots of the other members that went into it;

and its per-rank state (RNG, data position) from its snapshot or from an exact per-rank mirror
at that step. The first step at which every rank can be served wins: with per-step snapshots
that is the interrupted step itself, or one step earlier when the lost rank's newest snapshot
was still on its way. If no step works, the plan says which ranks and which step are lost:
the job then restarts from the script's checkpoint, loudly, never from a silently wrong state.

Replicas that should be identical at the chosen step but are not (a wrong ``replicas=``
declaration) are *conflicts*: never a source, always an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ObjectState:
    """One registered object of a rank: who holds identical copies, and its fingerprints."""

    replicas: frozenset  # ranks holding an identical copy (itself included)
    structure: str  # digest of a module's shapes ("" for other objects)
    values: str  # digest of a sample of its values


@dataclass(frozen=True)
class Holding:
    """What one rank says about itself when a generation starts."""

    rank: int
    step: int  # committed steps it holds; -1: a fresh process (no training state)
    objects: dict = field(default_factory=dict)  # name -> ObjectState of its live objects
    per_rank: bool = False  # it registered per-rank state (RNG, data position)
    local: dict = field(default_factory=dict)  # step -> {name: (structure, values)}: its own snapshots
    held: dict = field(default_factory=dict)  # source rank -> {"images": {step: names}, "mirrors": {tag: exact}}
    stripes: dict = field(default_factory=dict)  # (group, stripe, stripes) -> {step: {member rank: names}}: parity kept
    rebuild: frozenset = frozenset()  # subgroups (creation order) it cannot keep: every member rebuilds them
    found: object = None  # its replica survey (``replicas.FoundReplicas``; None: a fresh process): handed to every rank


@dataclass
class RecoveryPlan:
    step: int  # the step every rank continues from (-1: nobody holds state)
    restore: list = field(default_factory=list)  # ranks that return to ``step`` from their own snapshot
    live: dict = field(default_factory=dict)  # receiver -> {sender: [object names]} from live replicas
    images: dict = field(default_factory=dict)  # receiver -> (holder, [object names]) from its snapshot
    parity: dict = field(default_factory=dict)  # receiver -> (group, [stripe holders], {member: names}, [names]): rebuilt
    mirrors: dict = field(default_factory=dict)  # receiver -> holder of its per-rank state at ``step``
    missing: list = field(default_factory=list)  # ranks that cannot be served at ``step``
    lacks: dict = field(default_factory=dict)  # missing rank -> what nothing holds for it (one phrase)
    conflicts: list = field(default_factory=list)  # replicas whose state differs (a wrong declaration)
    newest: int = -1  # the newest step a survivor held: ``newest - step`` steps run again
    tried: dict = field(default_factory=dict)  # step -> why the job cannot continue from it (newer steps first)

    @property
    def receivers(self) -> set:
        return set(self.live) | set(self.images) | set(self.parity) | set(self.mirrors)

    def lacking(self) -> str:
        """What nothing holds for each missing rank, in one phrase: which object, or its per-rank state."""
        return "; ".join(f"rank {r}: {self.lacks.get(r, 'its state')}" for r in self.missing)


def plan_recovery(holdings: list[Holding]) -> RecoveryPlan:
    """The newest step the job can continue from, and how every rank gets there (module docstring)."""
    by_rank = {h.rank: h for h in holdings}
    survivors = [h for h in holdings if h.step >= 0]
    if not survivors:
        return RecoveryPlan(step=-1)
    newest = max(h.step for h in survivors)
    holder = {src: h.rank for h in holdings for src in h.held}
    candidates = sorted({h.step for h in survivors} | {s for h in survivors for s in h.local}, reverse=True)
    first, tried = None, {}
    for step in candidates:
        plan = _plan_at(step, holdings, by_rank, holder)
        plan.newest, plan.tried = newest, tried
        if not plan.missing and not plan.conflicts:
            return plan
        tried[step] = (f"ranks {plan.conflicts[0][0]} and {plan.conflicts[0][1]} differ" if plan.conflicts
                       else f"nothing holds rank(s) {plan.missing} ({plan.lacking()})")  # fmt: skip
        first = first or plan
    return first


def _digests(h: Holding, step: int) -> dict | None:
    """{name: (structure, values)} of ``h``'s state at ``step``: live, or its own snapshot; None if neither."""
    if h.step == step:
        return {name: (o.structure, o.values) for name, o in h.objects.items()}
    if step in h.local:
        return dict(h.local[step])
    return None


def _plan_at(step: int, holdings: list[Holding], by_rank: dict, holder: dict) -> RecoveryPlan:
    plan = RecoveryPlan(step=step)
    at = {h.rank: d for h in holdings if (d := _digests(h, step)) is not None}
    for h in holdings:
        if h.rank in at and h.step != step:
            plan.restore.append(h.rank)
    # Replicas that should agree at this step and do not: never a source, always an error.
    for a in sorted(at):
        for b in sorted(at):
            if b <= a:
                continue
            ha, hb = by_rank[a], by_rank[b]
            for name in sorted(set(at[a]) & set(at[b])):
                oa, ob = ha.objects.get(name), hb.objects.get(name)
                if oa and ob and b in oa.replicas and a in ob.replicas and at[a][name] != at[b][name]:
                    plan.conflicts.append((a, b))
                    break
    load = {r: 0 for r in at}
    for h in sorted(holdings, key=lambda h: h.rank):
        if h.rank in at:
            continue
        if h.step > step:  # it cannot return to this step (no snapshot of it): the step is not an option
            plan.missing.append(h.rank)
            plan.lacks[h.rank] = f"it is at step {h.step} and holds no snapshot of step {step}"
            continue
        lacks = _serve(h, step, at, by_rank, holder.get(h.rank), load, plan, holdings)
        if lacks is not None:
            plan.missing.append(h.rank)
            plan.lacks[h.rank] = lacks
    for r in plan.missing:  # a partial plan for a rank that cannot be served is no plan
        plan.live.pop(r, None)
        plan.images.pop(r, None)
        plan.parity.pop(r, None)
        plan.mirrors.pop(r, None)
    return plan


def _parity_source(rank: int, step: int, holdings: list[Holding], by_rank: dict) -> tuple | None:
    """(group, [stripe holders], {other member: names}, [names]) when ``rank``'s snapshot of
    ``step`` can be rebuilt: every stripe of its group's parity of that step is on a live rank
    and says ``rank`` went into it, the stripes agree on who else did, and each of those holds
    its own snapshot of the step (the same bytes it sent)."""
    found: dict = {}  # (group, stripes) -> {stripe: (holder, members)}
    for p in holdings:
        for (group, j, count), steps in p.stripes.items():
            members = steps.get(step) or {}
            if rank in members:
                found.setdefault((group, count), {})[j] = (p.rank, members)
    for (group, count), by_stripe in sorted(found.items()):
        if set(by_stripe) != set(range(count)) or len({tuple(sorted(m.items())) for _, m in by_stripe.values()}) != 1:
            continue
        members = by_stripe[0][1]
        others = {c: names for c, names in members.items() if c != rank}
        if all(c in by_rank and set(names) <= set(by_rank[c].local.get(step, ())) for c, names in others.items()):
            return group, [by_stripe[j][0] for j in range(count)], others, sorted(members[rank])
    return None


def _serve(h: Holding, step: int, at: dict, by_rank: dict, holder: int | None, load: dict, plan: RecoveryPlan, holdings=()) -> str | None:
    """Find a source for each of ``h``'s objects and its per-rank state at ``step``; None when
    every one has one, else what has none (an object no other rank holds at all says so: a joiner
    that found an object its survivors do not have, not a lost copy)."""
    held = by_rank[holder].held.get(h.rank, {}) if holder is not None else {}
    image_names = set((held.get("images") or {}).get(step, ()))
    parity = None if image_names else _parity_source(h.rank, step, list(holdings), by_rank)
    parity_names = set(parity[3]) if parity else set()
    live: dict = {}
    from_image: list = []
    from_parity: list = []
    for name, mine in sorted(h.objects.items()):
        sources = [
            r
            for r in at
            if r != h.rank
            and name in at[r]
            and name in by_rank[r].objects
            and h.rank in by_rank[r].objects[name].replicas
            and r in mine.replicas
            and at[r][name][0] == mine.structure
        ]
        if sources:
            src = min(sources, key=lambda r: (load[r], r))
            load[src] += 1
            live.setdefault(src, []).append(name)
        elif name in image_names:
            from_image.append(name)
        elif name in parity_names:
            from_parity.append(name)
        elif not any(name in by_rank[r].objects for r in by_rank if r != h.rank):
            return f"{name}, which no other rank has"
        else:
            return f"{name} (no live replica, no snapshot of step {step})"
    per_rank_from, per_rank_rebuilt = None, False
    if h.per_rank:
        mirrors = held.get("mirrors") or {}
        if image_names and step in (held.get("images") or {}):
            per_rank_from = holder  # an image carries the per-rank state of its step
        elif parity:
            per_rank_rebuilt = True  # so does a rebuilt one
        elif mirrors.get(step):
            per_rank_from = holder  # an exact per-rank mirror of that step
        else:
            return f"its per-rank state at step {step} ({'mirrored only at its vote' if step in mirrors else 'no snapshot, no mirror'})"
    if live:
        plan.live[h.rank] = live
    if from_image:
        plan.images[h.rank] = (holder, from_image)
    if parity and (from_parity or per_rank_rebuilt):
        group, holders, others, _ = parity
        plan.parity[h.rank] = (group, holders, others, from_parity)
    if per_rank_from is not None:
        plan.mirrors[h.rank] = per_rank_from
    return None
