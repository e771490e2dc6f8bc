"""The agent's side of C4-style stuck-collective detection (the rule: ``health/culprit.py``).

Each iteration of the agent's loop, ``CollectiveWatch.check``:

1. reads its live workers' telemetry pages (``tm_launch.collective_page``: files in the agent's
   scratch directory that the workers map and write on every collective) and turns them into
   records with ages, plus whether each worker is *frozen* (``/proc/PID/stat`` says stopped, or
   it has been outside any collective and its heartbeat thread silent for
   ``collective_frozen_after``);
2. leaves those records under ``c4/records`` in its own store (a local write, no etcd), where a
   deciding agent reads them only when a stall is suspected;
3. suspects a stall when a local worker has waited in a collective past the group's stuck limit.
   The first two nodes of the plan decide (two, so that a decider that is itself the culprit's
   node, or cut off, is not alone); any other suspecting agent pokes them (``c4/suspect`` in
   their stores). A decider that suspects, or was poked, reads every node's ``c4/records``
   (a node whose agent does not answer is *unreachable*) and applies ``health.culprit.judge``;
4. acts on the verdict: a culprit rank's agent is asked (``c4/kill`` in its store) to SIGKILL
   that worker, which then fails like any killed worker (the failure report, the live plan, the
   survivors giving up the changed communicators at once); an unreachable minority is reported
   lost through etcd. Every verdict that blames, or that finds a stuck collective it cannot
   blame yet, is an event with its evidence (``ctl events``).

Costs while nothing is stuck: per iteration, one file read per local worker and one write and
two key checks on the agent's own store. The N store reads of a decision happen only while a
collective is stuck. Restart-mode workers have no live groups and so no page: the heartbeat
watchdog (``supervisor.watch_hangs``) is what watches them.
"""

from __future__ import annotations

import datetime
import json
import socket
import time
from collections.abc import Callable

from health.culprit import CUT, KILL, NONE, GroupRecord, Limits, RankRecord, judge
from health.progress import BUSY, FROZEN, STUCK, UNKNOWN
from rendezvous.kv import KVError
from rendezvous.plan import Plan
from rendezvous.planner import View

from .. import collective_page
from ..protocol import WorkerKeys
from .config import AgentConfig
from .session import EtcdSession
from .supervisor import WorkerSupervisor

RECORDS, SUSPECT, KILL_KEY = "c4/records", "c4/suspect", "c4/kill"
DECIDERS = 2  # the first nodes of the plan decide
POKE_EVERY = 0.5  # s between two pokes of the deciders by one suspecting agent
DECIDE_EVERY = 0.2  # s between two gatherings of every node's records
CONNECT_TIMEOUT = 0.3  # s: a peer agent that does not accept within this is unreachable
SILENT_AFTER = 2.5  # s without a progress record in etcd (written every second): the node reaches no etcd either
BUSY_EVERY = 60.0  # s between two reports of a rank busy outside its collectives


def _duration(seconds: float) -> str:
    """``3m10s``, ``45s``."""
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


def frozen_process(pid: int) -> bool:
    """Is ``pid`` stopped (SIGSTOP, a debugger)? Its threads then neither run nor beat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def record_from_page(page, node: str, rank: int, now: float, frozen: bool, step_time: float, progress=None) -> dict:
    """One rank's record for the exchange (ages in seconds at ``now``, the reader's clock).
    ``progress``: ``(verdict, seconds without progress, what moved)`` from the progress probe
    (None: not known, the culprit rule's old limits apply)."""
    groups, last = {}, 0.0
    for s in page.slots:
        waiting = now - s.t_pending if s.pending and s.t_pending > 0 else 0.0
        groups[s.group] = [s.generation, s.entered, s.done, round(waiting, 4), round(s.typical, 5), s.members]
        last = max(last, s.last_activity())
    last = max(last, page.saved_at)  # a checkpoint save that just ended was activity, not a stall
    record = {
        "rank": rank,
        "node": node,
        "frozen": frozen,
        "idle": round(now - last, 4) if last else 0.0,
        "step": step_time,
        "groups": groups,
        "saving": round(now - page.saving_since, 4) if page.saving_since > 0 else 0.0,
        "timeout": page.timeout,
        "where": page.where,
    }
    if progress is not None:
        record["progress"], record["still"], record["moved"] = progress[0], round(progress[1], 3), list(progress[2])
    return record


def rank_record(d: dict) -> RankRecord:
    """A record read back from a store (input from another process: raises ValueError/TypeError/KeyError when malformed)."""
    groups = {
        str(name): GroupRecord(
            int(g[0]), int(g[1]), int(g[2]), float(g[3]), float(g[4]), None if g[5] is None else tuple(int(r) for r in g[5])
        )
        for name, g in d["groups"].items()
    }
    saving = float(d.get("saving", 0.0))  # absent in a record of an agent from before checkpoint marks
    progress = str(d.get("progress", UNKNOWN))  # ... and before progress evidence
    if progress not in (BUSY, STUCK):
        progress = UNKNOWN
    return RankRecord(
        int(d["rank"]),
        str(d["node"]),
        bool(d["frozen"]),
        float(d["idle"]),
        float(d["step"]),
        groups,
        saving,
        progress,
        float(d.get("still", 0.0)),
        float(d.get("timeout", 0.0)),
        str(d.get("where", "")),
        tuple(str(x) for x in d.get("moved", ())),
    )


def limits_of(cfg) -> Limits:
    return Limits(
        cfg.collective_floor,
        cfg.collective_multiplier,
        cfg.collective_alive_floor,
        cfg.collective_alive_multiplier,
        cfg.hang_checkpoint_timeout,
        cfg.collective_still_floor,
    )


class CollectiveWatch:
    def __init__(self, cfg: AgentConfig, session: EtcdSession, supervisor: WorkerSupervisor, say: Callable[..., None]):
        self.cfg = cfg
        self.session = session
        self.supervisor = supervisor
        self.say = say
        self.enabled = cfg.health is not None and cfg.health.collective_watch and not cfg.no_live
        self.limits = limits_of(cfg.health) if self.enabled else Limits()
        self._clients: dict[tuple[str, int], object] = {}  # peer agents' stores, connected on the first decision
        self._poked_at = self._decided_at = self._published_at = 0.0
        self._acted: set = set()  # (generation, ranks or nodes) already acted on
        self._said: set = set()  # (generation, group, seq) whose undecided stall was said
        self._busy_said: dict[tuple[int, int], int] = {}  # (generation, rank) -> minutes of business said

    # -- the local part ----------------------------------------------------------------------
    def local_records(self, plan: Plan) -> list[dict]:
        sup, now, out = self.supervisor, time.monotonic(), []
        wall = time.time()
        pids = sup.workers.pids()
        for lr, status in sup.statuses().items():
            pid = pids.get(lr)
            if not status.state.watched or pid is None or status.rank is None or status.generation != plan.generation:
                continue
            page = collective_page.read(collective_page.page_path(sup.scratch, lr))
            if page is None or page.pid != pid:
                continue  # not written yet by this process
            record = record_from_page(page, self.cfg.node_id, status.rank, now, frozen_process(pid), status.step_time or 0.0)
            kind, still, progress = sup.progress.judge(pid, record["idle"])
            if kind != UNKNOWN:
                record["progress"], record["still"] = kind, round(still, 3)
                record["moved"] = list(progress.evidence) if progress is not None else []
            record["frozen"] = record["frozen"] or kind == FROZEN
            silence = self.cfg.health.collective_frozen_after
            if not record["frozen"] and kind != BUSY and record["idle"] > silence and sup.store.check([WorkerKeys(lr).beat]):
                # Only a rank outside any collective for that long: its heartbeat is read then, not every iteration.
                # A silent heartbeat with CPU time moving is a long call holding the interpreter: busy, not frozen.
                record["frozen"] = wall - float(sup.store.get(WorkerKeys(lr).beat)) > silence
            self._say_busy(plan, lr, record)
            out.append(record)
        return out

    def _say_busy(self, plan: Plan, local_rank: int, record: dict) -> None:
        """Every ``BUSY_EVERY`` seconds a rank stays busy outside its collectives, say so, where,
        and what moved (a ``busy`` event): the user sees why it was not replaced."""
        idle = record["idle"]
        key = (plan.generation, record["rank"])
        if record.get("progress") != BUSY or idle < BUSY_EVERY:
            if idle < BUSY_EVERY:
                self._busy_said.pop(key, None)
            return
        said = self._busy_said.get(key, 0)
        if idle < (said + 1) * BUSY_EVERY:
            return
        self._busy_said[key] = int(idle // BUSY_EVERY)
        at = f", in {record['where']}" if record.get("where") else ""
        self.say(
            f"generation {plan.generation}: rank {record['rank']} busy outside collectives for {_duration(idle)}{at} "
            f"({', '.join(record.get('moved', [])) or 'moving'}); waiting for it as torch would"
            + (f" (until its collective timeout, {record['timeout']:.0f}s)" if record.get("timeout") else ""),
            kind="busy",
            generation=plan.generation,
            rank=record["rank"],
            local_rank=local_rank,
            verdict=BUSY,
            evidence={k: record.get(k) for k in ("idle", "still", "where", "moved", "timeout", "saving")},
        )

    def _suspected(self, records: list[dict]) -> bool:
        for r in records:
            for g in r["groups"].values():
                if g[1] > g[2] and g[3] > self.limits.stuck_after(g[4]):
                    return True
        return False

    def check(self, plan: Plan | None, view: View) -> None:
        live = view.live or self.supervisor.live_seen
        if not self.enabled or plan is None or plan.finished or not live or self.cfg.node_id not in plan.nodes:
            return
        self._take_kill_request(plan)
        if not self.supervisor.workers:
            return
        records = self.local_records(plan)
        now = time.monotonic()
        store = self.supervisor.store
        if now - self._published_at >= 0.05:
            self._published_at = now
            store.set(RECORDS, json.dumps({"generation": plan.generation, "ranks": records}))
        suspected = self._suspected(records)
        deciders = list(plan.nodes[:DECIDERS])
        me = self.cfg.node_id
        if me not in deciders:
            if suspected and now - self._poked_at >= POKE_EVERY:
                self._poked_at = now
                for node in deciders:
                    self._set(view, node, SUSPECT, me)
            return
        poked = store.check([SUSPECT])
        if poked:
            store.delete_key(SUSPECT)
        if (suspected or poked) and now - self._decided_at >= DECIDE_EVERY:
            self._decided_at = now
            self._decide(plan, view, records)

    # -- the decision ------------------------------------------------------------------------
    def _decide(self, plan: Plan, view: View, mine: list[dict]) -> None:
        me = self.cfg.node_id
        raw: list[dict] = list(mine)
        unreachable: set[str] = set()
        for node in plan.nodes:
            if node == me:
                continue
            got = self._get(view, node, RECORDS)
            if got is None:
                unreachable.add(node)
                continue
            try:
                d = json.loads(got)
                if d.get("generation") == plan.generation:
                    raw.extend(d["ranks"])
            except (ValueError, TypeError, KeyError, AttributeError):
                continue
        records = {}
        for d in raw:
            try:
                r = rank_record(d)
            except (ValueError, TypeError, KeyError, IndexError):
                continue
            records[r.rank] = r
        node_of = {r: n for n in plan.nodes for r in plan.ranks(n)}
        verdict = judge(records, range(plan.world_size), node_of, unreachable, self.limits, self._silent(unreachable))
        if verdict.action == NONE:
            return
        self._act(plan, view, verdict)

    def _silent(self, unreachable: set[str]) -> set[str]:
        """The unreachable nodes whose progress records in etcd (written every second by their
        agents) stopped too: they reach neither their peers nor etcd. Read only when some node
        is unreachable (one request). Etcd away from here: every one counts as silent, and the
        report that would follow cannot be written either."""
        if not unreachable:
            return set()
        try:
            progress = self.session.members.operator_log.progress_of(sorted(unreachable))
        except KVError:
            return set(unreachable)
        now, silent = time.time(), set()
        for node in unreachable:
            when = (progress.get(node) or {}).get("time")
            if not isinstance(when, (int, float)) or now - when > SILENT_AFTER:
                silent.add(node)
        return silent

    def _act(self, plan: Plan, view: View, verdict) -> None:
        g = plan.generation
        stall = f"collective {verdict.group}#{verdict.seq} stuck"
        fields = dict(
            generation=g, group=verdict.group, seq=verdict.seq, evidence=verdict.evidence, verdict=verdict.action, why=verdict.why
        )
        if verdict.action == KILL:
            key = (g, verdict.ranks)
            if key in self._acted:
                return
            self._acted.add(key)
            self.say(
                f"generation {g}: {stall}: rank(s) {list(verdict.ranks)} on {', '.join(verdict.nodes)} to blame "
                f"({verdict.why}: {'; '.join(verdict.evidence.get('culprits', {}).values())}); killing its worker",
                kind="culprit",
                ranks=list(verdict.ranks),
                nodes=list(verdict.nodes),
                **fields,
            )
            request = json.dumps({"generation": g, "ranks": list(verdict.ranks), "why": f"{stall}: {verdict.why}"})
            for node in verdict.nodes:
                if node == self.cfg.node_id:
                    self._kill_local(plan, verdict.ranks, f"{stall}: {verdict.why}")
                elif not self._set(view, node, KILL_KEY, request):
                    self.session.report_failure(g, node, f"{stall}: culprit, its agent unreachable", kind="lost")
        elif verdict.action == CUT:
            key = (g, verdict.nodes)
            if key in self._acted:
                return
            self._acted.add(key)
            self.say(
                f"generation {g}: {stall}: {', '.join(verdict.nodes)} unreachable while its peers wait: reporting it lost",
                kind="culprit",
                nodes=list(verdict.nodes),
                **fields,
            )
            for node in verdict.nodes:
                self.session.report_failure(g, node, f"{stall}: cut off from its peers (collective telemetry)", kind="lost")
        else:
            key = (g, verdict.group, verdict.seq)
            if key in self._said:
                return
            self._said.add(key)
            self.say(f"generation {g}: {stall}; no culprit yet ({verdict.why}): looking again", kind="collective_stuck", **fields)

    def _take_kill_request(self, plan: Plan) -> None:
        """A decider named a local worker the culprit: kill it (once) like a hung one."""
        store = self.supervisor.store
        if not store.check([KILL_KEY]):
            return
        raw = store.get(KILL_KEY)
        store.delete_key(KILL_KEY)
        try:
            request = json.loads(raw)
            generation, ranks, why = int(request["generation"]), tuple(int(r) for r in request["ranks"]), str(request["why"])
        except (ValueError, TypeError, KeyError):
            return
        if generation == plan.generation:
            self._kill_local(plan, ranks, why)

    def _kill_local(self, plan: Plan, ranks, why: str) -> None:
        sup = self.supervisor
        for lr, status in sup.statuses().items():
            worker = sup.workers.workers.get(lr)
            if status.rank not in ranks or worker is None or worker.poll() is not None or worker.killed:
                continue
            self.say(
                f"generation {plan.generation}: worker {lr} (pid {worker.pid}, rank {status.rank}) is the culprit of a stuck collective "
                f"({why}): killing it",
                kind="culprit_killed",
                generation=plan.generation,
                local_rank=lr,
                rank=status.rank,
            )
            sup.workers.kill(lr)

    # -- peer agents' stores -----------------------------------------------------------------
    def _address(self, view: View, node: str) -> tuple[str, int] | None:
        info = view.alive.get(node)
        if info is None:
            try:
                info = self.session.members.node_record(node)  # a follower's view holds few records
            except Exception:  # noqa: BLE001 -- etcd away: the node is judged unreachable
                info = None
        return None if info is None else (info.addr, info.store_port)

    def _client(self, view: View, node: str):
        addr = self._address(view, node)
        if addr is None:
            return None
        client = self._clients.get(addr)
        if client is not None:
            return client
        try:  # a cut-off peer neither accepts nor refuses: find out in CONNECT_TIMEOUT, not the store's
            socket.create_connection(addr, timeout=CONNECT_TIMEOUT).close()
            import torch.distributed as dist

            client = dist.TCPStore(addr[0], addr[1], None, False, timeout=datetime.timedelta(seconds=1), wait_for_workers=False)
        except (OSError, RuntimeError):
            return None
        self._clients[addr] = client
        return client

    def _get(self, view: View, node: str, key: str) -> bytes | None:
        client = self._client(view, node)
        if client is None:
            return None
        try:
            return client.get(key) if client.check([key]) else b"{}"
        except (RuntimeError, OSError):
            self._drop(view, node)
            return None

    def _set(self, view: View, node: str, key: str, value: str) -> bool:
        client = self._client(view, node)
        if client is None:
            return False
        try:
            client.set(key, value)
            return True
        except (RuntimeError, OSError):
            self._drop(view, node)
            return False

    def _drop(self, view: View, node: str) -> None:
        addr = self._address(view, node)
        if addr is not None:
            self._clients.pop(addr, None)

    def close(self) -> None:
        self._clients.clear()
