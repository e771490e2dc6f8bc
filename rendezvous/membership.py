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
state] worker samples, rewritten with each progress publish; ``ctl timeline`` draws it),
``log/breakdown/<gen>/plan`` and ``log/breakdown/<gen>/nodes/<node>`` (the stamps of a
generation change, one write by the planner that published it and one per active node:
``tm_launch.breakdown``).

Consistency: a plan changes only through compare-and-swap on ``state/plan``, one key, so a node
killed while publishing leaves either the old plan or the new one, never half of each. Everything
a crashing node may leave behind (a report, a history entry) is either harmless or re-derived.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

from .plan import NodeInfo, Plan
from .planner import View

from .kv import KV, Entry, KVError, Lease

log = logging.getLogger("rendezvous.membership")


class UnreadablePlan(KVError):
    """``state/plan`` holds something tm-launch never wrote: agents wait, changing nothing."""


def run_prefix(run_id: str) -> str:
    return f"/tm-launch/{run_id}/"


@dataclass(frozen=True)
class Snapshot:
    """One consistent read of ``state/`` plus the revision to watch from."""

    view: View
    plan_entry: Entry | None
    revision: int
    spares_alive: int
    plan_error: str = ""   # lenient reads only: why state/plan could not be read (plan is None)



class Membership:
    def __init__(self, kv: KV):
        self.kv = kv
        self.skipped: dict[str, str] = {}   # key -> why it was ignored (each is logged once)

    def _where(self, key: str) -> str:
        options = getattr(self.kv, "options", None)
        where = (options.prefix.rstrip("/") + "/" if options and options.prefix else "") + key
        return ascii(where)[1:-1]   # a key is input too: no newlines or terminal escapes in logs

    def _skip(self, key: str, error: Exception) -> None:
        """Ignore one unreadable value, and say so once per key: what it is and how to fix it."""
        why = " ".join(str(error).split())[:100] or type(error).__name__
        if key not in self.skipped:
            log.warning("ignoring etcd key %s: unreadable (%s); tm-launch never wrote that, "
                        "delete it (etcdctl del %s)", self._where(key), why, self._where(key))
        self.skipped[key] = why

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
    def snapshot(self, *, strict: bool = True) -> Snapshot:
        """``strict`` (agents): an unreadable plan raises KVError. Otherwise (operators' views)
        the snapshot has no plan and says why in ``plan_error``."""
        revision = self.kv.current_revision()
        entries = {e.key: e for e in self.kv.get_prefix("state/")}
        plan_entry = entries.get("state/plan")
        plan_error = ""
        try:
            plan = self._parse_plan(plan_entry)
        except UnreadablePlan as e:
            if strict:
                raise
            plan, plan_error = None, str(e)
        alive, failed, drains, reports, done = {}, {}, {}, {}, set()
        kinds, times = {}, {}
        gen = plan.generation if plan else -1
        for key, entry in entries.items():
            parts = key.split("/")
            kind = parts[1] if len(parts) > 1 else ""
            try:
                if kind in _DEPTH and len(parts) != _DEPTH[kind]:
                    raise ValueError("a key of an unexpected shape")
                if kind == "nodes":
                    info = NodeInfo.from_json(entry.value)
                    if info.id != parts[2]:
                        raise ValueError(f"its id {info.id[:40]!r} is not the key's")
                    alive[parts[2]] = info
                elif kind == "failed":
                    failed[parts[2]] = _reason(entry.value, "cordoned")
                elif kind == "drain":
                    drains[parts[2]] = _reason(entry.value, "drain requested")
                elif kind in ("reports", "done", "stores") and not parts[2].isdigit():
                    raise ValueError("the generation in the key is not a number")
                elif kind == "reports" and parts[2] == str(gen):
                    reason, report_kind, when = _report(entry.value)
                    reports[parts[3]], kinds[parts[3]], times[parts[3]] = reason, report_kind, when
                elif kind == "done" and parts[2] == str(gen):
                    _object(entry.value)
                    done.add(parts[3])
                elif kind == "live" and entry.value != "1":
                    raise ValueError("not the value tm-launch writes ('1')")
                elif kind == "stores":
                    _store(entry.value)
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                self._skip(key, e)  # a garbage value under our keys is ignored, never fatal
                continue
        view = View(
            plan=plan, alive=alive, failed=failed, reports=reports, drains=drains,
            done=frozenset(done), live=getattr(entries.get("state/live"), "value", None) == "1",
            report_kinds=kinds, report_times=times, now=time.time(),
        )
        active = set(plan.nodes) if plan else set()
        spares_alive = len([n for n in alive if n not in active and n not in failed])
        return Snapshot(view=view, plan_entry=plan_entry, revision=revision, spares_alive=spares_alive, plan_error=plan_error)

    def plan(self) -> Plan | None:
        """Only the current plan: one small read, where a snapshot reads every node's record."""
        return self._parse_plan(self.kv.get("state/plan"))

    def _parse_plan(self, entry: Entry | None) -> Plan | None:
        try:
            return Plan.from_json(entry.value) if entry else None
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            # Never guess over a plan we cannot read: agents stop changing the job and say why.
            why = " ".join(f"{type(e).__name__}: {e}".split())[:120]
            raise UnreadablePlan(
                f"the job's plan (etcd key {self._where('state/plan')}) is unreadable ({why}); nothing "
                "changes until it is restored (put back the newest log/history/ entry) or the job "
                "starts under a new --rdzv-id"
            ) from None

    def wait(self, revision: int, timeout: float) -> bool:
        """Block until something under ``state/`` changes after ``revision`` (or timeout)."""
        return self.kv.wait("state/", revision, timeout)

    def wait_plan(self, revision: int, timeout: float) -> bool:
        """Like ``wait``, but only for ``state/plan`` and ``state/planners/`` (one prefix covers
        both): what an agent that does not plan must see. At 1,000 nodes, waking every agent on
        every join or loss costs a thousand full reads per event; this wakes them once per plan,
        and when a planner leaves (its leased marker goes), so that the next one takes over."""
        return self.kv.wait("state/plan", revision, timeout)

    def watch(self) -> Iterator[tuple[str, int]]:
        """``wait``'s scope as a long-lived stream (``KV.watch_stream``): what a planner watches."""
        return self.kv.watch_stream("state/")

    def watch_plan(self) -> Iterator[tuple[str, int]]:
        """``wait_plan``'s scope as a long-lived stream: what an agent that does not plan watches."""
        return self.kv.watch_stream("state/plan")

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
        """{"addr", "port"}, or None while absent or unreadable (the host's own put replaces it)."""
        entry = self.kv.get(f"state/stores/{generation}")
        try:
            return _store(entry.value) if entry else None
        except (ValueError, TypeError) as e:
            self._skip(f"state/stores/{generation}", e)
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
                out[e.key] = _object(e.value)
            except ValueError as err:
                self._skip(e.key, err)
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
        """Node -> its progress record; records whose shape others rely on (``workers``: local
        rank -> a mapping) are checked here, once, so that readers can trust them."""
        out = {}
        for key, value in self._json_values("log/progress/").items():
            workers = value.get("workers", {})
            if key.count("/") != 2 or not isinstance(workers, dict) or not all(isinstance(w, dict) for w in workers.values()):
                self._skip(key, ValueError("not a progress record"))
                continue
            out[key.rsplit("/", 1)[-1]] = value
        return out

    def steps(self, node: str, samples: list) -> None:
        """Replace ``node``'s step series (bounded by the caller: tm_launch.timeline.append_samples)."""
        self.kv.put(f"log/steps/{node}", json.dumps({"node": node, "samples": samples}))

    def all_steps(self) -> dict[str, list]:
        return {
            key.rsplit("/", 1)[-1]: v["samples"]
            for key, v in self._json_values("log/steps/").items() if isinstance(v.get("samples"), list)
        }

    def downtime_stamps(self, generation: int, node: str | None, record: dict) -> None:
        """Record one agent's stamps of generation ``generation``'s change: the publishing
        planner's (``node`` None) or an active node's (once per generation, never per step)."""
        part = "plan" if node is None else f"nodes/{node}"
        self.kv.put(f"log/breakdown/{generation:08d}/{part}", json.dumps(record, sort_keys=True))

    def all_downtime_stamps(self) -> dict[int, dict]:
        """Generation -> {"plan": record or None, "nodes": {node: record}}; keys of any other
        shape are skipped like every unreadable value."""
        out: dict[int, dict] = {}
        for key, value in self._json_values("log/breakdown/").items():
            parts = key.split("/")
            if len(parts) < 4 or not parts[2].isdigit() or not (parts[3:] == ["plan"] or (len(parts) == 5 and parts[3] == "nodes")):
                self._skip(key, ValueError("a key of an unexpected shape"))
                continue
            entry = out.setdefault(int(parts[2]), {"plan": None, "nodes": {}})
            if parts[3] == "plan":
                entry["plan"] = value
            else:
                entry["nodes"][parts[4]] = value
        return out

    def reports_for(self, generation: int) -> dict[str, dict]:
        """The failure reports of ``generation`` ({node: {reason, kind, time}})."""
        return {key.rsplit("/", 1)[-1]: v for key, v in self._json_values(f"state/reports/{generation}/").items()}

    def history(self) -> list[Plan]:
        plans = []
        for e in self.kv.get_prefix("log/history/"):
            try:
                plans.append(Plan.from_json(e.value))
            except (ValueError, TypeError, KeyError) as err:
                self._skip(e.key, err)
        return plans


# Keys under state/ by kind and the number of path segments tm-launch writes for each.
_DEPTH = {"plan": 2, "live": 2, "nodes": 3, "failed": 3, "drain": 3, "reports": 4, "done": 4, "stores": 3}
_REPORT_KINDS = ("exit", "signal", "lost", "alarm", "state")


def _object(text: str) -> dict:
    """A JSON object, else ValueError (NaN and Infinity, which Python's json accepts, included)."""
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    if not isinstance(value, dict):
        raise ValueError(f"a JSON {type(value).__name__}, not an object")
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _reason(text: str, default: str) -> str:
    reason = _object(text).get("reason", default)
    if not isinstance(reason, str):
        raise ValueError("'reason' is not a string")
    return reason


def _report(text: str) -> tuple[str, str, float]:
    d = _object(text)
    reason, kind, when = d["reason"], d.get("kind", "lost"), d.get("time", 0.0)
    if not isinstance(reason, str) or kind not in _REPORT_KINDS:
        raise ValueError("'reason' is not a string or 'kind' is unknown")
    if isinstance(when, bool) or not isinstance(when, (int, float)):
        raise ValueError("'time' is not a number")
    return reason, kind, float(when)


def _store(text: str) -> dict:
    d = _object(text)
    addr, port = d.get("addr"), d.get("port")
    if not isinstance(addr, str) or isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError("not {addr: str, port: 1-65535}")
    return d
