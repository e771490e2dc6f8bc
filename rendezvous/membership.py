"""The job's state in etcd: the one place that knows the key layout.

Every key lives under ``/tm-launch/<run id>/`` (the KV's prefix), so one job can neither read nor
change another's keys. Two subtrees:

``state/`` what the planner reads, in one range request::

    state/plan                  the current generation's Plan (JSON), replaced only by CAS
    state/plan-feed/delta       the PlanDelta from the previous plan to the current one, written
                                in the plan's own CAS transaction (v3; v2 writes none)
    state/plan-feed/planners/<node>  leased marker of a designated planner; its value names the
                                planners that planner chose (``planner.planners``)
    state/nodes/<node>          NodeInfo, attached to the node's lease: gone when the node dies
    state/failed/<node>         cordoned nodes (durable; `ctl uncordon` removes)
    state/warm/<node>           leased marker of a spare whose workers have warmed up and parked:
                                a plan promotes warm spares first (``planner.spares``)
    state/drain/<node>          planned-migration requests (`ctl drain`, degraded alarms)
    state/reports/<gen>/<node>  failures a node reported in generation <gen>
    state/done/<gen>/<node>     nodes whose workers finished in generation <gen>
    state/live                  present once the job's workers use the live API
    state/stores/<gen>          the env:// store (MASTER_ADDR/PORT) of a generation's fresh workers

``state/plan-feed/`` is all that most agents watch (``watch_plan``, ``refresh``): the few that
plan read everything, the others (``planner.follows_only``) learn each new plan from its delta
(which carries the registrations of the nodes new to them) and whether they must start planning
from the markers, O(1) bytes and no request per event. It is a prefix of
its own because a v3 watch event carries the value: a watch that covered ``state/plan`` would
deliver every node's id to every node on every plan. Because the events carry the values, the
readers keep copies (``state_mirror``: the whole of ``state/`` for those that read it, the feed
for a follower) and read etcd only when a copy cannot be trusted; a follower is woken only by a
new delta, a marker naming it or no marker left (``marker_watch``).

``log/`` what operators read: ``operator_log.py`` has its keys (``Membership.operator_log``).

Consistency: a plan changes only through compare-and-swap on ``state/plan``, one key, so a node
killed while publishing leaves either the old plan or the new one, never half of each; its delta
is written in the same transaction, so it always describes the plan beside it. Everything a
crashing node may leave behind (a report, a history entry) is either harmless or re-derived.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from . import marker_watch
from .json_values import ValueReader, json_object
from .kv import KV, Entry, KVError, Lease, Listing, WatchNews
from .operator_log import OperatorLog
from .plan import DeltaMismatch, NodeInfo, Plan, PlanDelta, apply_delta, fresh_nodes, plan_delta, plan_digest
from .planner import PLANNERS, View, follows_only, planners, spares
from .state_mirror import StateMirror

log = logging.getLogger("rendezvous.membership")


class UnreadablePlan(KVError):
    """``state/plan`` holds something tm-launch never wrote: agents wait, changing nothing."""


def run_prefix(run_id: str) -> str:
    return f"/tm-launch/{run_id}/"


FEED = "state/plan-feed/"
DELTA = FEED + "delta"
PLANNER_MARKERS = FEED + "planners/"


@dataclass(frozen=True)
class Snapshot:
    """One consistent read of ``state/`` plus the revision to watch from.

    ``partial`` (``Membership.refresh``): brought up to date from the plan feed, not read whole.
    Its plan is exact and ``live`` is read; ``alive`` holds only records known to be current: the
    last whole read's (none for a node that joined while the first plan formed), less the nodes
    the plan removed or took in again, plus the records the deltas carried and those read for what
    the node acts on (``with_records``); failed and drains are the last whole read's; reports and
    done are empty after a generation change. ``plan_entry`` is None: a partial view is never
    planned on."""

    view: View
    plan_entry: Entry | None
    revision: int
    spares_alive: int  # planner.spares, counted; partial: as the last delta's publisher counted them
    plan_error: str = ""  # lenient reads only: why state/plan could not be read (plan is None)
    planners: tuple[str, ...] = ()  # who plans (planner.planners; partial: as the markers say)
    partial: bool = False


def _writes_state(method):
    """A method that writes under ``state/``: the next whole snapshot is read, not mirrored, so
    that it holds the write (the watch stream may not have delivered it yet)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        self.state_mirror.wrote = self.feed_mirror.wrote = True
        return method(self, *args, **kwargs)

    return wrapper


class Membership:
    def __init__(self, kv: KV):
        self.kv = kv
        self.values = ValueReader(kv)  # reads JSON values; records the keys skipped (operator_log too)
        self.operator_log = OperatorLog(kv, self.values)  # log/, what operators read
        self.state_mirror = StateMirror()  # a whole reader's copy of state/, between reads
        self.feed_mirror = StateMirror(max_age_s=None)  # a follower's copy of the plan feed

    @property
    def skipped(self) -> dict[str, str]:
        """Key -> why it was ignored, for every unreadable key under ``state/`` or ``log/``."""
        return self.values.skipped

    # -- registration ---------------------------------------------------------------------
    @_writes_state
    def register(self, info: NodeInfo, ttl: float, again: bool = False) -> Lease:
        """Register ``info`` on a new lease of ``ttl``; ValueError when the id is taken.

        ``again``: a running agent registers anew after its lease was lost. Its old record may
        still be there (its TTL not quite run out: v2 expires each key on its own), or an earlier
        attempt may have created it and lost the answer (the outcome of a create is then
        unknown); a record equal to its own (the same process, address and join time) is one of
        those, so it is replaced rather than taken for another agent's."""
        key = f"state/nodes/{info.id}"
        lease = self.kv.grant(ttl)
        created = self.kv.create(key, info.to_json(), lease=lease)
        if not created and again:
            # Still there: the old lease's record, not expired yet or expiring this moment (gone by
            # the time it is read), or the record of an attempt whose answer was lost. Ours
            # either way when it is absent now or equal to ours (the same process, address and
            # join time); another agent's otherwise.
            mine = self.kv.get(key)
            if mine is None or mine.value == info.to_json():
                if mine is not None:
                    self.kv.delete(key)
                created = self.kv.create(key, info.to_json(), lease=lease)
        if not created:
            lease.revoke()
            raise ValueError(
                f"node id '{info.id}' is already registered in this job; pick another --node-id or wait for the old node's lease to expire"
            )
        return lease

    @_writes_state
    def leave(self, node: str) -> None:
        self.kv.delete(f"state/nodes/{node}")

    # -- reading ----------------------------------------------------------------------------
    def snapshot(self, *, strict: bool = True, listing: Listing | None = None) -> Snapshot:
        """``strict`` (agents): an unreadable plan raises KVError. Otherwise (operators' views)
        the snapshot has no plan and says why in ``plan_error``. ``listing``: ``state/`` as
        already read (the mirror's); else it is read now."""
        if listing is None:
            listing = self.kv.get_prefix("state/")
        revision, entries = listing.revision, {e.key: e for e in listing}
        plan_entry = entries.get("state/plan")
        plan_error = ""
        try:
            plan = self._parse_plan(plan_entry)
        except UnreadablePlan as e:
            if strict:
                raise
            plan, plan_error = None, str(e)
        alive, failed, drains, reports, done, warm = {}, {}, {}, {}, set(), set()
        kinds, times = {}, {}
        gen = plan.generation if plan else -1
        for key, entry in entries.items():
            parts = key.split("/")
            kind = parts[1] if len(parts) > 1 else ""
            try:
                if kind in _DEPTH and len(parts) != _DEPTH[kind]:
                    raise ValueError("a key of an unexpected shape")
                if kind == "nodes":
                    alive[parts[2]] = _node_record(parts[2], entry.value)
                elif kind == "failed":
                    failed[parts[2]] = _reason(entry.value, "cordoned")
                elif kind == "drain":
                    drains[parts[2]] = _reason(entry.value, "drain requested")
                elif kind == "warm":
                    json_object(entry.value)
                    warm.add(parts[2])
                elif kind in ("reports", "done", "stores") and not parts[2].isdigit():
                    raise ValueError("the generation in the key is not a number")
                elif kind == "reports" and parts[2] == str(gen):
                    reason, report_kind, when = _report(entry.value)
                    reports[parts[3]], kinds[parts[3]], times[parts[3]] = reason, report_kind, when
                elif kind == "done" and parts[2] == str(gen):
                    json_object(entry.value)
                    done.add(parts[3])
                elif kind == "live" and entry.value != "1":
                    raise ValueError("not the value tm-launch writes ('1')")
                elif kind == "stores":
                    _store(entry.value)
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                self.values.skip(key, e)  # a garbage value under our keys is ignored, never fatal
                continue
        view = View(
            plan=plan,
            alive=alive,
            failed=failed,
            reports=reports,
            drains=drains,
            done=frozenset(done),
            warm=frozenset(warm),
            live=getattr(entries.get("state/live"), "value", None) == "1",
            report_kinds=kinds,
            report_times=times,
            now=time.time(),
        )
        return Snapshot(
            view=view,
            plan_entry=plan_entry,
            revision=revision,
            spares_alive=len(spares(view)),
            plan_error=plan_error,
            planners=planners(view),
        )

    def refresh(self, previous: Snapshot | None, node: str, *, fresh: bool = False) -> Snapshot:
        """The job's state as agent ``node`` needs it next, for the least reading.

        A node that only follows plans (``planner.follows_only``, judged on ``previous``) reads
        the plan feed, O(1) bytes: the delta, applied to the plan it holds, with the records of
        the nodes that joined its plan, and the planner markers (a record the delta lacks is read,
        one key each). Anything else
        is a whole snapshot: no plan held, a backend without transactions (v2 publishes no
        delta), a delta that is not for the plan held (a generation missed) or that does not
        rebuild the published plan, no planner left (someone must take over), a marker naming
        this node a planner, or a new plan that gives this node another role (group rank 0, a
        live joiner). A follower never acts on a plan nobody published. The feed and the whole
        state come from the copies the watch streams keep (``feed_mirror``, ``state_mirror``)
        when those can be trusted and ``fresh`` (a read that shows etcd answers) is not asked for;
        a failed read makes both copies untrusted until a read gets through."""
        try:
            return self._read(previous, node, fresh)
        except KVError:
            self.state_mirror.forget()  # etcd did not answer: no view until it does
            self.feed_mirror.forget()
            raise

    def _read(self, previous: Snapshot | None, node: str, fresh: bool) -> Snapshot:
        if not self.kv.transactions:
            return self._whole(fresh)
        if previous is None:
            return self._join(node, fresh)
        if not follows_only(previous.view, node, node in previous.planners):
            return self._whole(fresh)
        revision, feed = self._feed(fresh)
        markers = _markers(feed, self.values.skip)
        chosen = tuple(sorted({name for names in markers.values() for name in names}))
        if not markers or node in chosen:
            return self._whole(fresh)
        moved = _delta_plan(previous.view.plan, feed.get(DELTA), self.values.skip)
        if moved is None:
            return self._whole(fresh)
        plan, delta = moved
        view = self._moved_on(previous.view, plan, delta.records if delta else ())
        if not follows_only(view, node, planning=False):
            return self._whole(fresh)
        counted = delta.spares if delta is not None and delta.spares is not None else previous.spares_alive
        return Snapshot(view=view, plan_entry=None, revision=revision, spares_alive=counted, planners=chosen, partial=True)

    def _join(self, node: str, fresh: bool) -> Snapshot:
        """The first read of an agent that just registered. While generation 0 forms and the
        planners are all chosen without this node (a full set named in their markers: they joined
        first), it only follows: it waits for the first plan's delta like any follower, and
        reads no node's record (N joiners reading the whole state read O(N^2) bytes). Anything
        else (a plan already published, planners still being chosen, a marker naming it) is a
        whole read."""
        revision, feed = self._feed(fresh)
        chosen = tuple(sorted({name for names in _markers(feed, self.values.skip).values() for name in names}))
        if DELTA in feed or len(chosen) < PLANNERS or node in chosen:
            return self._whole(fresh)
        view = View(plan=None, alive={}, failed={}, reports={}, drains={}, done=frozenset(), live=False, now=time.time())
        return Snapshot(view=view, plan_entry=None, revision=revision, spares_alive=0, planners=chosen, partial=True)

    def _feed(self, fresh: bool) -> tuple[int, dict[str, Entry]]:
        """The plan feed (the delta and the planner markers) as of its revision: the copy its
        watch stream keeps, unless that cannot be trusted or ``fresh`` asks for a read."""
        listing = None if fresh else self.feed_mirror.listing()
        if listing is None:
            listing = self.kv.get_prefix(FEED)
            self.feed_mirror.seed(listing)
        return listing.revision, {e.key: e for e in listing}

    def with_records(self, snap: Snapshot, nodes: Iterable[str]) -> Snapshot:
        """``snap`` holding the registrations of ``nodes`` (the peers its agent connects to),
        those it lacks read now, in one request. Only a partial view lacks records of live nodes (it
        holds those it acts on, not every node's: see ``Snapshot``); a whole view is returned
        as it is, and a node whose record is gone stays out (it is dead)."""
        missing = [n for n in nodes if n not in snap.view.alive] if snap.partial else []
        if not missing:
            return snap
        alive = dict(snap.view.alive)
        entries = self.kv.get_many(f"state/nodes/{n}" for n in missing)
        for n in missing:
            info = self._record_of(n, entries.get(f"state/nodes/{n}"))
            if info is not None:
                alive[n] = info
        return dataclasses.replace(snap, view=dataclasses.replace(snap.view, alive=alive))

    def joined(self) -> int:
        """How many nodes are registered now, without reading their records."""
        return self.kv.count("state/nodes/")

    def reports_for(self, generation: int) -> dict[str, dict]:
        """The failure reports of ``generation`` ({node: {reason, kind, time}})."""
        return {key.rsplit("/", 1)[-1]: v for key, v in self.values.objects(f"state/reports/{generation}/").items()}

    def _whole(self, fresh: bool) -> Snapshot:
        listing = None if fresh else self.state_mirror.listing()
        if listing is None:
            listing = self.kv.get_prefix("state/")
            self.state_mirror.seed(listing)
            self.feed_mirror.seed(Listing([e for e in listing if e.key.startswith(FEED)], listing.revision))
        return self.snapshot(listing=listing)

    def _moved_on(self, before: View, plan: Plan | None, records: tuple[NodeInfo, ...]) -> View:
        """``before`` moved on to ``plan``: the registrations of its ``fresh_nodes`` are those
        ``records`` (the delta's) carry, the held ones are dropped (their agent may have
        registered again), and a record the delta lacks is read only when the node acts on it
        (``with_records``); ``state/live`` is read until it is seen."""
        if plan is before.plan:
            return dataclasses.replace(before, now=time.time())
        fresh = fresh_nodes(before.plan, plan)
        sent = {r.id: r for r in records}
        gone = set(plan.removed) | set(fresh)
        alive = {n: info for n, info in before.alive.items() if n not in gone}
        alive.update((n, sent[n]) for n in fresh if n in sent)
        live = before.live or getattr(self.kv.get("state/live"), "value", None) == "1"
        same_gen = before.plan is not None and plan.generation == before.plan.generation
        return dataclasses.replace(
            before,
            plan=plan,
            alive=alive,
            live=live,
            now=time.time(),
            reports=before.reports if same_gen else {},
            report_kinds=before.report_kinds if same_gen else {},
            report_times=before.report_times if same_gen else {},
            done=before.done if same_gen else frozenset(),
        )

    def node_record(self, node: str) -> NodeInfo | None:
        """``node``'s registration now, one key: None when it is gone or unreadable."""
        return self._record_of(node, self.kv.get(f"state/nodes/{node}"))

    def _record_of(self, node: str, entry: Entry | None) -> NodeInfo | None:
        try:
            return _node_record(node, entry.value) if entry is not None else None
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            self.values.skip(f"state/nodes/{node}", e)
            return None

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
                f"the job's plan (etcd key {self.values.where('state/plan')}) is unreadable ({why}); nothing "
                "changes until it is restored (put back the newest log/history/ entry) or the job "
                "starts under a new --rdzv-id"
            ) from None

    def wait(self, revision: int, timeout: float) -> bool:
        """Block until something under ``state/`` changes after ``revision`` (or timeout)."""
        return self.kv.wait("state/", revision, timeout)

    def watch(self) -> Iterator[WatchNews]:
        """``wait``'s scope as a long-lived stream (``KV.watch_stream``): what a planner watches.
        Its changes keep ``state_mirror`` up to date."""
        return self.state_mirror.follow(self.kv.watch_stream("state/"))

    def watch_plan(self, node: str) -> Iterator[WatchNews]:
        """The plan feed as a long-lived stream: what ``node``, an agent that does not plan,
        watches. Its changes keep ``feed_mirror`` up to date; it reports only those that call
        for a read (``marker_watch``: a new plan, a marker naming ``node``, no planner left).
        At 1,000 nodes, waking every agent on every join or loss costs a thousand reads per
        event. v2 has no delta: the ``state/plan`` prefix covers the plan and the feed."""
        if not self.kv.transactions:
            return self.kv.watch_stream("state/plan")
        return self._calling_for_a_read(node, self.feed_mirror.follow(self.kv.watch_stream(FEED)))

    def _calling_for_a_read(self, node: str, stream: Iterator[WatchNews]) -> Iterator[WatchNews]:
        for news in stream:
            if news.kind == "event" and news.changes is not None:
                markers = self.feed_mirror.values(PLANNER_MARKERS)
                if not any(marker_watch.matters(node, c, PLANNER_MARKERS, markers, _marker_names) for c in news.changes):
                    continue
            yield news

    @_writes_state
    def mark_planner(self, node: str, lease: Lease | None, chosen: tuple[str, ...]) -> None:
        """``node`` plans, with ``chosen`` (itself among them): the followers' only way to learn
        that they must start planning, since none of them reads enough to work it out."""
        self.kv.put(f"{PLANNER_MARKERS}{node}", json.dumps({"planners": list(chosen)}), lease=lease)

    @_writes_state
    def unmark_planner(self, node: str) -> None:
        self.kv.delete(f"{PLANNER_MARKERS}{node}")

    # -- writing ----------------------------------------------------------------------------
    @_writes_state
    def publish(self, plan: Plan, expected: Entry | None, records: Mapping[str, NodeInfo] | None = None, spares: int | None = None) -> bool:
        """Compare-and-swap the next plan in; False when someone else published first.
        ``records``: the registrations the planner read (``View.alive``); the delta carries those
        of the nodes the followers do not hold yet, and ``spares``, the spares beside the plan.

        History is written after the swap; a publisher killed in between leaves the previous
        plan's history entry missing, so every publish first backfills the plan it replaces."""
        replaced = None
        if expected is not None:
            try:
                replaced = Plan.from_json(expected.value)
                self.operator_log.plan_published(replaced.generation, expected.value, backfill=True)
            except (ValueError, TypeError, KeyError):
                pass
        # The delta from the plan this one replaces (from nothing if that was unreadable: then
        # no follower holds it, and they read the whole state), in the same transaction.
        feed = {DELTA: plan_delta(replaced, plan, records, spares).to_json()} if self.kv.transactions else {}
        if expected is None:
            ok = self.kv.create("state/plan", plan.to_json(), also=feed)
        else:
            ok = self.kv.replace("state/plan", plan.to_json(), expected.revision, also=feed)
        if ok:
            self.operator_log.plan_published(plan.generation, plan.to_json())
        return ok

    @_writes_state
    def report_failure(self, generation: int, node: str, reason: str, kind: str = "lost") -> None:
        """``kind``: "exit" (a worker exited non-zero), "signal", "lost", "alarm", "state", "refused" or "script" (see planner)."""
        self.kv.put(f"state/reports/{generation}/{node}", json.dumps({"reason": reason, "kind": kind, "time": time.time()}))

    @_writes_state
    def publish_store(self, generation: int, addr: str, port: int) -> None:
        """Where generation ``generation``'s fresh workers find their env:// store."""
        self.kv.put(f"state/stores/{generation}", json.dumps({"addr": addr, "port": port}))

    def store_for(self, generation: int) -> dict | None:
        """{"addr", "port"}, or None while absent or unreadable (the host's own put replaces it)."""
        entry = self.kv.get(f"state/stores/{generation}")
        try:
            return _store(entry.value) if entry else None
        except (ValueError, TypeError) as e:
            self.values.skip(f"state/stores/{generation}", e)
            return None

    @_writes_state
    def mark_done(self, generation: int, node: str) -> None:
        self.kv.put(f"state/done/{generation}/{node}", json.dumps({"time": time.time()}))

    @_writes_state
    def mark_warm(self, node: str, lease: Lease | None) -> None:
        """``node`` is a spare whose workers warmed up and parked. Leased: a spare that dies
        takes its marker along, and a stale one (its workers died since) only costs a promotion
        what it costs without markers (the spare warms up first)."""
        self.kv.put(f"state/warm/{node}", json.dumps({"time": time.time()}), lease=lease)

    @_writes_state
    def unmark_warm(self, node: str) -> None:
        self.kv.delete(f"state/warm/{node}")

    @_writes_state
    def cordon(self, node: str, reason: str) -> None:
        self.kv.put(f"state/failed/{node}", json.dumps({"reason": reason, "time": time.time()}))

    @_writes_state
    def uncordon(self, node: str) -> bool:
        existed = self.kv.get(f"state/failed/{node}") is not None
        self.kv.delete(f"state/failed/{node}")
        self.kv.delete(f"state/drain/{node}")
        return existed

    @_writes_state
    def request_drain(self, node: str, reason: str) -> None:
        self.kv.put(f"state/drain/{node}", json.dumps({"reason": reason, "time": time.time()}))

    @_writes_state
    def set_live(self) -> None:
        self.kv.create("state/live", "1")


# Keys under state/ by kind and the number of path segments tm-launch writes for each.
_DEPTH = {"plan": 2, "live": 2, "nodes": 3, "failed": 3, "drain": 3, "warm": 3, "reports": 4, "done": 4, "stores": 3}
_REPORT_KINDS = ("exit", "signal", "lost", "alarm", "state", "refused", "script")


def _node_record(node: str, text: str) -> NodeInfo:
    """The record under ``state/nodes/<node>``: a NodeInfo whose id is the key's."""
    info = NodeInfo.from_json(text)
    if info.id != node:
        raise ValueError(f"its id {info.id[:40]!r} is not the key's")
    return info


def _marker_names(text: str) -> tuple[str, ...]:
    names = json_object(text).get("planners")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError("'planners' is not a list of node ids")
    return tuple(names)


def _markers(entries: dict[str, Entry], skip: Callable[[str, Exception], None]) -> dict[str, tuple[str, ...]]:
    """The readable planner markers among ``entries``: key -> the planners it names (``skip``: the
    others)."""
    markers = {}
    for key, entry in entries.items():
        if not key.startswith(PLANNER_MARKERS):
            continue
        try:
            if "/" in key[len(PLANNER_MARKERS) :]:
                raise ValueError("a key of an unexpected shape")
            markers[key] = _marker_names(entry.value)
        except ValueError as e:
            skip(key, e)
    return markers


def _delta_plan(
    held: Plan | None, entry: Entry | None, skip: Callable[[str, Exception], None]
) -> tuple[Plan | None, PlanDelta | None] | None:
    """The published plan, from ``held`` and the feed's delta, with the delta that moved it
    on (None when the plan stands); None when only a whole read can tell (no delta, an
    unreadable one, or one that does not fit ``held``)."""
    if entry is None:
        return (None, None) if held is None else None  # no plan yet: generation 0 forms
    try:
        delta = PlanDelta.from_json(entry.value)
    except ValueError as e:
        skip(DELTA, e)
        return None
    if held is not None and delta.generation == held.generation and delta.digest == plan_digest(held):
        return held, None  # woken by a marker, or by nothing: the plan stands
    try:
        return apply_delta(held, delta), delta
    except DeltaMismatch as e:
        log.debug("plan delta for generation %s not applied (%s): reading the whole state", delta.generation, e)
        return None


def _reason(text: str, default: str) -> str:
    reason = json_object(text).get("reason", default)
    if not isinstance(reason, str):
        raise ValueError("'reason' is not a string")
    return reason


def _report(text: str) -> tuple[str, str, float]:
    d = json_object(text)
    reason, kind, when = d["reason"], d.get("kind", "lost"), d.get("time", 0.0)
    if not isinstance(reason, str) or kind not in _REPORT_KINDS:
        raise ValueError("'reason' is not a string or 'kind' is unknown")
    if isinstance(when, bool) or not isinstance(when, (int, float)):
        raise ValueError("'time' is not a number")
    return reason, kind, float(when)


def _store(text: str) -> dict:
    d = json_object(text)
    addr, port = d.get("addr"), d.get("port")
    if not isinstance(addr, str) or isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError("not {addr: str, port: 1-65535}")
    return d
