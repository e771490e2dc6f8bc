"""The data a job agrees on through etcd: who the nodes are and what each generation's plan is.

A *plan* is the whole truth about one generation: which nodes are active and in which group-rank
order, which nodes joined (fresh worker processes that need state from a peer), which left, and
where the generation's bootstrap store lives. Exactly one plan exists per generation because
plans are published with compare-and-swap (see ``rendezvous.membership``). Everything here is
plain data with a JSON form, so plans can be tested and logged without etcd.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

RUNNING, SUCCEEDED, FAILED = "running", "succeeded", "failed"


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
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError("a node record must be a JSON object")
        info = NodeInfo(**d)
        for name, kind in (("id", str), ("host", str), ("addr", str), ("store_port", int), ("nproc", int), ("pid", int), ("joined", (int, float))):
            value = getattr(info, name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"node record field '{name}' has the wrong type: {value!r}")
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

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "Plan":
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError("a plan must be a JSON object")
        for key in ("nodes", "joiners", "removed"):
            d[key] = tuple(d.get(key, ()))
        plan = Plan(**d)
        if not isinstance(plan.generation, int) or not isinstance(plan.nproc, int) or not all(isinstance(n, str) for n in plan.nodes):
            raise ValueError("plan fields have the wrong types")
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
