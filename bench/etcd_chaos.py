#!/usr/bin/env python3
"""Control-plane chaos soak: a live job on a 3-member etcd cluster, a seeded random schedule of
etcd faults, and the promise that none of them makes the job notice.

    .venv/bin/python bench/etcd_chaos.py --seed 1 --faults 12                  # DDP, etcd's v3 API
    .venv/bin/python bench/etcd_chaos.py --seed 1 --faults 12 --api v2 --layout fsdp
    .venv/bin/python bench/etcd_chaos.py --seed 1 --faults 8 --kinds slow,slow-member,kill-on-plan

One job (2 active nodes x 2 workers and 1 parked spare; ``tests/scripts/train.py`` under DDP, or
``tests/scripts/hybrid.py --layout fsdp``, where no live rank replicates a rank's state) trains
while the driver injects etcd faults one after another, each a real signal to real etcd members
(``rendezvous.etcd_server.EtcdCluster``):

  member-kill      a random member SIGKILLed, restarted on its data dir 1-5 s later
  leader-kill      the leader SIGKILLed (the others elect one), restarted 1-5 s later
  member-restart   a random member SIGKILLed and restarted at once, on its data dir
  member-stop      the member the agents use most SIGSTOPped for 3-10 s (a frozen VM): it takes
                   connections and answers nothing, so each request waits out the client's 5 s
                   timeout before it tries another member, longer than the 3 s leases
  all-stop         every member SIGSTOPped for 1-10 s (a frozen VM, a paused container), then SIGCONT
  all-kill         every member SIGKILLed for 1-10 s, then restarted on their data dirs
  worker-kill-in-outage
                   every member SIGKILLed, an active node's worker SIGKILLed 1 s later, etcd back
                   after 1-10 s: the job must recover live once etcd is back (the spare takes the
                   node's ranks); a fresh spare is then started and parked

The agents reach etcd through ``bench/etcd_proxy.py`` (a delaying TCP proxy per member, which
names the requests going by), and the members reach each other through a second set of them
(``EtcdCluster.advertise_peers_at``). These kinds use them:

  slow             every member slowed for 3-10 s: each byte 0.2-1.5 s late, each way
  slow-member      the member the agents use slowed for 3-10 s, 1-6 s each way (past the
                   5 s request timeout: the agents must fail over), its links to the other
                   members too
  slow-peers       the traffic between members slowed for 3-10 s, 0.2-2 s each way: commits
                   wait for raft's round trips, and past raft's 1 s election timeout the
                   members hold elections while it lasts
  drop-on-renewal  the connection carrying the next lease renewal reset, before the renewal
                   reaches etcd or just after (its answer is lost)
  stop-on-renewal  every member SIGSTOPped the instant a lease renewal passes (before it reaches
                   etcd, or just after), for 1-10 s
  kill-on-reregister
                   every member SIGSTOPped for 2 TTLs + 1 s (the leases lapse when etcd thaws),
                   then every member SIGKILLed the instant a node re-registers (v3: its lease
                   grant; v2: the create of its record), back 1-5 s later
  kill-on-plan     an active node's worker SIGKILLed, and every member SIGKILLed the instant the
                   plan replacing it is written (before it reaches etcd, or just after: the
                   planner cannot know whether it went in), back 1-5 s later; then a fresh spare
  drop-on-plan     an active node's worker SIGKILLed, and the connection carrying the plan that
                   replaces it reset, before the write reaches etcd or just after; then a fresh
                   spare

Faults come 2-4 s apart, so some land on lease renewals, on re-registrations after an expired
v2 lease, and on the recovery of the previous one. Reported: job failures (must be 0), worker
restarts of ranks no fault took (must be 0), fencings and why, the longest training stall (the
largest gap between two steps of rank 0, per fault and overall), and every rank's final state
bitwise against a fault-free run of the same steps (``bench/chaos.py``'s comparison). Results:
bench/results/etcd-chaos-<api>-<layout>-<seed>.{md,json} (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import uuid
from typing import NamedTuple

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, REPO)
sys.path.insert(0, BENCH)

from chaos import HYBRID, SoakError, bitwise_diff, in_generation, load_ranks, reference_params, reference_state  # noqa: E402
from etcd_proxy import EtcdProxies  # noqa: E402

from tm_launch.local.localjob import LocalJob  # noqa: E402

KINDS = (
    "member-kill",
    "leader-kill",
    "member-restart",
    "member-stop",
    "all-stop",
    "all-kill",
    "worker-kill-in-outage",
    "slow",
    "slow-member",
    "slow-peers",
    "stop-on-renewal",
    "drop-on-renewal",
    "kill-on-reregister",
    "kill-on-plan",
    "drop-on-plan",
)
WORKER_KILLS = ("worker-kill-in-outage", "kill-on-plan", "drop-on-plan")  # each uses up a spare: once per soak
SIDED = ("stop-on-renewal", "drop-on-renewal", "kill-on-plan", "drop-on-plan")  # before or after their request went on
LAYOUTS = ("ddp", "fsdp")
ACTIVE, NPROC = 2, 2
TTL = 3.0


class Fault(NamedTuple):
    kind: str
    down: float  # how long etcd, a member, or the slowness lasts (s)
    delay: float = 0.0  # slow kinds: each byte's delay, each way (s)
    after: bool = False  # triggered kinds: fire just after the request went on to etcd


def _fault(kind: str, rng: random.Random) -> Fault:
    if kind in ("all-stop", "all-kill", "worker-kill-in-outage", "stop-on-renewal"):
        return Fault(kind, round(rng.uniform(1.0, 10.0), 2), after=kind in SIDED and rng.random() < 0.5)
    if kind in ("member-restart", "drop-on-renewal", "drop-on-plan"):
        return Fault(kind, 0.0, after=kind in SIDED and rng.random() < 0.5)
    slow = {"slow": (0.2, 1.5), "slow-member": (1.0, 6.0), "slow-peers": (0.2, 2.0)}
    if kind == "member-stop":
        return Fault(kind, round(rng.uniform(3.0, 10.0), 2))
    if kind in slow:
        return Fault(kind, round(rng.uniform(3.0, 10.0), 2), round(rng.uniform(*slow[kind]), 2))
    return Fault(kind, round(rng.uniform(1.0, 5.0), 2), after=kind in SIDED and rng.random() < 0.5)


def schedule(seed: int, faults: int, kinds: tuple[str, ...] = KINDS) -> list[Fault]:
    """Every one of ``kinds`` once, the rest drawn at random, each a ``Fault`` (how long etcd, a
    member or the slowness lasts; a slow kind's delay; a triggered kind's side of the request),
    in a seeded random order (pure). A worker kill (``WORKER_KILLS``) comes once at most: each
    uses up a spare, which the driver replaces and waits to park."""
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise ValueError(f"unknown fault kinds {unknown} (known: {', '.join(KINDS)})")
    kinds = tuple(dict.fromkeys(kinds))
    if faults < len(kinds):
        raise ValueError(f"--faults must be at least {len(kinds)} (one of each kind), got {faults}")
    rng = random.Random(seed)
    calm = [k for k in kinds if k not in WORKER_KILLS]
    if faults > len(kinds) and not calm:
        raise ValueError(f"--faults must be {len(kinds)} for only worker kills ({', '.join(kinds)}): each uses up a spare")
    drawn = list(kinds) + [rng.choice(calm) for _ in range(faults - len(kinds))]
    rng.shuffle(drawn)
    return [_fault(kind, rng) for kind in drawn]


def budget(plan: list[Fault], step_sleep: float) -> int:
    """Steps enough for ``plan`` (pure): setup, each fault's outage and the gap after it, a
    worker kill's recovery and a fresh spare's warm-up, a lease left to lapse, at one step per
    ``step_sleep`` and a fifth more (a step takes longer than its sleep: 18 steps a second were
    measured at 0.03 s)."""
    extra = {"worker-kill-in-outage": 90.0, "kill-on-plan": 120.0, "drop-on-plan": 120.0, "kill-on-reregister": 2 * TTL + 20.0}
    extra["stop-on-renewal"] = extra["drop-on-renewal"] = 5.0
    seconds = 60.0 + sum(f.down + 6.0 + extra.get(f.kind, 0.0) for f in plan)
    return int(1.2 * seconds / max(step_sleep, 0.01))


def max_gap(times: list[float]) -> float | None:
    """The longest wait between two consecutive step times (pure)."""
    times = sorted(times)
    return max((b - a for a, b in zip(times, times[1:])), default=None)


def restarts(records, taken: set[int]) -> dict[int, int]:
    """Per rank, how many times another process took it over (pure): its distinct worker pids
    in the step log, minus one; ranks in ``taken`` (a fault replaced their node) are left out."""
    pids: dict[int, set[int]] = {}
    for _, rank, _, _, pid in records:
        pids.setdefault(rank, set()).add(pid)
    return {rank: len(p) - 1 for rank, p in sorted(pids.items()) if rank not in taken and len(p) > 1}


class EtcdChaos:
    def __init__(
        self, cluster, proxies, peers, workdir: str, seed: int, plan: list[Fault], api: str, layout: str, step_sleep: float, log=print
    ):
        self.peers = peers  # the proxies between the members
        self.cluster, self.proxies, self.workdir, self.seed, self.api, self.layout, self.log = (
            cluster,
            proxies,
            workdir,
            seed,
            api,
            layout,
            log,
        )
        self.rng = random.Random(seed * 104729 + 3)
        self.plan = plan
        self.chaos = os.path.join(workdir, "chaos")
        os.makedirs(self.chaos, exist_ok=True)
        self.job = LocalJob(
            endpoint=",".join(proxies.endpoints),  # the agents reach etcd through the proxies
            run_id=f"etcd-chaos-{seed}-{uuid.uuid4().hex[:8]}",
            workdir=workdir,
            nnodes=str(ACTIVE),
            nproc=NPROC,
            backend="etcd-v3" if api == "v3" else "etcd-v2",
            # Every replacement counts against --max-restarts, and a soak has three worker kills
            # (WORKER_KILLS): a bound of 3 would fail the job on any other replacement instead of
            # letting the report name it (a fencing of a node no fault took).
            launcher_args=["--lease-ttl", str(TTL), "--max-restarts", "10"],
        )
        # The script's step budget (``budget``); the driver ends the run 20 steps after the last
        # fault (``DIR/end``), where the script's loop ends (``job.end_loop()``).
        self.steps = budget(self.plan, step_sleep)
        common = ["--steps", str(self.steps), "--step-sleep", str(step_sleep), "--step-log", self.job.step_log, "--chaos-dir", self.chaos]
        if layout == "ddp":
            self.out = os.path.join(workdir, "params.pt")
            self.job.script_args = [*common, "--out", self.out]
        else:
            self.out = os.path.join(workdir, "out")
            self.job.script = HYBRID
            self.job.env = {"OMP_NUM_THREADS": "1"}
            self.job.script_args = ["--layout", layout, *common, "--out", self.out]
        self.results: list[dict] = []
        self.taken: set[int] = set()  # ranks a fault's recovery moved to another node
        self.spares = 0

    # -- reading the job -----------------------------------------------------------------------
    def _members(self):
        from rendezvous.kv import connect
        from rendezvous.membership import Membership
        from rendezvous.rdzv_conf import etcd_options

        # The driver reads etcd directly, never slowed down.
        return Membership(connect(self.api, etcd_options(",".join(self.cluster.endpoints), self.job.run_id, None)))

    def status(self) -> dict:
        from rendezvous.kv import KVError
        from tm_launch.ctl.commands import status

        while True:
            try:
                return status(self._members(), self.job.run_id)
            except KVError:
                time.sleep(0.2)  # etcd on its way back

    def wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if predicate():
                return
            if all(n.proc.poll() is not None for n in self.job.nodes.values()):
                raise SoakError(f"every agent exited while waiting for {what}")
            time.sleep(0.1)
        raise SoakError(f"timed out after {timeout:.0f}s waiting for {what}")

    def max_step(self) -> int:
        done = self.job.steps_done()
        return max(done.values()) if done else -1

    # -- faults ----------------------------------------------------------------------------------
    def _signal_all(self, sig: int) -> None:
        for m in self.cluster.members:
            if m.pid is not None:
                os.kill(m.pid, sig)

    def _kill_all(self, *_) -> None:
        for i in range(len(self.cluster.members)):
            self.cluster.kill(i)

    def _busiest(self) -> int:
        """The member the agents sent the most requests to (through its proxy)."""
        return max(range(len(self.proxies.requests)), key=lambda i: self.proxies.requests[i])

    def _fire_on(self, tag: str, fault, after: bool, within: float, drop: bool = False) -> float | None:
        """Arm the proxies to call ``fault`` (and ``drop`` the connection) when the next ``tag``
        request passes; when it fired (None if no such request came ``within`` seconds)."""
        trigger = self.proxies.arm(tag, fault, after=after, drop=drop)
        if not trigger.fired.wait(within):
            self.proxies.disarm()
            return None
        if trigger.error is not None:
            raise SoakError(f"the {tag} fault failed: {trigger.error!r}")
        return trigger.request.at

    def _worker_kill(self, info: dict, outage) -> None:
        """Kill an active node's worker (``outage`` takes etcd away around it), then wait for the
        plan that replaces the node and every rank stepping in it; a fresh spare, parked."""
        s = self.status()
        gen = s["generation"]
        victim = self.rng.choice([n for n in s["nodes"] if n["role"] == "active"])
        outage(lambda: info.update(node=victim["id"], worker=self.job.kill_worker(victim["id"])))
        self.cluster.restart()
        info["etcd_back"] = time.time()
        self.wait(lambda: (self.status()["generation"] or 0) > gen, 120, "a plan after the worker kill")
        after = self.status()["generation"]
        self.wait(lambda: in_generation(self.job.step_records(), after), 120, f"every rank stepping in generation {after}")
        info["recovered_s"] = round(time.time() - info["etcd_back"], 2)
        self.taken |= set(victim["ranks"])
        self.spares += 1
        spare = f"s{self.spares}"
        self.job.start(spare)
        self.job.wait_parked(spare, timeout=180)

    def inject(self, fault: Fault) -> dict:
        cluster, kind, down = self.cluster, fault.kind, fault.down
        info: dict = {"kind": kind, "down_s": down, "start": time.time()}
        if kind in ("member-kill", "leader-kill", "member-restart"):
            victim = cluster.leader() if kind == "leader-kill" else self.rng.randrange(len(cluster.members))
            info["member"] = victim
            info["start"] = time.time()
            cluster.kill(victim)
            time.sleep(down)
            cluster.restart(victim)
        elif kind == "member-stop":
            victim = self._busiest()
            info["member"] = victim
            os.kill(cluster.members[victim].pid, signal.SIGSTOP)
            time.sleep(down)
            os.kill(cluster.members[victim].pid, signal.SIGCONT)
        elif kind == "all-stop":
            self._signal_all(signal.SIGSTOP)
            time.sleep(down)
            self._signal_all(signal.SIGCONT)
        elif kind == "all-kill":
            self._kill_all()
            time.sleep(down)
            cluster.restart()
        elif kind in ("slow", "slow-member", "slow-peers"):
            busiest = self._busiest()
            members = [busiest] if kind == "slow-member" else None
            info.update(delay_s=fault.delay, member=busiest if members else "all")
            links = {"slow": [self.proxies], "slow-member": [self.proxies, self.peers], "slow-peers": [self.peers]}[kind]
            for proxies in links:
                proxies.set_delay(fault.delay, members)
            time.sleep(down)
            for proxies in links:
                proxies.set_delay(0.0)
        elif kind == "stop-on-renewal":
            info["after"] = fault.after
            fired = self._fire_on("renewal", lambda _: self._signal_all(signal.SIGSTOP), fault.after, 30)
            info["fired"] = fired
            if fired is not None:
                info["start"] = fired
                time.sleep(down)
                self._signal_all(signal.SIGCONT)
        elif kind == "drop-on-renewal":
            info["after"] = fault.after
            info["fired"] = self._fire_on("renewal", None, fault.after, 30, drop=True)
            info["start"] = info["fired"] or info["start"]
        elif kind == "kill-on-reregister":
            self._signal_all(signal.SIGSTOP)  # long enough that every lease lapses when it thaws
            time.sleep(2 * TTL + 1.0)
            trigger = self.proxies.arm("grant" if self.api == "v3" else "register", self._kill_all)
            self._signal_all(signal.SIGCONT)
            info["fired"] = trigger.request.at if trigger.fired.wait(20) else None
            if info["fired"] is None:
                self.proxies.disarm()  # no lease lapsed: nothing re-registered
            else:
                time.sleep(down)
                cluster.restart()
        elif kind == "worker-kill-in-outage":

            def outage(kill):
                self._kill_all()
                time.sleep(min(1.0, down / 2))
                kill()
                time.sleep(max(down - 1.0, 0.0))

            self._worker_kill(info, outage)
        elif kind in ("kill-on-plan", "drop-on-plan"):
            info["after"] = fault.after
            kill_etcd = kind == "kill-on-plan"

            def outage(kill):
                trigger = self.proxies.arm("plan", self._kill_all if kill_etcd else None, after=fault.after, drop=not kill_etcd)
                kill()
                if not trigger.fired.wait(60):
                    self.proxies.disarm()
                    raise SoakError("no plan was written within 60 s of the worker kill")
                info["fired"] = trigger.request.at
                time.sleep(down)

            self._worker_kill(info, outage)
        info["end"] = time.time()
        return info

    def run(self) -> dict:
        t0 = time.time()
        self.job.start_all([f"n{i}" for i in range(ACTIVE)])
        self.wait(lambda: self.status()["generation"] is not None, 120, "generation 0")
        self.job.start("spare")
        self.job.wait_parked("spare", timeout=180)
        start = self.max_step()
        self.wait(lambda: self.max_step() >= start + 20, 120, "training to run")
        try:
            for i, fault in enumerate(self.plan):
                kind = fault.kind
                if self.max_step() > self.steps - 200:
                    raise SoakError(f"the step budget ({self.steps}) ran out after {i} faults: a slower machine than budget() allows")
                result = self.inject(fault)
                records = [t for t, r, _, _, _ in self.job.step_records() if r == 0]
                time.sleep(self.rng.uniform(2.0, 4.0))  # the next fault may land on a renewal or a re-registration
                during = [t for t in [t for t, r, _, _, _ in self.job.step_records() if r == 0] if result["start"] - 1 <= t]
                result["max_step_gap_s"] = max_gap(during)
                result["steps_during"] = sum(1 for t in records if result["start"] <= t <= result["end"])
                self.results.append(result)
                self.log(f"[etcd-chaos] {i + 1}/{len(self.plan)} {kind}: {json.dumps({k: v for k, v in result.items() if k != 'kind'})}")
        finally:
            self.end = self.max_step() + 20
            with open(os.path.join(self.chaos, "end.tmp"), "w") as f:
                f.write(str(self.end))
            os.replace(os.path.join(self.chaos, "end.tmp"), os.path.join(self.chaos, "end"))
            open(os.path.join(self.chaos, "fast"), "w").close()
        codes = self.job.wait(timeout=600)
        return {"seconds": time.time() - t0, "codes": codes}


def soak(
    workdir: str,
    seed: int,
    faults: int,
    api: str,
    layout: str,
    step_sleep: float = 0.03,
    log=print,
    kinds: tuple[str, ...] = KINDS,
) -> dict:
    """Run the soak on a fresh 3-member cluster (the agents behind one ``EtcdProxies`` per
    member, the members behind another) and the reference; the report (pure data, JSON-able)."""
    from rendezvous.etcd_server import EtcdCluster

    plan = schedule(seed, faults, kinds)
    cluster = EtcdCluster()
    peers = EtcdProxies(cluster.peer_addresses, parse=False).start()
    proxies = None
    try:
        cluster.advertise_peers_at(peers.ports).start()
        proxies = EtcdProxies([(cluster.host, m.ports[0]) for m in cluster.members]).start()
        return _soak(cluster, proxies, peers, workdir, seed, plan, api, layout, step_sleep, log)
    finally:
        if proxies is not None:
            proxies.stop()
        cluster.stop()
        peers.stop()


def _soak(cluster, proxies, peers, workdir, seed, plan, api, layout, step_sleep, log) -> dict:
    import torch

    run_ = EtcdChaos(cluster, proxies, peers, workdir, seed, plan, api, layout, step_sleep, log=log)
    try:
        run = run_.run()
    except BaseException:
        log(run_.job.logs_tail())
        raise
    finally:
        run_.job.stop()
    job, events = run_.job, run_.job.events()
    records = job.step_records()
    # A worker kill's node is replaced: it leaves, or (its lease lapsed while etcd was away, then
    # it read the plan without it) it fences itself, rightly; no other node may do either.
    victims = {r["node"] for r in run_.results if r["kind"] in WORKER_KILLS and "node" in r}
    replaced = {e["node"] for e in events if e["kind"] == "left"} | victims
    failed_nodes = {n: c for n, c in run["codes"].items() if c != 0 and n not in replaced}
    fenced = [{"node": e["node"], "why": e["message"]} for e in events if e["kind"] in ("fenced", "etcd_gone")]
    ranks0 = [t for t, r, _, _, _ in records if r == 0]
    calm = [r["max_step_gap_s"] for r in run_.results if r["kind"] not in WORKER_KILLS and r["max_step_gap_s"] is not None]
    report = {
        "api": api,
        "layout": layout,
        "seed": seed,
        "steps": run_.end,
        "seconds": round(run["seconds"], 1),
        "codes": run["codes"],
        "job_failures": len(failed_nodes) + sum(1 for e in events if e["kind"] == "job_failed"),
        "failed_nodes": failed_nodes,
        "worker_restarts": restarts(records, run_.taken),
        "fencings": [f for f in fenced if f["node"] not in victims],
        "fencings_of_replaced_nodes": [f for f in fenced if f["node"] in victims],
        "kept_lapsed_alive": sum(1 for e in events if e["kind"] == "lapsed_alive"),
        "rejoined": sum(1 for e in events if e["kind"] == "rejoined"),
        "kept_while_etcd_down_everywhere": sum(1 for e in events if e["kind"] == "etcd_down_everywhere"),
        "generation_changes": sorted({g for _, _, _, g, _ in records}),
        "longest_stall_s": max_gap(ranks0),
        "longest_stall_without_worker_kill_s": max(calm) if calm else None,
        "results": run_.results,
    }
    if layout == "ddp":
        got = torch.load(run_.out) if os.path.exists(run_.out) else None
    else:
        got = load_ranks(run_.out)
        got = got if sorted(got) == [f"rank{r}" for r in range(ACTIVE * NPROC)] else None
    if got is None:
        report["bitwise_equal"], report["error"] = False, f"no final state: the job ended with {run['codes']}\n{job.logs_tail()}"
        return report
    if layout == "ddp":
        ref = reference_params(",".join(cluster.endpoints), workdir, run_.end, nnodes=ACTIVE, nproc=NPROC, name="etcd-chaos")
    else:
        ref = reference_state(workdir, layout, run_.end)
    report["diff"] = bitwise_diff(got, ref)
    report["bitwise_equal"] = not report["diff"]
    return report


def table(report: dict) -> str:
    rows = [
        "| fault | injected | fired on its request | etcd/member down or slowed (s; @ delay each way) | max step gap, median / max (s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for kind in KINDS:
        mine = [r for r in report["results"] if r["kind"] == kind]
        if not mine:
            continue
        gaps = [r["max_step_gap_s"] for r in mine if r["max_step_gap_s"] is not None]
        downs = ", ".join(f"{r['down_s']:g}" + (f" @ {r['delay_s']:g}" if "delay_s" in r else "") for r in mine)
        fired = f"{sum(1 for r in mine if r.get('fired'))}/{len(mine)}" if "fired" in mine[0] else "—"
        gap = f"{statistics.median(gaps):.2f} / {max(gaps):.2f}" if gaps else "—"
        rows.append(f"| {kind} | {len(mine)} | {fired} | {downs} | {gap} |")
    return "\n".join(rows)


def headline(report: dict) -> str:
    return (
        f"etcd chaos soak ({report['layout']}, etcd {report['api']}), seed {report['seed']}: {len(report['results'])} faults in "
        f"{report['seconds']:.0f} s, {report['steps']} steps; job failures {report['job_failures']}, worker restarts of ranks no "
        f"fault took {sum(report['worker_restarts'].values())}, fencings {len(report['fencings'])} (and {len(report['fencings_of_replaced_nodes'])} of nodes a worker kill replaced), "
        f"lapsed leases kept (agent alive) {report['kept_lapsed_alive']}, re-registrations "
        f"{report['rejoined']}, longest stall {report['longest_stall_s'] or 0:.2f} s "
        f"({report['longest_stall_without_worker_kill_s'] or 0:.2f} s without the worker kill); every rank's final state "
        f"{'bitwise equal to' if report.get('bitwise_equal') else 'DIFFERENT from'} the fault-free run"
    )


def ok(report: dict) -> bool:
    return bool(report.get("bitwise_equal")) and report["job_failures"] == 0 and not report["worker_restarts"] and not report["fencings"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=None, help="default: a random one (printed)")
    p.add_argument("--faults", type=int, default=12)
    p.add_argument("--kinds", default=",".join(KINDS), help="a comma-separated subset of the kinds (default: all)")
    p.add_argument("--api", choices=("v3", "v2"), default="v3")
    p.add_argument("--layout", choices=LAYOUTS, default="ddp")
    p.add_argument("--step-sleep", type=float, default=0.03)
    p.add_argument("--out-dir", default=os.path.join(BENCH, "results"))
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1, 10**6)
    print(f"[etcd-chaos] seed {seed}", flush=True)
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    try:
        schedule(seed, args.faults, kinds)
    except ValueError as e:
        print(f"etcd-chaos: error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    name = f"etcd-chaos-{args.api}-{args.layout}-{seed}"
    workdir = tempfile.mkdtemp(prefix=f"tm-{name}-")
    try:
        report = soak(workdir, seed, args.faults, args.api, args.layout, args.step_sleep, kinds=kinds)
    except SoakError as e:
        print(f"etcd-chaos: error: {e}", file=sys.stderr)
        return 1
    os.makedirs(args.out_dir, exist_ok=True)
    text = headline(report) + "\n\n" + table(report) + "\n"
    with open(os.path.join(args.out_dir, f"{name}.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out_dir, f"{name}.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(text)
    return 0 if ok(report) else 1


if __name__ == "__main__":
    sys.exit(main())
