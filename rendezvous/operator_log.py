"""The job's operator log in etcd: what the agents tell operators (``tm-launch ctl``), outside the
state the planner reads (``state/``, ``membership``). An agent reads some of it back (a peer's
progress, the nodes that stamped a generation), never in a snapshot.

Every key lives under ``/tm-launch/<run id>/log/``::

    log/history/<gen>           every plan, as published (``Membership.publish``)
    log/events/<t>-<node>       one event
    log/alarms/<node>/<signal>  an alarm, by node and signal
    log/progress/<node>         leased: step, generation, role
    log/steps/<node>            not leased: a bounded list of [time, generation, rank, step,
                                step_time, state] worker samples, rewritten with each progress
                                publish; ``ctl timeline`` draws it
    log/breakdown/<gen>/plan and log/breakdown/<gen>/nodes/<node>
                                the stamps of a generation change, one write by the planner that
                                published it and one per active node: ``tm_launch.joblog``

A value tm-launch never wrote is skipped like one under ``state/`` (``json_values``): a garbage
value must not break ``ctl status``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable

from .json_values import ValueReader, json_object
from .kv import KV, Lease
from .plan import Plan


class OperatorLog:
    def __init__(self, kv: KV, values: ValueReader):
        self.kv = kv
        self.values = values  # shared with the job's Membership: each unreadable key named once

    def plan_published(self, generation: int, text: str, *, backfill: bool = False) -> None:
        """``text``, generation ``generation``'s plan, into the history. ``backfill``: the plan a
        publish replaced, written only where missing (its publisher was killed before writing it)."""
        key = f"log/history/{generation:08d}"
        if backfill:
            self.kv.create(key, text)
        else:
            self.kv.put(key, text)

    def history(self) -> list[Plan]:
        plans = []
        for e in self.kv.get_prefix("log/history/"):
            try:
                plans.append(Plan.from_json(e.value))
            except (ValueError, TypeError, KeyError) as err:
                self.values.skip(e.key, err)
        return plans

    def event(self, node: str, kind: str, at: float | None = None, **fields) -> dict:
        """One event under ``log/events/``, keyed by when it happened (``at``; default now)."""
        at = time.time() if at is None else at
        record = {"time": at, "node": node, "kind": kind, **fields}
        self.kv.put(f"log/events/{int(at * 1e9):020d}-{node}", json.dumps(record, sort_keys=True))
        return record

    def events(self) -> list[dict]:
        return list(self.values.objects("log/events/").values())

    def alarm(self, node: str, name: str, record: dict) -> None:
        self.kv.put(f"log/alarms/{node}/{name}", json.dumps(record, sort_keys=True))

    def alarms(self) -> list[dict]:
        return list(self.values.objects("log/alarms/").values())

    def progress(self, node: str, record: dict, lease: Lease | None) -> None:
        self.kv.put(f"log/progress/{node}", json.dumps(record, sort_keys=True), lease=lease)

    def all_progress(self) -> dict[str, dict]:
        """Node -> its progress record; records whose shape others rely on (``workers``: local
        rank -> a mapping) are checked here, once, so that readers can trust them."""
        return self._progress_records(self.values.objects("log/progress/"))

    def progress_of(self, nodes: Iterable[str]) -> dict[str, dict]:
        """``all_progress`` for ``nodes`` alone, in one request: those whose agents publish one."""
        values = {}
        for key, entry in self.kv.get_many(f"log/progress/{n}" for n in nodes).items():
            try:
                values[key] = json_object(entry.value)
            except ValueError as err:
                self.values.skip(key, err)
        return self._progress_records(values)

    def _progress_records(self, values: dict[str, dict]) -> dict[str, dict]:
        out = {}
        for key, value in values.items():
            workers = value.get("workers", {})
            if key.count("/") != 2 or not isinstance(workers, dict) or not all(isinstance(w, dict) for w in workers.values()):
                self.values.skip(key, ValueError("not a progress record"))
                continue
            out[key.rsplit("/", 1)[-1]] = value
        return out

    def steps(self, node: str, samples: list) -> None:
        """Replace ``node``'s step series (bounded by the caller: tm_launch.joblog.append_samples)."""
        self.kv.put(f"log/steps/{node}", json.dumps({"node": node, "samples": samples}))

    def all_steps(self) -> dict[str, list]:
        return {
            key.rsplit("/", 1)[-1]: v["samples"]
            for key, v in self.values.objects("log/steps/").items()
            if isinstance(v.get("samples"), list)
        }

    def downtime_stamps(self, generation: int, node: str | None, record: dict) -> None:
        """Record one agent's stamps of generation ``generation``'s change: the publishing
        planner's (``node`` None) or an active node's (once per generation, never per step)."""
        part = "plan" if node is None else f"nodes/{node}"
        self.kv.put(f"log/breakdown/{generation:08d}/{part}", json.dumps(record, sort_keys=True))

    def stamped_nodes(self, generation: int) -> set[str]:
        """The nodes that recorded their stamps of generation ``generation`` (``downtime_stamps``):
        each does once all its workers completed a step in it."""
        return {e.key.rsplit("/", 1)[-1] for e in self.kv.get_prefix(f"log/breakdown/{generation:08d}/nodes/")}

    def all_downtime_stamps(self) -> dict[int, dict]:
        """Generation -> {"plan": record or None, "nodes": {node: record}}; keys of any other
        shape are skipped like every unreadable value."""
        out: dict[int, dict] = {}
        for key, value in self.values.objects("log/breakdown/").items():
            parts = key.split("/")
            if len(parts) < 4 or not parts[2].isdigit() or not (parts[3:] == ["plan"] or (len(parts) == 5 and parts[3] == "nodes")):
                self.values.skip(key, ValueError("a key of an unexpected shape"))
                continue
            entry = out.setdefault(int(parts[2]), {"plan": None, "nodes": {}})
            if parts[3] == "plan":
                entry["plan"] = value
            else:
                entry["nodes"][parts[4]] = value
        return out
