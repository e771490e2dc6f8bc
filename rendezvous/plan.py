"""The data a job agrees on through etcd: who the nodes are and what each generation's plan is.

A *plan* is the whole truth about one generation: which nodes are active and in which group-rank
order, which nodes joined (fresh worker processes that need state from a peer), which left, and
where the generation's bootstrap store lives. Exactly one plan exists per generation because
plans are published with compare-and-swap (see ``rendezvous.membership``). Everything here is
plain data with a JSON form, so plans can be tested and logged without etcd.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, fields

RUNNING, SUCCEEDED, FAILED = "running", "succeeded", "failed"


def _loads(text: str):
    """json.loads for etcd content: deeply nested junk raises ValueError, not RecursionError."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _record(text: str, cls, what: str) -> dict:
    """Parse one record of etcd content: a JSON object with none but ``cls``'s fields."""
    d = _loads(text)
    if not isinstance(d, dict):
        raise ValueError(f"a {what} must be a JSON object")
    unknown = set(d) - {f.name for f in fields(cls)}
    if unknown:
        raise ValueError(f"a {what} has unknown field(s) {_short(sorted(unknown))}")
    return d


def _check_types(record, what: str, kinds) -> None:
    """Every (field, type) in ``kinds`` holds; a bool never passes for a number."""
    for name, kind in kinds:
        value = getattr(record, name)
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise ValueError(f"{what} field '{name}' has the wrong type: {_short(value)}")


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
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "NodeInfo":
        """Parse and type-check a registration (etcd content is input, not trusted)."""
        info = NodeInfo(**_record(text, NodeInfo, "node record"))
        _check_types(info, "node record", (("id", str), ("host", str), ("addr", str), ("store_port", int), ("nproc", int),
                                           ("pid", int), ("joined", (int, float))))
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
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "Plan":
        d = _record(text, Plan, "plan")
        for key in ("nodes", "joiners", "removed"):
            if not isinstance(d.get(key, ()), list) or not all(isinstance(n, str) for n in d.get(key, ())):
                raise ValueError(f"plan field '{key}' must be a list of node ids")
            d[key] = tuple(d.get(key, ()))
        plan = Plan(**d)
        # etcd content is input: every field an agent acts on is type-checked, so that a bad
        # plan is refused here, in one place, rather than crashing an agent later.
        _check_types(plan, "plan", (("generation", int), ("nproc", int), ("restarts", int), ("store", dict),
                                    ("cause", str), ("replaced", dict), ("live", bool), ("planned", bool),
                                    ("state", str), ("reason", str), ("created", (int, float))))
        if plan.generation < 0 or plan.nproc < 0 or plan.state not in (RUNNING, SUCCEEDED, FAILED):  # torchrun's handler: nproc 0
            raise ValueError("plan has an out-of-range generation, nproc or state")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in plan.replaced.items()):
            raise ValueError("plan field 'replaced' must map node ids to node ids")
        return plan

    def next(self, **changes) -> "Plan":
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
            planned=False,
            state=RUNNING,
            reason="",
            created=time.time(),
        )
        base.update(changes)
        return Plan(**base)
