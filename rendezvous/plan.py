"""The data a job agrees on through etcd: who the nodes are and what each generation's plan is.

A *plan* is the whole truth about one generation: which nodes are active and in which group-rank
order, which nodes joined (fresh worker processes that need state from a peer), which left, and
where the generation's bootstrap store lives. Exactly one plan exists per generation because
plans are published with compare-and-swap (see ``rendezvous.membership``). Everything here is
plain data with a JSON form, so plans can be tested and logged without etcd.

A plan names every active node, so it is O(N) bytes. A *plan delta* (``plan_delta``) says what
changed from the previous generation in O(1) bytes per change: nodes that are not in the change
cost nothing. A node holding the previous plan rebuilds the new one from the delta alone
(``apply_delta``), which is how the nodes that only follow plans stay O(1) per event at 1,000 nodes.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

RUNNING, SUCCEEDED, FAILED = "running", "succeeded", "failed"


def _loads(text: str):
    """json.loads for etcd content: deeply nested junk raises ValueError, not RecursionError."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _record(text: str, cls, what: str) -> dict:
    """Parse one record of etcd content: a JSON object with none but ``cls``'s fields."""
    return _only_fields(_loads(text), cls, what)


def _only_fields(d, cls, what: str, *, leave_out: tuple[str, ...] = ()) -> dict:
    """``d`` itself when it is a dict whose keys are fields of ``cls`` (less ``leave_out``)."""
    if not isinstance(d, dict):
        raise ValueError(f"a {what} must be a JSON object")
    unknown = set(d) - {f.name for f in fields(cls)} | (set(d) & set(leave_out))
    if unknown:
        raise ValueError(f"a {what} has unknown field(s) {_short(sorted(unknown))}")
    return d


def _check_types(record, what: str, kinds) -> None:
    """Every (field, type) in ``kinds`` holds; a bool never passes for a number."""
    for name, kind in kinds:
        value = getattr(record, name)
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise ValueError(f"{what} field '{name}' has the wrong type: {_short(value)}")


def _json(record) -> str:
    """A dataclass record's JSON, keys sorted. Not ``asdict``: it deep-copies every field, which
    made a 1,024-node plan's digest cost 1 ms where the JSON itself costs 0.1 ms (every follower
    checks a digest per event). The fields are JSON's own types; tuples come out as lists."""
    return json.dumps(_fields_of(record), sort_keys=True, default=_fields_of)


def _fields_of(record) -> dict:
    return {f.name: getattr(record, f.name) for f in fields(record)}


def _short(value) -> str:
    """A bad value for an error message: etcd values may be megabytes of junk."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class NodeInfo:
    """What a node registers under its lease: enough to reach its agent and order the joins."""

    id: str
    host: str
    addr: str  # address other nodes use to reach this node's agent store
    store_port: int  # this agent's TCPStore (bootstrap store when it hosts a generation)
    nproc: int
    pid: int
    joined: float  # registration time; join order decides who is active and who is spare

    def to_json(self) -> str:
        return _json(self)

    @staticmethod
    def from_json(text: str) -> NodeInfo:
        """Parse and type-check a registration (etcd content is input, not trusted)."""
        return NodeInfo.from_dict(_loads(text))

    @staticmethod
    def from_dict(d) -> NodeInfo:
        """A registration from its JSON object (``to_json``'s), type-checked."""
        info = NodeInfo(**_only_fields(d, NodeInfo, "node record"))
        _check_types(
            info,
            "node record",
            (("id", str), ("host", str), ("addr", str), ("store_port", int), ("nproc", int), ("pid", int), ("joined", (int, float))),
        )
        # Values other nodes act on (connect to the port, order joins by time) must be sane.
        if not 0 < info.store_port < 65536 or info.nproc < 0 or not math.isfinite(info.joined):  # torchrun's handler registers nproc 0
            raise ValueError("node record has an out-of-range store_port, nproc or joined")
        return info


@dataclass(frozen=True)
class Plan:
    """One generation: the active nodes in group-rank order and how we got here."""

    generation: int
    nodes: tuple[str, ...]
    nproc: int
    store: dict = field(default_factory=dict)  # {"node", "addr", "port"} of the bootstrap store
    restarts: int = 0  # job-wide failures consumed so far (--max-restarts counts per job)
    cause: str = ""
    joiners: tuple[str, ...] = ()  # nodes whose workers are new processes this generation
    replaced: dict = field(default_factory=dict)  # new node -> node it replaced
    removed: tuple[str, ...] = ()  # nodes that left in this generation (failed or drained)
    live: bool = False  # survivors keep their processes (in-place substitution)
    restart_why: str = ""  # a generation after the first that is not live: why every worker starts afresh
    planned: bool = False  # a two-phase migration (drain): switch at a step boundary
    state: str = RUNNING
    reason: str = ""
    created: float = 0.0

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.nproc

    def group_rank(self, node: str) -> int | None:
        return self.nodes.index(node) if node in self.nodes else None

    def ranks(self, node: str) -> list[int]:
        """Global ranks of a node's workers (local rank i -> group_rank * nproc + i)."""
        gr = self.group_rank(node)
        return [] if gr is None else [gr * self.nproc + i for i in range(self.nproc)]

    @property
    def finished(self) -> bool:
        return self.state in (SUCCEEDED, FAILED)

    @property
    def last_run(self) -> int:
        """The generation workers last ran in, the number people saw: a finished plan is a
        marker published after that generation (``Plan.next``), not one that ran."""
        return self.generation - 1 if self.finished and self.generation > 0 else self.generation

    def to_json(self) -> str:
        return _json(self)

    @staticmethod
    def from_json(text: str) -> Plan:
        return Plan.from_dict(_loads(text))

    @staticmethod
    def from_dict(d) -> Plan:
        """A plan from its JSON object (``to_json``'s), type-checked: etcd content is input."""
        d = dict(_only_fields(d, Plan, "plan"))
        for key in ("nodes", "joiners", "removed"):
            if not isinstance(d.get(key, ()), (list, tuple)) or not all(isinstance(n, str) for n in d.get(key, ())):
                raise ValueError(f"plan field '{key}' must be a list of node ids")
            d[key] = tuple(d.get(key, ()))
        plan = Plan(**d)
        # etcd content is input: every field an agent acts on is type-checked, so that a bad
        # plan is refused here, in one place, rather than crashing an agent later.
        _check_types(
            plan,
            "plan",
            (
                ("generation", int),
                ("nproc", int),
                ("restarts", int),
                ("store", dict),
                ("cause", str),
                ("replaced", dict),
                ("live", bool),
                ("restart_why", str),
                ("planned", bool),
                ("state", str),
                ("reason", str),
                ("created", (int, float)),
            ),
        )
        if plan.generation < 0 or plan.nproc < 0 or plan.state not in (RUNNING, SUCCEEDED, FAILED):  # torchrun's handler: nproc 0
            raise ValueError("plan has an out-of-range generation, nproc or state")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in plan.replaced.items()):
            raise ValueError("plan field 'replaced' must map node ids to node ids")
        return plan

    def next(self, **changes) -> Plan:
        """The following generation with ``changes`` applied; per-event fields start empty."""
        base = dict(
            generation=self.generation + 1,
            nodes=self.nodes,
            nproc=self.nproc,
            store=self.store,
            restarts=self.restarts,
            cause="",
            joiners=(),
            replaced={},
            removed=(),
            live=self.live,
            restart_why="",
            planned=False,
            state=RUNNING,
            reason="",
            created=time.time(),
        )
        base.update(changes)
        return Plan(**base)


def plan_digest(plan: Plan) -> str:
    """A fingerprint of the whole plan: a node that rebuilt a plan from a delta compares it with
    the publisher's before acting on it."""
    return hashlib.sha256(plan.to_json().encode()).hexdigest()


@dataclass(frozen=True)
class PlanDelta:
    """What changed from generation ``previous`` to the next plan, in O(1) bytes per change.

    ``nodes`` edits the previous plan's node list in place: each splice ``(start, end, ids)``
    replaces ``previous.nodes[start:end]`` by ``ids`` (a spare taking a lost node's group rank,
    a node dropped, nodes appended). The joiners are listed, unless every node joins (a restart
    generation: listing them would be O(N)). ``fields`` holds the new plan's other fields whole:
    each is O(1) (the store, counters, flags, times) or sized by the change (``replaced``,
    ``removed``, the cause). ``digest`` is the new plan's ``plan_digest``. ``records`` are the
    registrations of the nodes a holder of the previous plan must learn about (``fresh_nodes``),
    as the publisher read them: with them in the delta, which the watch stream carries, a node
    that only follows plans makes no request at all for a join or a loss. ``spares``: how many
    spares the publisher counted beside the new plan (``planner.spares``; None: not counted),
    which a node that reads no records reports as its spares gauge.
    """

    previous: int | None  # the generation this applies to; None: no plan before (formation)
    nodes: tuple[tuple[int, int, tuple[str, ...]], ...]
    joiners: tuple[str, ...]
    every_node_joins: bool
    fields: dict
    digest: str
    records: tuple[NodeInfo, ...] = ()
    spares: int | None = None

    @property
    def generation(self) -> int | None:
        """The generation this delta produces (None if ``fields`` has none: unreadable)."""
        gen = self.fields.get("generation")
        return gen if isinstance(gen, int) and not isinstance(gen, bool) else None

    def to_json(self) -> str:
        return _json(self)

    @staticmethod
    def from_json(text: str) -> PlanDelta:
        """Parse and type-check a delta; whether it fits a plan is ``apply_delta``'s to say."""
        d = _record(text, PlanDelta, "plan delta")
        try:
            delta = PlanDelta(**d)
        except TypeError:
            raise ValueError("a plan delta lacks a field") from None
        _check_types(
            delta, "plan delta", (("nodes", list), ("joiners", list), ("every_node_joins", bool), ("fields", dict), ("digest", str))
        )
        if delta.previous is not None and (isinstance(delta.previous, bool) or not isinstance(delta.previous, int)):
            raise ValueError(f"plan delta field 'previous' has the wrong type: {_short(delta.previous)}")
        splices = []
        for splice in delta.nodes:
            if not (
                isinstance(splice, list)
                and len(splice) == 3
                and all(_is_int(x) for x in splice[:2])
                and isinstance(splice[2], list)
                and all(isinstance(n, str) for n in splice[2])
            ):
                raise ValueError(f"plan delta splice {_short(splice)} is not [start, end, [node ids]]")
            splices.append((splice[0], splice[1], tuple(splice[2])))
        if not all(isinstance(n, str) for n in delta.joiners):
            raise ValueError("plan delta field 'joiners' must be a list of node ids")
        if delta.spares is not None and (not _is_int(delta.spares) or delta.spares < 0):
            raise ValueError(f"plan delta field 'spares' is not a count: {_short(delta.spares)}")
        if not isinstance(delta.records, list):
            raise ValueError("plan delta field 'records' must be a list of node records")
        try:
            records = tuple(NodeInfo.from_dict(r) for r in delta.records)
        except TypeError:
            raise ValueError("a node record in the plan delta lacks a field") from None
        return PlanDelta(
            previous=delta.previous,
            nodes=tuple(splices),
            joiners=tuple(delta.joiners),
            every_node_joins=delta.every_node_joins,
            fields=delta.fields,
            digest=delta.digest,
            records=records,
            spares=delta.spares,
        )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def fresh_nodes(previous: Plan | None, new: Plan) -> list[str]:
    """The nodes of ``new`` whose registration a node holding ``previous`` must learn: those new
    to the plan (every one when it holds none), and the joiners already in it, whose workers
    start again (their agent may have registered again since); not when every node joins (a
    restart generation), where that would be every record, O(N), and the records held stand."""
    held = set(previous.nodes) if previous is not None else set()
    fresh = [n for n in new.nodes if n not in held]
    if new.joiners != new.nodes:
        fresh += [n for n in new.joiners if n in held]
    return fresh


def plan_delta(previous: Plan | None, new: Plan, records: Mapping[str, NodeInfo] | None = None, spares: int | None = None) -> PlanDelta:
    """The delta that turns ``previous`` (None before the first plan) into ``new``, carrying the
    ``records`` (node id -> registration) of its ``fresh_nodes``. None are sent at formation:
    there every node is fresh, O(N) records, and a node that follows reads only those of the
    peers it connects to (``Membership.with_records``)."""
    before = previous.nodes if previous is not None else ()
    matcher = difflib.SequenceMatcher(None, before, new.nodes, autojunk=False)
    splices = tuple((i1, i2, new.nodes[j1:j2]) for op, i1, i2, j1, j2 in matcher.get_opcodes() if op != "equal")
    every = bool(new.nodes) and new.joiners == new.nodes
    rest = {k: list(v) if isinstance(v, tuple) else v for k, v in _fields_of(new).items() if k not in ("nodes", "joiners")}
    sent = () if previous is None else tuple(records[n] for n in fresh_nodes(previous, new) if n in (records or {}))
    return PlanDelta(
        previous=previous.generation if previous is not None else None,
        nodes=splices,
        records=sent,
        joiners=() if every else new.joiners,
        every_node_joins=every,
        fields=rest,
        digest=plan_digest(new),
        spares=spares,
    )


class DeltaMismatch(ValueError):
    """A delta that does not turn the plan at hand into the published one: read the whole plan."""


def apply_delta(previous: Plan | None, delta: PlanDelta) -> Plan:
    """The plan ``delta`` was made for, rebuilt from ``previous``; DeltaMismatch when ``delta`` does
    not apply to ``previous`` (another generation, splices out of range) or the result is not the
    plan its publisher wrote (the digest differs). Never a plan that nobody published."""
    held = previous.generation if previous is not None else None
    if delta.previous != held:
        raise DeltaMismatch(f"the delta applies to generation {delta.previous}, this node holds {held}")
    before = previous.nodes if previous is not None else ()
    nodes, at = [], 0
    for start, end, ids in delta.nodes:
        if not at <= start <= end <= len(before):
            raise DeltaMismatch(f"splice [{start}, {end}) does not fit {len(before)} node(s) after position {at}")
        nodes += before[at:start]
        nodes += ids
        at = end
    nodes += before[at:]
    nodes_t = tuple(nodes)
    try:
        plan = Plan.from_dict(
            {
                **_only_fields(delta.fields, Plan, "plan delta's fields", leave_out=("nodes", "joiners")),
                "nodes": nodes_t,
                "joiners": nodes_t if delta.every_node_joins else delta.joiners,
            }
        )
    except (ValueError, TypeError) as e:
        raise DeltaMismatch(f"the delta's plan is unreadable: {e}") from None
    if plan_digest(plan) != delta.digest:
        raise DeltaMismatch("the rebuilt plan is not the one published (digest differs)")
    return plan
