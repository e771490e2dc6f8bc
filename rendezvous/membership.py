"""The job's state in etcd: the one place that knows the key layout.

Every key lives under ``/tm-launch/<run id>/`` (the KV's prefix), so one job can neither read nor
change another's keys. Two subtrees:

``state/`` what the planner reads, in one range request::

    state/plan                  the current generation's Plan (JSON), replaced only by CAS
    state/nodes/<node>          NodeInfo, attached to the node's lease: gone when the node dies
    state/failed/<node>         cordoned nodes (durable; `ctl uncordon` removes)
    state/drain/<node>          planned-migration requests (`ctl drain`, degraded alarms)
    state/reports/<gen>/<node>  failures a node reported in generation <gen>
    state/done/<gen>/<node>     nodes whose workers finished in generation <gen>
    state/live                  present once the job's workers use the live API
    state/stores/<gen>          the env:// store (MASTER_ADDR/PORT) of a generation's fresh workers
    state/planners/<node>       leased marker of a designated planner (see ``wait_plan``)

``log/`` what operators read: ``log/history/<gen>`` (every plan), ``log/events/<t>-<node>``,
``log/alarms/<node>/<signal>``, ``log/progress/<node>`` (leased: step, generation, role),
``log/steps/<node>`` (not leased: a bounded list of [time, generation, rank, step, step_time,
state] worker samples, rewritten with each progress publish; ``ctl timeline`` draws it).

Consistency: a plan changes only through compare-and-swap on ``state/plan``, one key, so a node
killed while publishing leaves either the old plan or the new one, never half of each. Everything
a crashing node may leave behind (a report, a history entry) is either harmless or re-derived.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from tm_launch.plan import NodeInfo, Plan
from tm_launch.planner import View

from .kv import KV, Entry, KVError, Lease


def run_prefix(run_id: str) -> str:
    return f"/tm-launch/{run_id}/"


@dataclass(frozen=True)
class Snapshot:
    """One consistent read of ``state/`` plus the revision to watch from."""

    view: View
    plan_entry: Entry | None
    revision: int
    spares_alive: int


def _parse_plan(entry: Entry | None) -> Plan | None:
    try:
        return Plan.from_json(entry.value) if entry else None
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        # Never guess over a plan we cannot read: agents stop changing the job and say why.
        raise KVError(
            f"the job's plan in etcd (state/plan) is unreadable ({type(e).__name__}: {e}); "
            "restore it or start the job under a new --rdzv-id"
        ) from None


class Membership:
    def __init__(self, kv: KV):
        self.kv = kv

    # -- registration ---------------------------------------------------------------------
    def register(self, info: NodeInfo, ttl: float) -> Lease:
        lease = self.kv.grant(ttl)
        if not self.kv.create(f"state/nodes/{info.id}", info.to_json(), lease=lease):
            lease.revoke()
            raise ValueError(
                f"node id '{info.id}' is already registered in this job; pick another --node-id "
                "or wait for the old node's lease to expire"
            )
        return lease

    def leave(self, node: str) -> None:
        self.kv.delete(f"state/nodes/{node}")

    # -- reading ----------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        revision = self.kv.current_revision()
        entries = {e.key: e for e in self.kv.get_prefix("state/")}
        plan_entry = entries.get("state/plan")
        plan = _parse_plan(plan_entry)
        alive, failed, drains, reports, done = {}, {}, {}, {}, set()
        kinds, times = {}, {}
        gen = plan.generation if plan else -1
        for key, entry in entries.items():
            parts = key.split("/")
            kind = parts[1] if len(parts) > 1 else ""
            try:
                if kind == "nodes" and len(parts) == 3:
                    alive[parts[2]] = NodeInfo.from_json(entry.value)
                elif kind == "failed" and len(parts) == 3:
                    failed[parts[2]] = json.loads(entry.value).get("reason", "cordoned")
                elif kind == "drain" and len(parts) == 3:
                    drains[parts[2]] = json.loads(entry.value).get("reason", "drain requested")
                elif kind == "reports" and len(parts) == 4 and parts[2] == str(gen):
                    report = json.loads(entry.value)
                    reports[parts[3]] = str(report["reason"])
                    kinds[parts[3]] = str(report.get("kind", "lost"))
                    times[parts[3]] = float(report.get("time", 0.0))
                elif kind == "done" and len(parts) == 4 and parts[2] == str(gen):
                    done.add(parts[3])
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # a garbage value under our keys is ignored, never fatal
        view = View(
            plan=plan, alive=alive, failed=failed, reports=reports, drains=drains,
            done=frozenset(done), live="state/live" in entries,
            report_kinds=kinds, report_times=times, now=time.time(),
        )
        active = set(plan.nodes) if plan else set()
        spares_alive = len([n for n in alive if n not in active and n not in failed])
        return Snapshot(view=view, plan_entry=plan_entry, revision=revision, spares_alive=spares_alive)

    def plan(self) -> Plan | None:
        """Only the current plan: one small read, where a snapshot reads every node's record."""
        return _parse_plan(self.kv.get("state/plan"))

    def wait(self, revision: int, timeout: float) -> bool:
        """Block until something under ``state/`` changes after ``revision`` (or timeout)."""
        return self.kv.wait("state/", revision, timeout)

    def wait_plan(self, revision: int, timeout: float) -> bool:
        """Like ``wait``, but only for ``state/plan`` and ``state/planners/`` (one prefix covers
        both): what an agent that does not plan must see. At 1,000 nodes, waking every agent on
        every join or loss costs a thousand full reads per event; this wakes them once per plan,
        and when a planner leaves (its leased marker goes), so that the next one takes over."""
        return self.kv.wait("state/plan", revision, timeout)

    def mark_planner(self, node: str, lease: Lease | None) -> None:
        self.kv.put(f"state/planners/{node}", "1", lease=lease)

    def unmark_planner(self, node: str) -> None:
        self.kv.delete(f"state/planners/{node}")

    # -- writing ----------------------------------------------------------------------------
    def publish(self, plan: Plan, expected: Entry | None) -> bool:
        """Compare-and-swap the next plan in; False when someone else published first.

        History is written after the swap; a publisher killed in between leaves the previous
        plan's history entry missing, so every publish first backfills the plan it replaces."""
        if expected is not None:
            try:
                replaced = Plan.from_json(expected.value)
                self.kv.create(f"log/history/{replaced.generation:08d}", expected.value)
            except (ValueError, TypeError, KeyError):
                pass
        if expected is None:
            ok = self.kv.create("state/plan", plan.to_json())
        else:
            ok = self.kv.replace("state/plan", plan.to_json(), expected.revision)
        if ok:
            self.kv.put(f"log/history/{plan.generation:08d}", plan.to_json())
        return ok

    def report_failure(self, generation: int, node: str, reason: str, kind: str = "lost") -> None:
        """``kind``: "exit" (a worker exited non-zero), "signal", "lost" or "alarm" (see planner)."""
        self.kv.put(f"state/reports/{generation}/{node}", json.dumps({"reason": reason, "kind": kind, "time": time.time()}))

    def publish_store(self, generation: int, addr: str, port: int) -> None:
        """Where generation ``generation``'s fresh workers find their env:// store."""
        self.kv.put(f"state/stores/{generation}", json.dumps({"addr": addr, "port": port}))

    def store_for(self, generation: int) -> dict | None:
        entry = self.kv.get(f"state/stores/{generation}")
        try:
            return json.loads(entry.value) if entry else None
        except ValueError:
            return None

    def mark_done(self, generation: int, node: str) -> None:
        self.kv.put(f"state/done/{generation}/{node}", json.dumps({"time": time.time()}))

    def cordon(self, node: str, reason: str) -> None:
        self.kv.put(f"state/failed/{node}", json.dumps({"reason": reason, "time": time.time()}))

    def uncordon(self, node: str) -> bool:
        existed = self.kv.get(f"state/failed/{node}") is not None
        self.kv.delete(f"state/failed/{node}")
        self.kv.delete(f"state/drain/{node}")
        return existed

    def request_drain(self, node: str, reason: str) -> None:
        self.kv.put(f"state/drain/{node}", json.dumps({"reason": reason, "time": time.time()}))

    def clear_drain(self, node: str) -> None:
        self.kv.delete(f"state/drain/{node}")

    def set_live(self) -> None:
        self.kv.create("state/live", "1")

    # -- operator log -------------------------------------------------------------------------
    def event(self, node: str, kind: str, **fields) -> dict:
        record = {"time": time.time(), "node": node, "kind": kind, **fields}
        self.kv.put(f"log/events/{time.time_ns():020d}-{node}", json.dumps(record, sort_keys=True))
        return record

    def _json_values(self, prefix: str) -> dict[str, dict]:
        """Key -> JSON object under ``prefix``, skipping anything else (etcd content is input:
        a garbage value must not break ``ctl status``)."""
        out = {}
        for e in self.kv.get_prefix(prefix):
            try:
                value = json.loads(e.value)
            except ValueError:
                continue
            if isinstance(value, dict):
                out[e.key] = value
        return out

    def events(self) -> list[dict]:
        return list(self._json_values("log/events/").values())

    def alarm(self, node: str, name: str, record: dict) -> None:
        self.kv.put(f"log/alarms/{node}/{name}", json.dumps(record, sort_keys=True))

    def alarms(self) -> list[dict]:
        return list(self._json_values("log/alarms/").values())

    def progress(self, node: str, record: dict, lease: Lease | None) -> None:
        self.kv.put(f"log/progress/{node}", json.dumps(record, sort_keys=True), lease=lease)

    def all_progress(self) -> dict[str, dict]:
        return {key.rsplit("/", 1)[-1]: v for key, v in self._json_values("log/progress/").items()}

    def steps(self, node: str, samples: list) -> None:
        """Replace ``node``'s step series (bounded by the caller: tm_launch.timeline.append_samples)."""
        self.kv.put(f"log/steps/{node}", json.dumps({"node": node, "samples": samples}))

    def all_steps(self) -> dict[str, list]:
        return {
            key.rsplit("/", 1)[-1]: v["samples"]
            for key, v in self._json_values("log/steps/").items() if isinstance(v.get("samples"), list)
        }

    def reports_for(self, generation: int) -> dict[str, dict]:
        """The failure reports of ``generation`` ({node: {reason, kind, time}})."""
        return {key.rsplit("/", 1)[-1]: v for key, v in self._json_values(f"state/reports/{generation}/").items()}

    def history(self) -> list[Plan]:
        plans = []
        for e in self.kv.get_prefix("log/history/"):
            try:
                plans.append(Plan.from_json(e.value))
            except (ValueError, TypeError, KeyError):
                continue
        return plans
