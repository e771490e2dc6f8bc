#!/usr/bin/env python3
"""Rendezvous at scale, by simulation: N stand-in nodes against one real etcd, and torch's c10d
dynamic rendezvous at the same N.

    .venv/bin/python bench/rendezvous_scale.py --nodes 64,256 --c10d-max-nodes 64   # ~2 min on 2 cores
    .venv/bin/python bench/rendezvous_scale.py --nodes 1024 --procs 2 --skip-c10d --timeout 600  # ~5 min
    .venv/bin/python bench/rendezvous_scale.py --nodes 8 --skip-c10d                 # a few seconds

A stand-in is the real agent (``tm_launch.launcher.agent.Agent``) minus workers and health: it registers
with a lease (``Membership.register``), and runs the agent's own loop (``Agent._loop`` /
``_tick``): the read of the job's state (``Membership.refresh``: everything for the planners,
group rank 0 and joiners, the plan feed for the others, each from the copy its watch stream
keeps when that can be trusted), the pure planner, the CAS publish, the watch. Only following a plan (start or stop workers, warm a spare up) is replaced by "note when
this generation was first seen", and the per-second progress record (operator telemetry, not
rendezvous) is left out. The job is a live one (``state/live`` is set before the start, as its
workers would): a loss is a spare taking the lost node's ranks. Stand-ins are threads spread over
a few processes (``--procs``; the machine has 2 cores), each with its own etcd v3 client wrapped
in a counter of operations by type; the first three, which join first and so plan, have a process
of their own (in a real job every agent has its own CPU; here a planner would otherwise wait for
the GIL behind every other stand-in). Leases are long (``--lease-ttl``) so that keepalives do not
disturb the per-event counts; their rate is reported separately, from the agent's schedule.

Events measured, per N:

    gen 0      from "go" (all stand-ins start registering) to generation 0 published, and seen by all
    loss       an active node freezes and its lease is revoked (a dead node's lease expiring):
               time to the replacement plan published (its compare-and-swap landed), and until
               every live stand-in has seen it
               (and holds exactly the plan in etcd: the digests are compared)
    ops        etcd operations each event caused (from the event until the counters are quiet),
               total, per node, and per *follower* (a stand-in that neither plans nor has another
               role, before and after the event: ``planner.follows_only``)
    bytes      what etcd sent each client (HTTP bodies, watch streams included), total and per
               follower: O(N) per node when every node reads the whole state, O(1) with deltas
    CPU        user + system seconds of etcd and of the stand-in processes themselves during the
               event: on 2 cores the stand-ins compete with etcd, and the times say so

torch's side: ``DynamicRendezvousHandler`` over ``C10dRendezvousBackend`` (a TCPStore) at the same
N (torchrun's elastic flow, ``--nnodes N-1:N``, no spares), counting the backend's ``get_state``
and ``set_state`` (CAS of the whole pickled state). Its "loss" is its best case: the leaving node
runs torch's own exit op at once (no 15 s heartbeat expiry), then the survivors call
``next_rendezvous()`` again, as torchrun's agents do after their workers fail; the round closes
``last_call`` (1 s here; torchrun's default is 30 s) after the minimum is reached.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
import types
import uuid
from collections import Counter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from rendezvous.kv import KV, EtcdOptions, Lease, connect  # noqa: E402
from rendezvous.membership import Membership, run_prefix  # noqa: E402
from rendezvous.plan import plan_digest  # noqa: E402
from rendezvous.planner import PLANNERS  # noqa: E402


def say(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ counting adapters

READS = ("get", "get_many", "get_prefix", "count", "current_revision")
WRITES = ("put", "create", "replace", "delete", "delete_prefix")


class _Frozen(BaseException):
    """Never raised: a frozen (dead) node's calls block forever instead."""


class CountingLease(Lease):
    def __init__(self, inner: Lease, owner: CountingKV):
        self.inner, self.owner, self.ttl = inner, owner, inner.ttl

    def refresh(self) -> bool:
        self.owner._count("keepalive")
        return self.inner.refresh()

    def revoke(self) -> None:
        self.owner._count("revoke")
        self.inner.revoke()


class CountingKV(KV):
    """A KV that counts every etcd operation by type (and the bytes range reads return).

    ``freeze()`` turns the node into a dead one: every later call blocks forever."""

    def __init__(self, inner: KV):
        self.inner = inner
        self.transactions = inner.transactions
        self.counts: Counter = Counter()
        self.frozen = threading.Event()
        self.plan_landed_at = 0.0  # when this client's last compare-and-swap of the plan succeeded

    def _count(self, op: str, nbytes: int = 0) -> None:
        if self.frozen.is_set():
            threading.Event().wait()  # a dead node does nothing, ever
        self.counts[op] += 1
        if nbytes:
            self.counts["bytes_read"] += nbytes

    def freeze(self) -> None:
        self.frozen.set()

    @staticmethod
    def _unwrap(lease):
        return lease.inner if isinstance(lease, CountingLease) else lease

    def get(self, key):
        self._count("get")
        e = self.inner.get(key)
        if e is not None:
            self.counts["bytes_read"] += len(e.key) + len(e.value)
        return e

    def get_prefix(self, prefix):
        self._count("get_prefix")
        out = self.inner.get_prefix(prefix)
        self.counts["bytes_read"] += sum(len(e.key) + len(e.value) for e in out)
        return out

    def get_many(self, keys):
        self._count("get_many")
        out = self.inner.get_many(keys)
        self.counts["bytes_read"] += sum(len(e.key) + len(e.value) for e in out.values())
        return out

    def count(self, prefix):
        self._count("count")
        return self.inner.count(prefix)

    def put(self, key, value, lease=None):
        self._count("put")
        return self.inner.put(key, value, self._unwrap(lease))

    def create(self, key, value, lease=None, also=None):
        self._count("create")
        return self._landed(key, self.inner.create(key, value, self._unwrap(lease), also))

    def replace(self, key, value, revision, also=None):
        self._count("replace")
        return self._landed(key, self.inner.replace(key, value, revision, also))

    def _landed(self, key: str, ok: bool) -> bool:
        if ok and key == "state/plan":
            self.plan_landed_at = time.time()
        return ok

    def delete(self, key):
        self._count("delete")
        self.inner.delete(key)

    def delete_prefix(self, prefix):
        self._count("delete_prefix")
        self.inner.delete_prefix(prefix)

    def grant(self, ttl):
        self._count("grant")
        return CountingLease(self.inner.grant(ttl), self)

    def wait(self, prefix, after_revision, timeout):
        self._count("wait")
        return self.inner.wait(prefix, after_revision, timeout)

    def watch_stream(self, prefix, idle_timeout=300.0):
        """Opening a stream is one operation (counted with the waits); what it then delivers
        costs no request, only the bytes the v3 client counts."""
        self._count("wait")
        yield from self.inner.watch_stream(prefix, idle_timeout)

    def current_revision(self):
        self._count("current_revision")
        return self.inner.current_revision()

    def close(self):
        self.inner.close()


def summarize(counts: Counter) -> dict:
    """Reads / writes / watches / lease operations from per-op counts."""
    return {
        "reads": sum(counts.get(k, 0) for k in READS),
        "writes": sum(counts.get(k, 0) for k in WRITES),
        "watches": counts.get("wait", 0),
        "lease": counts.get("grant", 0) + counts.get("keepalive", 0) + counts.get("revoke", 0),
        "ops": sum(v for k, v in counts.items() if k != "bytes_read"),
        "bytes_read": counts.get("bytes_read", 0),
        "by_op": {k: v for k, v in sorted(counts.items()) if k != "bytes_read"},
    }


# ------------------------------------------------------------------ tm-launch stand-ins (child side)


def _standin_class():
    """Defined lazily: importing the agent imports torch (seconds), only in the child processes."""
    import tm_launch.launcher.agent as agent_mod
    import tm_launch.launcher.plan_executor as executor_mod
    import tm_launch.launcher.supervisor as supervisor_mod
    from rendezvous.planner import follows_only

    class _NoStore:
        """A stand-in runs no workers, so its agent store is never read; no TCPStore per thread.
        Its port only has to pass the node record's range check (nobody connects to it)."""

        port = 1

        def check(self, keys):
            return False

    supervisor_mod.dist = types.SimpleNamespace(TCPStore=lambda *a, **k: _NoStore())

    class RendezvousOnlyExecutor(executor_mod.PlanExecutor):
        """The rendezvous part of following a plan: note it; leave when removed or finished."""

        def __init__(self, *parts):
            super().__init__(*parts)
            self.seen: dict[int, float] = {}

        def follow(self, plan, view):
            self.seen.setdefault(plan.generation, time.time())
            self.plan = plan
            if plan.finished:
                return 0
            if self.cfg.node_id in plan.removed:
                return 1
            return None

        def be_spare(self, plan, view):
            pass  # a stand-in has no workers to warm up

    class NoProgress:
        """Operator telemetry (1 put/s per node), not rendezvous: reported separately."""

        def publish(self, plan):
            pass

    class StandIn(agent_mod.Agent):
        def __init__(self, cfg, kv: CountingKV):
            super().__init__(cfg, kv)
            self.executor = RendezvousOnlyExecutor(cfg, self.session, self.supervisor, self.failures, self.metrics, self.say)
            self.progress = NoProgress()
            self.published: dict[int, float] = {}
            self.exit_code = None
            self.follows = False  # the last read of the job's state found this node only following plans
            self.reads, self.whole_reads, self.last_snap = 0, 0, None  # reads of the job's state; of all of it

        def _tick(self, snap):
            if snap is not self.last_snap:  # a new read (the loop goes round without one too)
                self.reads += 1
                self.whole_reads += not snap.partial
                self.follows = follows_only(snap.view, self.cfg.node_id, self.cfg.node_id in snap.planners)
            self.last_snap = snap
            return super()._tick(snap)  # it ends waiting for the next change

        def _announce(self, plan):
            # When the plan's CAS landed: the history write after it is the operators' record,
            # and in one process it waits for the GIL behind every follower the plan woke.
            self.published[plan.generation] = self.kv.plan_landed_at
            super()._announce(plan)

    return StandIn


def tm_child(conn, endpoint: str, run_id: str, ids: list[str], limits: dict, opts: dict) -> None:
    sys.stderr = open(opts["log"], "a", buffering=1)
    from rendezvous.planner import Limits
    from tm_launch.launcher.agent import AgentConfig
    from tm_launch.launcher.peer_link import ETCD_CONTACT

    StandIn = _standin_class()
    lim = Limits(**limits)
    standins = {}
    for node in ids:
        kv = CountingKV(connect("v3", EtcdOptions(endpoints=(endpoint,), prefix=f"/tm-launch/{run_id}", timeout=60.0)))
        cfg = AgentConfig(
            node_id=node,
            addr="127.0.0.1",
            nproc=lim.nproc,
            limits=lim,
            cmd=["true"],
            run_id=run_id,
            lease_ttl=opts["lease_ttl"],
            monitor_interval=opts["monitor_interval"],
            join_timeout=3600,
            last_call=1.0,
        )
        standins[node] = StandIn(cfg, kv)
    conn.send("ready")

    def run(s):
        try:
            s.exit_code = s.run()
        except BaseException as e:  # noqa: BLE001 - reported to the controller
            s.exit_code = f"{type(e).__name__}: {e}"

    while True:
        cmd, arg = conn.recv()
        if cmd == "go":
            for s in standins.values():
                threading.Thread(target=run, args=(s,), daemon=True).start()
            conn.send(time.time())
        elif cmd == "status":
            # The plans' digests only when asked (arg): hashing N plans of N nodes is O(N^2), and
            # the controller polls while the stand-ins work.
            conn.send(
                {
                    n: {
                        "seen": dict(s.executor.seen),
                        "published": dict(s.published),
                        "counts": dict(s.kv.counts),
                        "received": s.kv.inner.received,
                        "follows": s.follows,
                        "reads": s.reads,
                        "whole_reads": s.whole_reads,
                        "joined": s.session.lease is not None,
                        "plan": plan_digest(s.executor.plan) if arg and s.executor.plan else None,
                        "frozen": s.kv.frozen.is_set(),
                        "exit": s.exit_code,
                    }
                    for n, s in standins.items()
                }
            )
        elif cmd == "kill":
            s = standins[arg]
            s.kv.freeze()
            # A dead node's agent store answers no one; a stand-in's lives on in this process, so
            # it forgets when etcd last answered it (else planners take it for a node whose
            # renewal is only late: fencing.lapsed_but_alive).
            s.supervisor.store.delete_key(ETCD_CONTACT)
            t0 = time.time()
            s.session.lease.inner.revoke()  # the lease expiring, without the TTL's wait
            conn.send(t0)
        elif cmd == "stop":
            for s in standins.values():
                shutil.rmtree(s.supervisor.scratch, ignore_errors=True)
            conn.send("bye")
            os._exit(0)


# ------------------------------------------------------------------ torch c10d stand-ins (child side)


def c10d_child(conn, host: str, port: int, run_id: str, n: int, limits: dict, opts: dict) -> None:
    sys.stderr = open(opts["log"], "a", buffering=1)
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    class Counting(dr.RendezvousBackend):
        def __init__(self, inner):
            self.inner, self.counts = inner, Counter()

        @property
        def name(self):
            return self.inner.name

        def get_state(self):
            self.counts["get_state"] += 1
            out = self.inner.get_state()
            if out:
                self.counts["bytes_read"] += len(out[0])
            return out

        def set_state(self, state, token=None):
            self.counts["set_state"] += 1
            out = self.inner.set_state(state, token)
            if out:
                self.counts["bytes_read"] += len(out[0])
                self.counts["set_state_ok" if out[2] else "set_state_failed"] += 1
            return out

    handlers, backends, rounds, errors = [], [], [], {}
    for _ in range(n):
        store = dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=600))
        backend = Counting(C10dRendezvousBackend(store, run_id))
        h = dr.DynamicRendezvousHandler.from_backend(
            run_id,
            store,
            backend,
            limits["min_nodes"],
            limits["max_nodes"],
            "127.0.0.1",
            dr.RendezvousTimeout(join=timedelta(seconds=3600), last_call=timedelta(seconds=1)),
        )
        handlers.append(h)
        backends.append(backend)
        rounds.append({})
    conn.send("ready")

    def join(i):
        try:
            h = handlers[i]
            h.next_rendezvous()
            rounds[i][h._state_holder.state.round] = time.time()
        except BaseException as e:  # noqa: BLE001
            errors[i] = f"{type(e).__name__}: {e}"

    while True:
        cmd, arg = conn.recv()
        if cmd == "go":
            for i in range(n):
                threading.Thread(target=join, args=(i,), daemon=True).start()
            conn.send(time.time())
        elif cmd == "status":
            st = handlers[0]._state_holder.state
            conn.send(
                {
                    "rounds": rounds,
                    "counts": [dict(b.counts) for b in backends],
                    "errors": dict(errors),
                    "state": (st.round, st.complete, len(st.participants), len(st.wait_list), len(st.redundancy_list)),
                }
            )
        elif cmd == "leave":
            h = handlers[arg]
            h._stop_heartbeats()
            t0 = time.time()
            h._op_executor.run(dr._RendezvousExitOp(), time.monotonic() + 600)
            conn.send(t0)
        elif cmd == "rejoin":
            # The survivors' workers failed: each agent calls next_rendezvous() again (torchrun).
            t0 = time.time()
            for i in arg:
                threading.Thread(target=join, args=(i,), daemon=True).start()
            conn.send(t0)
        elif cmd == "stop":
            conn.send("bye")
            os._exit(0)


# ------------------------------------------------------------------ controller


class Children:
    def __init__(self, target, per_child_args: list[tuple]):
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for args in per_child_args:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=target, args=(child, *args), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        for c in self.conns:
            if c.recv() != "ready":
                raise RuntimeError("a stand-in process failed to start")

    def ask(self, i: int, cmd: str, arg=None):
        self.conns[i].send((cmd, arg))
        return self._answer(i)

    def all(self, cmd: str, arg=None) -> list:
        for c in self.conns:
            c.send((cmd, arg))
        return [self._answer(i) for i in range(len(self.conns))]

    def _answer(self, i: int):
        try:
            return self.conns[i].recv()
        except EOFError:
            self.procs[i].join(5)
            raise RuntimeError(f"stand-in process {i} ended (exit code {self.procs[i].exitcode})") from None

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(("stop", None))
                c.recv()
            except (OSError, EOFError):
                pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()


def _split(items: list, k: int) -> list[list]:
    return [items[i::k] for i in range(k)]


def _settle(read_total, quiet: float = 1.0, cap: float = 20.0) -> None:
    """Wait until the operation counters stop moving for ``quiet`` seconds (at most ``cap``)."""
    last, since, end = read_total(), time.time(), time.time() + cap
    while time.time() < end:
        time.sleep(0.25)
        now = read_total()
        if now != last:
            last, since = now, time.time()
        elif time.time() - since >= quiet:
            return


def _cpu(pids) -> float:
    """User + system CPU seconds of these processes so far (0 for any that is gone)."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
    return total


def _delta(after: Counter, before: Counter) -> Counter:
    return Counter({k: after.get(k, 0) - before.get(k, 0) for k in after})


def run_tm(endpoint: str, n: int, procs: int, spares: int, opts: dict, timeout: float, etcd_pid: int | None = None) -> dict:
    run_id = f"scale-{n}-{uuid.uuid4().hex[:6]}"
    ids = [f"n{i:04d}" for i in range(n)]
    limits = {"min_nodes": n - spares, "max_nodes": n - spares, "nproc": 1, "max_restarts": 100}
    # The first stand-ins, started first, join first: they are the planners (and group rank 0).
    # They get a process of their own, as each agent has its own CPU in a real job: otherwise
    # their planning waits for the GIL behind a thousand other stand-ins.
    groups = [ids[:PLANNERS], *_split(ids[PLANNERS:], procs)]
    owner = {node: i for i, g in enumerate(groups) for node in g}
    with _job_kv(endpoint, run_id) as kv:
        Membership(kv).set_live()  # what the job's workers would do: losses are live substitutions
    kids = Children(tm_child, [(endpoint, run_id, g, limits, opts) for g in groups])
    result = {"system": "tm-launch", "nodes": n, "spares": spares, "procs": procs, "events": []}
    try:

        def poll(digests: bool = False) -> dict:
            status = {}
            for part in kids.all("status", digests):
                status.update(part)
            bad = {k: v["exit"] for k, v in status.items() if isinstance(v["exit"], str)}
            if bad:
                raise RuntimeError(f"stand-in crashed: {next(iter(bad.items()))}")
            return status

        def totals() -> Counter:
            c = Counter()
            for v in poll().values():
                c.update(v["counts"])
                c["received"] += v["received"]
            return c

        def wait_seen(gen: int, t0: float) -> tuple[float, float, str]:
            end = time.time() + timeout
            while time.time() < end:
                st = poll()
                live = [v for v in st.values() if not v["frozen"]]
                pubs = [v["published"][gen] for v in st.values() if gen in v["published"]]
                if pubs and all(gen in v["seen"] for v in live):
                    publisher = next(k for k, v in st.items() if gen in v["published"])
                    return min(pubs) - t0, max(v["seen"][gen] for v in live) - t0, publisher
                time.sleep(0.2)
            seen = sum(gen in v["seen"] for v in live)
            raise TimeoutError(
                f"generation {gen} {'published' if pubs else 'not published'} and seen by {seen} of the "
                f"{len(live)} live stand-ins within {timeout:.0f}s"
            )

        def cpu() -> tuple[float, float]:
            return _cpu([etcd_pid] if etcd_pid else []), _cpu([p.pid for p in kids.procs])

        def event(name: str, gen: int, t0: float, before: dict, cpu0: tuple) -> dict:
            publish, all_seen, publisher = wait_seen(gen, t0)
            _settle(totals)
            cpu1 = cpu()
            after = poll(digests=True)
            ev = {
                "event": name,
                "generation": gen,
                "publish_s": round(publish, 3),
                "all_seen_s": round(all_seen, 3),
                "publisher": publisher,
                **per_event(before, after, _plan_digest(endpoint, run_id)),
                "etcd_cpu_s": round(cpu1[0] - cpu0[0], 2),
                "standins_cpu_s": round(cpu1[1] - cpu0[1], 2),
                "load_avg": os.getloadavg()[0],
            }
            f = ev["followers"]
            say(
                f"tm-launch N={n} {name}: plan published {publish:.3f}s, all saw it {all_seen:.3f}s, "
                f"CPU: etcd {ev['etcd_cpu_s']}s, stand-ins {ev['standins_cpu_s']}s, load {ev['load_avg']:.1f}; "
                f"{ev['ops']} ops ({ev['ops_per_node']}/node, max {ev['max_ops_one_node']} on one node), "
                f"{ev['received'] / 1e6:.2f} MB from etcd; {f['count']} followers: {f['ops_mean']} ops, "
                f"{f['bytes_mean']:.0f} B each (max {f['ops_max']} ops, {f['bytes_max']} B), {f['reads']} reads, {f['whole_reads']} whole; "
                f"{ev['agree']}/{ev['live']} hold etcd's plan; {ev['by_op']}"
            )
            if ev["agree"] != ev["live"]:
                raise RuntimeError(f"{name}: only {ev['agree']} of {ev['live']} stand-ins hold the plan in etcd")
            return ev

        before, cpu0 = poll(), cpu()
        t0 = kids.ask(0, "go")
        while not all(poll()[node]["joined"] for node in groups[0]):
            time.sleep(0.05)
        for i in range(1, len(groups)):
            kids.ask(i, "go")
        result["events"].append(event("gen 0", 0, t0, before, cpu0))
        for gen, pick in ((1, "middle active node"), (2, "first active node")):
            plan_nodes = _current_plan_nodes(endpoint, run_id)
            victim = plan_nodes[len(plan_nodes) // 2] if pick.startswith("middle") else plan_nodes[0]
            before, cpu0 = poll(), cpu()
            t0 = kids.ask(owner[victim], "kill", victim)
            ev = event(f"loss of {pick}", gen, t0, before, cpu0)
            ev["victim"] = victim
            result["events"].append(ev)
        result["history_generations"] = _history(endpoint, run_id)
    finally:
        kids.close()
    return result


def per_event(before: dict, after: dict, digest: str) -> dict:
    """What one event cost, from the stand-ins' counters before and after it: operations by
    type, bytes from etcd, and the same per follower (a stand-in that only followed plans both
    before and after, or, for generation 0, after: the planners, group rank 0, joiners and the
    dead node are the others).
    ``agree``: the live stand-ins holding exactly etcd's plan."""

    def ops(node: str, status: dict) -> int:
        return sum(x for k, x in status[node]["counts"].items() if k != "bytes_read")

    cost = {node: (ops(node, after) - ops(node, before), after[node]["received"] - before[node]["received"]) for node in after}
    total = Counter()
    for node in after:
        total.update(_delta(Counter(after[node]["counts"]), Counter(before[node]["counts"])))
    d = summarize(total)
    followers = [
        node
        for node in after
        if (before[node]["follows"] or not before[node]["reads"]) and after[node]["follows"] and not after[node]["frozen"]
    ]
    live = [v for v in after.values() if not v["frozen"]]
    n = len(after)
    return {
        **d,
        "ops_per_node": round(d["ops"] / n, 2),
        "max_ops_one_node": max(c[0] for c in cost.values()),
        "received": sum(c[1] for c in cost.values()),
        "followers": {
            "count": len(followers),
            "ops_mean": round(sum(cost[f][0] for f in followers) / max(len(followers), 1), 2),
            "ops_max": max((cost[f][0] for f in followers), default=0),
            "bytes_mean": round(sum(cost[f][1] for f in followers) / max(len(followers), 1)),
            "bytes_max": max((cost[f][1] for f in followers), default=0),
            "reads": sum(after[f]["reads"] - before[f]["reads"] for f in followers),
            "whole_reads": sum(after[f]["whole_reads"] - before[f]["whole_reads"] for f in followers),
        },
        "others_bytes": sum(c[1] for node, c in cost.items() if node not in followers),
        "live": len(live),
        "agree": sum(v["plan"] == digest for v in live),
    }


def _job_kv(endpoint: str, run_id: str) -> KV:
    return connect("v3", EtcdOptions(endpoints=(endpoint,), prefix=run_prefix(run_id)))


def _plan_digest(endpoint: str, run_id: str) -> str:
    with _job_kv(endpoint, run_id) as kv:
        return plan_digest(Membership(kv).plan())


def _current_plan_nodes(endpoint: str, run_id: str) -> list[str]:
    with _job_kv(endpoint, run_id) as kv:
        return list(Membership(kv).plan().nodes)


def _history(endpoint: str, run_id: str) -> list[int]:
    with _job_kv(endpoint, run_id) as kv:
        return [p.generation for p in Membership(kv).operator_log.history()]


def run_c10d(n: int, procs: int, opts: dict, timeout: float) -> dict:
    """torch's elastic flow without spares (its redundancy list did not hand a waiting node into
    the next round reliably here): all N form round 0 (min N-1, max N), one node leaves, the
    N-1 survivors re-rendezvous (min reached: the round closes after last_call, 1 s here)."""
    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    run_id = f"c10d-{n}-{uuid.uuid4().hex[:6]}"
    limits = {"min_nodes": n - 1, "max_nodes": n}
    sizes = [len(g) for g in _split(list(range(n)), procs)]
    kids = Children(c10d_child, [("127.0.0.1", master.port, run_id, k, limits, opts) for k in sizes])
    result = {"system": "torch c10d", "nodes": n, "events": []}
    try:

        def poll():
            parts = kids.all("status")
            errs = [e for p in parts for e in p["errors"].values()]
            if errs:
                raise RuntimeError(f"c10d handler failed: {errs[0]}")
            return parts

        def totals(parts=None) -> Counter:
            c = Counter()
            for p in parts or poll():
                for x in p["counts"]:
                    c.update(x)
            return c

        def wait_round(rnd: int, t0: float, want: int) -> float:
            end = time.time() + timeout
            while time.time() < end:
                parts = poll()
                done = [t for p in parts for r in p["rounds"] if rnd in r for t in [r[rnd]]]
                if len(done) >= want:
                    return max(done) - t0
                time.sleep(0.25)
            say(
                f"c10d state seen by each process' first handler (round, complete, participants, wait, redundancy): {[p['state'] for p in parts]}; joined: {[r for p in parts for r in p['rounds']]}"
            )
            raise TimeoutError(f"c10d round {rnd}: fewer than {want} of {n} nodes joined within {timeout:.0f}s")

        def event(name, rnd, t0, before, want):
            formed = wait_round(rnd, t0, want)
            after = totals()
            d = _delta(after, before)
            ops = d.get("get_state", 0) + d.get("set_state", 0)
            ev = {
                "event": name,
                "round": rnd,
                "all_seen_s": round(formed, 3),
                "ops": ops,
                "ops_per_node": round(ops / n, 2),
                "get_state": d.get("get_state", 0),
                "set_state": d.get("set_state", 0),
                "set_state_failed": d.get("set_state_failed", 0),
                "bytes_read": d.get("bytes_read", 0),
            }
            say(
                f"c10d N={n} {name}: all {want} joined {formed:.3f}s, {ops} backend ops ({ev['ops_per_node']}/node: "
                f"{ev['get_state']} get_state, {ev['set_state']} set_state of which {ev['set_state_failed']} failed CAS), "
                f"{ev['bytes_read'] / 1e6:.1f} MB read"
            )
            return ev

        t0 = min(kids.all("go"))
        result["events"].append(event("round 0", 0, t0, Counter(), n))
        # Steady state: heartbeats (a CAS of the whole state every 5 s per node) and the spare's polling.
        before, t_a = totals(), time.time()
        time.sleep(opts["c10d_idle"])
        idle = _delta(totals(), before)
        rate = (idle.get("get_state", 0) + idle.get("set_state", 0)) / (time.time() - t_a)
        result["idle_ops_per_s"] = round(rate, 1)
        say(f"c10d N={n} idle: {rate:.1f} backend ops/s (heartbeats and waiting nodes' polls)")
        # A node leaves at once (its best case: no heartbeat expiry); the survivors rejoin.
        parts = poll()
        members = [(ci, i) for ci, p in enumerate(parts) for i, r in enumerate(p["rounds"]) if 0 in r]
        leaver = members[len(members) // 2]
        before = totals(parts)
        t0 = kids.ask(leaver[0], "leave", leaver[1])
        for ci, p in enumerate(parts):
            survivors = [i for i, r in enumerate(p["rounds"]) if 0 in r and (ci, i) != leaver]
            kids.ask(ci, "rejoin", survivors)
        result["events"].append(event("loss (re-rendezvous)", 1, t0, before, n - 1))
    finally:
        kids.close()
    return result


# ------------------------------------------------------------------ report


def table(results: list[dict]) -> str:
    """One row per event. A *follower* is a node that neither plans nor has another role (see
    ``per_event``); for torch's c10d every node does the same work, so its per-node mean is shown.
    KB are what etcd sent (tm-launch: HTTP bodies and watch streams; c10d: the pickled states read)."""
    lines = [
        "| N | system | event | plan published (s) | all saw it (s) | ops total | ops per follower (max) | "
        "KB per follower (max) | KB total | stand-ins CPU (s) | etcd CPU (s) |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        for ev in r["events"]:
            pub = f"{ev['publish_s']:.3f}" if "publish_s" in ev else "-"
            if "followers" in ev:
                f = ev["followers"]
                per = f"{f['ops_mean']} ({f['ops_max']})", f"{f['bytes_mean'] / 1e3:.1f} ({f['bytes_max'] / 1e3:.1f})"
                kb = ev["received"] / 1e3
            else:
                per = f"{ev['ops_per_node']} (every node)", f"{ev['bytes_read'] / r['nodes'] / 1e3:.1f} (every node)"
                kb = ev["bytes_read"] / 1e3
            lines.append(
                f"| {r['nodes']} | {r['system']} | {ev['event']} | {pub} | {ev['all_seen_s']:.3f} | {ev['ops']} | "
                f"{per[0]} | {per[1]} | {kb:.0f} | {ev.get('standins_cpu_s', '-')} | {ev.get('etcd_cpu_s', '-')} |"
            )
        if "error" in r:
            lines.append(f"| {r['nodes']} | {r['system']} | {r['error']} | | | | | | | | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="64,256,1024", help="comma-separated node counts (default: 64,256,1024)")
    p.add_argument(
        "--procs", type=int, default=1, help="processes the stand-in threads other than the planners' are spread over (default 1)"
    )
    p.add_argument("--spares", type=int, default=2, help="spare nodes among N (default 2: one per loss event)")
    p.add_argument("--lease-ttl", type=float, default=600.0, help="stand-ins' lease TTL (default 600 s: no keepalive during the events)")
    p.add_argument(
        "--monitor-interval",
        type=float,
        default=60.0,
        help="stand-ins' watch timeout (default 60 s: no workers to poll, so they wake only on changes)",
    )
    p.add_argument("--timeout", type=float, default=180.0, help="give up on one event after this long (default 180 s)")
    p.add_argument("--c10d-max-nodes", type=int, default=1024, help="skip torch's c10d rendezvous above this N")
    p.add_argument("--c10d-idle", type=float, default=6.0, help="seconds to sample c10d's idle heartbeat load")
    p.add_argument("--skip-c10d", action="store_true")
    p.add_argument("--skip-tm", action="store_true", help="only torch's c10d rendezvous")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    try:
        sizes = [int(x) for x in args.nodes.split(",") if x.strip()]
    except ValueError:
        p.error(f"--nodes must be comma-separated integers, got {args.nodes!r}")
    if not sizes or min(sizes) < args.spares + 2:
        p.error(f"--nodes: every N must be at least --spares + 2 = {args.spares + 2}")
    if args.spares < 2:
        p.error("--spares must be at least 2 (two loss events, each replaced by a spare)")

    from rendezvous.etcd_server import EtcdServer

    logdir = tempfile.mkdtemp(prefix="tm-scale-")
    say(f"stand-ins' own output goes to {logdir}/children.log")
    opts = {
        "lease_ttl": args.lease_ttl,
        "monitor_interval": args.monitor_interval,
        "c10d_idle": args.c10d_idle,
        "log": os.path.join(logdir, "children.log"),
    }
    results = []
    t_start = time.time()
    with EtcdServer() as etcd:
        for n in [] if args.skip_tm else sizes:
            procs = max(1, min(args.procs, n // 2))
            try:
                results.append(run_tm(etcd.endpoint, n, procs, args.spares, opts, args.timeout, etcd.pid))
            except (TimeoutError, RuntimeError) as e:
                say(f"tm-launch N={n}: {e}")
                results.append({"system": "tm-launch", "nodes": n, "events": [], "error": str(e)})
        if not args.skip_c10d:
            for n in sizes:
                if n > args.c10d_max_nodes:
                    continue
                procs = max(1, min(args.procs, n // 2))
                try:
                    results.append(run_c10d(n, procs, opts, args.timeout))
                except (TimeoutError, RuntimeError) as e:
                    say(f"c10d N={n}: {e}")
                    results.append({"system": "torch c10d", "nodes": n, "events": [], "error": str(e)})
                    break  # larger N only takes longer
    say(f"done in {time.time() - t_start:.0f}s")
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
