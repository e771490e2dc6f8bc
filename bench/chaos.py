#!/usr/bin/env python3
"""Chaos soak: one long live job, a seeded random schedule of real faults, a bitwise check.

    .venv/bin/python bench/chaos.py --seed 1 --faults 24      # ~6-10 minutes on 2 cores
    .venv/bin/python bench/chaos.py --layout fsdp --seed 1 --faults 20

One job (3 active nodes x 1 worker, tests/scripts/train.py in live mode) runs while the driver injects
faults one after another, waiting for recovery in between, and keeps the job supplied with warm
spares by starting a fresh agent under a new node name whenever one is consumed (a cluster that
re-provisions nodes). Every fault is real: a signal to a process, a file the training script or
the fake NVML reads, or ``tm-launch ctl drain``. At the end the final parameters must equal a
fault-free run's bit for bit, and a table counts per kind: injected, recovered, median and max
downtime (``tm_launch.local.localjob.downtime``: from the last step every rank completed before the
fault to the first step every rank completed after it).

Kinds (every one appears at least once; the rest are drawn at random):
  kill-forward / kill-allreduce / kill-optimizer / kill-checkpoint
                       the worker SIGKILLs itself at that phase of a step (--chaos-dir trigger)
  agent-kill           SIGKILL of an active node's agent (its workers die with it)
  hang                 SIGSTOP of an active worker; the agent's heartbeat watchdog kills it
  xid                  fake NVML delivers a fatal XID 79 on an active node's GPU
  straggler            an active node's worker slows down; the straggler detector migrates it
  drain                ``tm-launch ctl drain NODE`` (planned)
  spare-killed-parked  SIGKILL of a parked spare's agent or of its sandboxed worker
  spare-killed-promotion  a worker dies, and the spare promoted for it is SIGKILLed at once
  double-failure       two workers on different nodes SIGKILL themselves in the same step

``--layout fsdp|fsdp-tp|zero``: the job is ``tests/scripts/hybrid.py`` in that layout instead (4
active nodes x 1 worker; fsdp-tp: dp 2 x tp 2), where no live rank replicates a rank's state
(ZeRO: its optimizer partition): every recovery is live from the in-memory snapshots, whose
holder of rank r is rank r + 1 (mod 4). ``--layout hsdp|ddp-tp`` (2 x 2): each shard's replica
is rank r ^ 2, every recovery is live from it, and the subgroups without the victim are kept
(their members must stay in step with a peer that enters a generation before them). Its kinds
(``LAYOUT_KINDS``; the replica layouts send no snapshot, so no kill-snapshot):
  kill-forward / kill-backward / kill-optimizer / kill-logging
                       the worker SIGKILLs itself at that phase of a step (--chaos-dir trigger)
  kill-vote / kill-snapshot
                       ... inside the runtime: its commit vote counted, the decision not read; the
                       step's snapshot taken and on its way to its holder (TM_FAILPOINT)
  double-failure       two workers of non-neighbouring ranks (r and r + 2) in the same step: each
                       one's holder survives (two neighbours lose a snapshot's both copies, which
                       falls back to the checkpoint by design: tests/e2e/test_snapshots.py);
                       hsdp, ddp-tp: ranks r and r + 1, whose replicas survive
and agent-kill, hang, xid, drain, spare-killed-parked and spare-killed-promotion as above. No
straggler: the detector's compute time is a step minus the wait in its *last* collective, here
the loss all-reduce after the optimizer step, while the peers of a slow rank wait for it in the
forward's all-gathers: a slow node is never singled out in these layouts. The
reference is the same script under plain torchrun, and every rank's parameters and optimizer
state must be bitwise equal to it; the report also counts restart-mode generations and
``state_lost`` events (a snapshot both of whose copies were lost), which a layout soak must not have.

Results: bench/results/chaos-<seed>.md and .json, chaos-<layout>-<seed>.* (git-ignored).
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

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, REPO)
sys.path.insert(0, BENCH)

from tm_launch.local.localjob import LocalJob, downtime  # noqa: E402

KINDS = (
    "kill-forward",
    "kill-allreduce",
    "kill-optimizer",
    "kill-checkpoint",
    "agent-kill",
    "hang",
    "xid",
    "straggler",
    "drain",
    "spare-killed-parked",
    "spare-killed-promotion",
    "double-failure",
)
SNAPSHOT_LAYOUTS = ("fsdp", "fsdp-tp", "zero")  # tests/scripts/hybrid.py's layouts that no live rank replicates
# ... and those where a data-parallel peer holds each shard: the substitution keeps the subgroups
# without the victim, whose members must stay in step with a peer that enters a generation early
REPLICA_LAYOUTS = ("hsdp", "ddp-tp")
LAYOUTS = SNAPSHOT_LAYOUTS + REPLICA_LAYOUTS
LAYOUT_KINDS = (
    "kill-forward",
    "kill-backward",
    "kill-optimizer",
    "kill-logging",
    "kill-vote",
    "kill-snapshot",
    "agent-kill",
    "hang",
    "xid",
    "drain",
    "spare-killed-parked",
    "spare-killed-promotion",
    "double-failure",
)
ALL_KINDS = KINDS + tuple(k for k in LAYOUT_KINDS if k not in KINDS)  # the table's order
PLANNED = ("straggler", "drain")
ACTIVE = 3  # straggler detection needs three ranks to single one out
LAYOUT_ACTIVE = 4  # fsdp-tp: dp 2 x tp 2
HYBRID = os.path.join(REPO, "tests", "scripts", "hybrid.py")


def kinds_of(layout: str | None, parity: int = 0) -> tuple[str, ...]:
    """The fault kinds of a soak: the DDP job's, or a layout's. With ``--snapshot-parity``
    (``parity``) no double failure: on 4 nodes ranks r and r + 2 are a member of one group and
    a stripe holder of its parity, which parity does not cover (a copy on the next node does)."""
    if layout is None:
        return KINDS
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
    kinds = LAYOUT_KINDS
    if layout in REPLICA_LAYOUTS:  # every shard has a live replica: no snapshot is sent
        kinds = tuple(k for k in kinds if k != "kill-snapshot")
    return tuple(k for k in kinds if not (parity and k == "double-failure"))


CKPT_EVERY = 10


def schedule(seed: int, faults: int, layout: str | None = None, parity: int = 0) -> list[str]:
    """Every kind (of ``layout``'s soak) once, the rest drawn at random, in a seeded random order (pure)."""
    every = kinds_of(layout, parity)
    if faults < len(every):
        raise ValueError(f"--faults must be at least {len(every)} (one of each kind), got {faults}")
    rng = random.Random(seed)
    kinds = list(every) + [rng.choice(every) for _ in range(faults - len(every))]
    rng.shuffle(kinds)
    return kinds


def summarize(results: list[dict]) -> list[dict]:
    """Per kind: injected, recovered, median and max downtime of the recovered ones (pure)."""
    rows = []
    for kind in ALL_KINDS:
        mine = [r for r in results if r["kind"] == kind]
        if not mine:
            continue
        times = [r["downtime_s"] for r in mine if r["recovered"] and r.get("downtime_s") is not None]
        rows.append(
            {
                "kind": kind,
                "injected": len(mine),
                "recovered": sum(1 for r in mine if r["recovered"]),
                "median_downtime_s": statistics.median(times) if times else None,
                "max_downtime_s": max(times) if times else None,
            }
        )
    times = [r["downtime_s"] for r in results if r["recovered"] and r.get("downtime_s") is not None]
    rows.append(
        {
            "kind": "all",
            "injected": len(results),
            "recovered": sum(1 for r in results if r["recovered"]),
            "median_downtime_s": statistics.median(times) if times else None,
            "max_downtime_s": max(times) if times else None,
        }
    )
    return rows


def markdown(rows: list[dict]) -> str:
    def num(x):
        return "—" if x is None else f"{x:.2f}"

    out = ["| fault | injected | recovered | median downtime (s) | max downtime (s) |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['kind']} | {r['injected']} | {r['recovered']} | {num(r['median_downtime_s'])} | {num(r['max_downtime_s'])} |")
    return "\n".join(out)


def in_generation(records, generation: int) -> bool:
    """Every rank of the step log finished a step in ``generation`` or a later one (pure)."""
    ranks = {rank for _, rank, _, _, _ in records}
    return bool(ranks) and ranks <= {rank for _, rank, _, gen, _ in records if gen >= generation}


class SoakError(RuntimeError):
    """The job did not recover from a fault within the bound: the soak stops there."""


class Chaos:
    def __init__(
        self,
        endpoint: str,
        workdir: str,
        seed: int,
        faults: int,
        steps: int,
        step_sleep: float,
        log=print,
        kinds=None,
        layout=None,
        parity: int = 0,
    ):
        self.seed, self.rng = seed, random.Random(seed * 7919 + 1)
        self.layout = layout
        self.active = LAYOUT_ACTIVE if layout else ACTIVE
        self.kinds = list(kinds) if kinds else schedule(seed, faults, layout, parity)
        self.steps = steps
        self.log = log
        self.workdir = workdir
        self.chaos = os.path.join(workdir, "chaos")
        os.makedirs(self.chaos, exist_ok=True)
        self.out = os.path.join(workdir, "params.pt")
        run_id = f"chaos-{seed}-{uuid.uuid4().hex[:8]}"
        self.job = LocalJob(
            endpoint=endpoint,
            run_id=run_id,
            workdir=workdir,
            nnodes=str(self.active),
            nproc=1,
            launcher_args=[
                # Dead agents are found by probing in milliseconds; the lease is only the backstop,
                # and on a shared, overloaded 2-core machine 5 s leases of live agents expired.
                "--lease-ttl",
                "15",
                "--max-restarts",
                "1000",
                "--health-hang-timeout",
                "2",
                "--health-hang-warmup-steps",
                "0",
                "--health-straggler-window",
                "5",
                "--health-straggler-need",
                "3",
                "--health-straggler-of",
                "5",
                *(["--snapshot-parity", str(parity)] if parity else []),
            ],
        )
        common = ["--steps", str(steps), "--step-sleep", str(step_sleep), "--step-log", self.job.step_log, "--chaos-dir", self.chaos]
        if layout is None:
            self.job.script_args = [
                *common,
                "--out",
                self.out,
                "--ckpt-dir",
                os.path.join(workdir, "ckpt"),
                "--ckpt-every",
                str(CKPT_EVERY),
                "--slow-factor",
                "8",
            ]
        else:
            # Live recovery from the snapshots needs no checkpoint (and a soak that fell back to
            # one would fail its checks anyway): none is written. One thread per worker, as in
            # the reference under torchrun.
            self.out = os.path.join(workdir, "out")  # each rank's state: out.rank<r>
            self.job.script = HYBRID
            self.job.env = {"OMP_NUM_THREADS": "1"}
            self.job.script_args = ["--layout", layout, *common, "--out", self.out, "--slow-factor", "8"]
        self.spare_count = 0
        self.results: list[dict] = []
        self.members = self._members(endpoint, run_id)

    # -- plumbing ------------------------------------------------------------------------------
    @staticmethod
    def _members(endpoint: str, run_id: str):
        from rendezvous.kv import connect
        from rendezvous.membership import Membership
        from rendezvous.rdzv_conf import etcd_options

        return Membership(connect("v3", etcd_options(endpoint, run_id, None)))

    def status(self) -> dict:
        from tm_launch.ctl.commands import status

        return status(self.members, self.job.run_id)

    def start_node(self, name: str) -> None:
        timeline = os.path.join(self.chaos, f"nvml.{name}.yaml")
        with open(timeline, "w") as f:
            f.write(f"gpus: 1\nevents:\n  - {{at: 0, after_file: {os.path.join(self.chaos, 'xid.' + name)}, gpu: 0, xid: 79}}\n")
        self.job.start(name, {"TM_FAKE_NVML": timeline})

    def new_spare(self) -> str:
        self.spare_count += 1
        name = f"s{self.spare_count}"
        self.start_node(name)
        return name

    def wait(self, predicate, timeout: float, what: str, interval: float = 0.05):
        from rendezvous.kv import KVError

        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                s = self.status()
            except KVError:  # etcd slow to answer (an overloaded machine): ask again
                time.sleep(interval)
                continue
            value = predicate(s)
            if value:
                return value
            if s["state"] in ("succeeded", "failed") or all(n.proc.poll() is not None for n in self.job.nodes.values()):
                raise SoakError(f"the job ended while waiting for {what}: {s['state']} ({s['cause']})")
            time.sleep(interval)
        raise SoakError(f"timed out after {timeout:.0f}s waiting for {what}")

    @staticmethod
    def roles(s: dict, role: str) -> list[dict]:
        return [n for n in s["nodes"] if n["role"] == role]

    def alive(self, node: str) -> bool:
        """The node's agent runs (this harness kills agents: a killed one stays listed until its lease ends)."""
        return node in self.job.nodes and self.job.nodes[node].proc.poll() is None

    def parked(self, s: dict) -> list[str]:
        return [
            n["id"]
            for n in self.roles(s, "spare")
            if self.alive(n["id"]) and n["progress"] and all(w.get("state") == "parked" for w in n["progress"].values())
        ]

    def max_step(self) -> int:
        done = self.job.steps_done()
        return max(done.values()) if done else -1

    def hold(self, on: bool) -> None:
        """Hold training at the next step boundary (the script waits while chaos/hold exists):
        the run's step budget is not spent while the driver waits for spares to warm up."""
        path = os.path.join(self.chaos, "hold")
        if on:
            open(path, "w").close()
        elif os.path.exists(path):
            os.remove(path)

    def arm(self, rank: int, phase: str, step: int) -> None:
        path = os.path.join(self.chaos, f"kill.{rank}")
        with open(path + ".tmp", "w") as f:
            f.write(f"{phase} {step}\n")
        os.replace(path + ".tmp", path)

    def fired_time(self, rank: int, timeout: float = 30) -> float:
        """When the armed kill of ``rank`` fired (the worker touches the renamed trigger)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            fired = [f for f in os.listdir(self.chaos) if f.startswith(f"kill.{rank}.fired.")]
            if fired:
                path = os.path.join(self.chaos, sorted(fired, key=lambda f: os.path.getmtime(os.path.join(self.chaos, f)))[-1])
                os.rename(path, path.replace(".fired.", ".done."))
                return os.path.getmtime(path.replace(".fired.", ".done."))
            time.sleep(0.02)
        raise SoakError(f"the kill armed for rank {rank} never fired")

    # -- the soak ------------------------------------------------------------------------------
    def run(self) -> dict:
        t0 = time.time()
        for i in range(self.active):
            self.start_node(f"n{i}")
            time.sleep(0.2)
        self.hold(True)
        self.wait(lambda s: s["generation"] is not None, 120, "generation 0")
        for _ in range(3):
            self.new_spare()
            time.sleep(0.5)
        try:
            for i, kind in enumerate(self.kinds):
                self.prepare(need=2 if kind in ("spare-killed-promotion", "double-failure") else 1)
                result = self.inject(kind)
                result["index"] = i
                self.results.append(result)
                self.log(f"[chaos] {i + 1}/{len(self.kinds)} {kind}: {json.dumps({k: v for k, v in result.items() if k != 'kind'})}")
                if not result["recovered"]:
                    break
        finally:
            # End the run a little ahead of every rank (the reference runs exactly that many steps).
            self.end = min(self.steps, self.max_step() + 20)
            with open(os.path.join(self.chaos, "end.tmp"), "w") as f:
                f.write(str(self.end))
            os.replace(os.path.join(self.chaos, "end.tmp"), os.path.join(self.chaos, "end"))
            self.hold(False)
            open(os.path.join(self.chaos, "fast"), "w").close()
        codes = self.job.wait(timeout=600)
        return {"seconds": time.time() - t0, "codes": codes}

    def prepare(self, need: int, stock: int = 3) -> None:
        """Top the spares up to ``stock`` (new node names) and hold training until ``need`` are parked."""
        s = self.status()
        used = {n for plan in self.members.operator_log.history() for n in plan.nodes}  # ever active: not a spare any more
        have = [name for name, node in self.job.nodes.items() if node.proc.poll() is None and name not in used]
        for _ in range(stock - len(have)):
            self.new_spare()
        if len(self.parked(s)) < need:
            self.hold(True)
            self.wait(lambda s: len(self.parked(s)) >= need, 120, f"{need} parked spare(s)", interval=0.3)
        self.hold(False)
        start = self.max_step()
        self.wait(lambda s: self.max_step() >= start + 3, 60, "training to run again after the hold")

    def inject(self, kind: str) -> dict:
        s = self.status()
        gen = s["generation"]
        actives = [n for n in self.roles(s, "active")]
        victim = self.rng.choice(actives)
        rank = victim["ranks"][0]
        step = self.max_step()
        info: dict = {"kind": kind, "generation_before": gen}
        expect_plan = True
        if kind.startswith("kill-"):
            phase = kind.split("-", 1)[1]  # vote, snapshot: a point inside the runtime (TM_FAILPOINT)
            if phase == "checkpoint":  # rank 0 saves the checkpoint
                rank = 0
                victim = next(n for n in actives if 0 in n["ranks"])
            self.arm(rank, phase, step + 2)
            fault_time = self.fired_time(rank)
        elif kind == "agent-kill":
            self.job.kill_agent(victim["id"])
            fault_time = time.time()  # after the signal: downtime counts from the last step before it
        elif kind == "hang":
            self.job.kill_worker(victim["id"], signal.SIGSTOP)
            fault_time = time.time()
        elif kind == "xid":
            fault_time = time.time()
            open(os.path.join(self.chaos, f"xid.{victim['id']}"), "w").close()
        elif kind == "straggler":
            fault_time = time.time()
            open(os.path.join(self.chaos, f"slow.{victim['id']}"), "w").close()
        elif kind == "drain":
            fault_time = time.time()
            out = self.job.ctl("drain", victim["id"])
            if out.returncode != 0:
                raise SoakError(f"ctl drain failed: {out.stderr.strip()}")
        elif kind == "spare-killed-parked":
            expect_plan = False
            # The spare parked in prepare() may have been promoted since (a late plan): wait for one.
            spare = self.rng.choice(self.wait(lambda s: self.parked(s), 120, "a parked spare", interval=0.3))
            how = self.rng.choice(["agent", "worker"])
            victim = {"id": spare}
            if how == "agent":
                self.job.kill_agent(spare)
            else:
                self.job.kill_worker(spare)
            fault_time = time.time()
            info["how"] = how
        elif kind == "spare-killed-promotion":
            self.job.kill_worker(victim["id"])
            fault_time = time.time()
            before = {a["id"] for a in actives}

            def promoted(s):  # a live joiner: a spare killed earlier may be promoted first (its lease still runs)
                if s["generation"] <= gen:
                    return None
                joiners = [
                    n["id"] for n in s["nodes"] if n["role"] in ("active", "draining") and n["id"] not in before and self.alive(n["id"])
                ]
                return joiners or None

            joiners = self.wait(promoted, 60, f"a plan that promotes a live spare for {victim['id']}", interval=0.01)
            self.job.kill_agent(joiners[0])
            info["promoted_and_killed"] = joiners[0]
        elif kind == "double-failure":
            if self.layout in REPLICA_LAYOUTS:  # not its replica (rank ^ 2): the next rank, a shard replicated elsewhere
                other = next(n for n in actives if n["ranks"][0] == (rank + 1) % self.active)
            elif self.layout:  # not the victim's holder (rank + 1) nor the rank it holds for (rank - 1)
                other = next(n for n in actives if n["ranks"][0] == (rank + 2) % self.active)
            else:
                other = self.rng.choice([n for n in actives if n["id"] != victim["id"]])
            ranks = [rank, other["ranks"][0]]
            for r in ranks:
                self.arm(r, "forward", step + 3)
            fault_time = min(self.fired_time(r) for r in ranks)
            info["victims"] = [victim["id"], other["id"]]
        else:
            raise ValueError(kind)
        info["victim"] = victim["id"]
        return self.recover(kind, info, fault_time, gen, victim["id"], expect_plan)

    def removed_since(self, gen: int) -> set[str]:
        """The nodes that plans after generation ``gen`` took out of the job, as their publishers
        logged them. A victim active again is out if one of these took it out: a node whose
        worker was killed keeps its agent, which parks as a spare again and may be promoted by
        the very next plan (a second fault). A plan whose publisher was killed at once (a
        promoted spare is also the planner) leaves no event; its victims are out if inactive."""
        plans = (e for e in self.job.events() if e["kind"] == "plan" and e.get("generation", 0) > gen)
        return {node for e in plans for node in (*e.get("removed", ()), *e.get("replaced", {}).values())}

    def recover(self, kind: str, info: dict, fault_time: float, gen: int, victim: str, expect_plan: bool) -> dict:
        """Wait (bounded) until the victim is out of the job and every rank trained on; measure."""
        try:
            if expect_plan:
                # Every node this fault took out (both of a double failure, the promoted spare
                # killed on its way in) is out of the job, and the job is whole again.
                gone = {victim, *info.get("victims", ())} | ({info["promoted_and_killed"]} if "promoted_and_killed" in info else set())

                def replaced(s):  # -> the generation that replaced them (>= 1)
                    active = {n["id"] for n in s["nodes"] if n["role"] in ("active", "draining")}
                    if s["generation"] <= gen or len(active) != self.active:
                        return None
                    back = gone & active  # victims active again: out only if a plan took them out since
                    return s["generation"] if not back or back <= self.removed_since(gen) else None

                new_gen = self.wait(replaced, 90, f"{victim} to be replaced after {kind}", interval=0.1)
            elif info.get("how") == "worker":
                # Its progress record says "parked" until the agent publishes the restart (~1 s).
                self.wait(lambda s: victim not in self.parked(s), 30, f"spare {victim}'s agent to restart its worker", interval=0.1)
                self.wait(lambda s: victim in self.parked(s), 90, f"spare {victim} to warm up again", interval=0.3)

            def trained(_):
                records = self.job.step_records()
                if expect_plan and not in_generation(records, new_gen):
                    return None  # a planned switch happens steps after its plan: not yet
                d = downtime(records, fault_time)
                return d if d["first_step_after"] is not None and self.max_step() >= d["first_step_after"] + 3 else None

            self.wait(trained, 90, f"every rank to train on after {kind}", interval=0.1)
        except SoakError as e:
            info.update(recovered=False, error=str(e))
            return info
        finally:
            if kind == "straggler":
                os.remove(os.path.join(self.chaos, f"slow.{victim}"))
        records = self.job.step_records()
        at = fault_time
        if kind in PLANNED:
            from downtime import switch_time  # bench/downtime.py: where a planned switch stalls

            at = switch_time(records, fault_time) or fault_time
        d = downtime(records, at)
        s = self.status()
        info.update(
            recovered=True,
            fault_time=fault_time,
            generation_after=s["generation"],
            downtime_s=d["downtime_s"],
            steps_redone=d["steps_redone"],
            last_step_before=d["last_step_before"],
            cause=s["cause"],
        )
        return info


def reference_params(endpoint: str, workdir: str, steps: int, nnodes: int = ACTIVE, nproc: int = 1, name: str = "chaos"):
    """The fault-free run's final parameters (same script, nodes and steps, no step sleep);
    ``bench/etcd_chaos.py`` uses it too, with its own nodes."""
    import torch

    out = os.path.join(workdir, "reference.pt")
    job = LocalJob(
        endpoint=endpoint,
        run_id=f"{name}-ref-{uuid.uuid4().hex[:8]}",
        workdir=os.path.join(workdir, "reference"),
        nnodes=str(nnodes),
        nproc=nproc,
        launcher_args=["--lease-ttl", "15"],
        script_args=["--steps", str(steps), "--out", out],
    )
    job.start_all([f"r{i}" for i in range(nnodes)])
    try:
        codes = job.wait(timeout=300)
    finally:
        job.stop()
    if set(codes.values()) != {0}:
        raise SoakError(f"the reference run failed: {codes}\n{job.logs_tail()}")
    return torch.load(out)


def reference_state(workdir: str, layout: str, steps: int) -> dict:
    """A layout's fault-free final state, ``{"rank<r>": {name: tensor}}``: the same script under
    plain torchrun (``tests/e2e/test_snapshots.py``'s reference), the same steps, no step sleep."""
    import subprocess

    ref = os.path.join(workdir, "reference")
    os.makedirs(ref, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(LAYOUT_ACTIVE), HYBRID]
    cmd += ["--layout", layout, "--steps", str(steps), "--out", os.path.join(ref, "out")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    if out.returncode != 0:
        raise SoakError(f"the reference run failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return load_ranks(os.path.join(ref, "out"))


def load_ranks(prefix: str) -> dict:
    """``{"rank<r>": state}`` from hybrid.py's ``--out PREFIX`` files (``PREFIX.rank<r>``)."""
    import glob

    import torch

    return {os.path.basename(p).rsplit(".", 1)[1]: torch.load(p) for p in sorted(glob.glob(f"{glob.escape(prefix)}.rank*"))}


def bitwise_diff(params: dict, ref: dict) -> dict:
    """What differs: ``{name: max abs difference}`` (``{"keys": [...]}`` if the names differ);
    nested per rank (``{"rank1": {...}}``) for a layout's states."""
    import torch

    if params.keys() != ref.keys():
        return {"keys": sorted(set(params) ^ set(ref))}
    diff = {}
    for k in ref:
        if isinstance(ref[k], dict):
            if sub := bitwise_diff(params[k], ref[k]):
                diff[k] = sub
        elif not torch.equal(params[k], ref[k]):
            diff[k] = (params[k].double() - ref[k].double()).abs().max().item() if params[k].shape == ref[k].shape else "shape"
    return diff


def generations(events: list[dict], results: list[dict]) -> dict:
    """The job's generation changes from its agents' event logs: how many, the restart-mode ones
    (every worker started afresh), the unexplained ones (outside every fault's window: between
    one fault's recovery and the next fault, nothing should change), ``state_lost`` events; and
    each fault's ``live`` (every plan between its generation before and after was live). Pure
    but for ``results``, updated."""
    plans = {e["generation"]: e for e in events if e["kind"] == "plan" and e.get("generation", 0) >= 1}
    windows = []
    for r in results:
        if r.get("recovered") and r.get("generation_after") is not None:
            windows.append((r["generation_before"], r["generation_after"]))
            mine = [p for g, p in plans.items() if r["generation_before"] < g <= r["generation_after"]]
            r["live"] = all(p.get("live") for p in mine)
        elif r.get("generation_before") is not None:
            windows.append((r["generation_before"], float("inf")))  # not recovered: anything after it
    return {
        "generation_changes": len(plans),
        "restarts": [{"generation": g, "cause": p.get("cause")} for g, p in sorted(plans.items()) if not p.get("live")],
        "unexplained": [
            {"generation": g, "cause": p.get("cause")} for g, p in sorted(plans.items()) if not any(a < g <= b for a, b in windows)
        ],
        "state_lost": [
            {k: e.get(k) for k in ("time", "node", "message", "lost_ranks", "lost_step") if k in e}
            for e in events
            if e["kind"] == "state_lost"
        ],
    }


def soak(
    endpoint: str,
    workdir: str,
    seed: int,
    faults: int,
    steps: int,
    step_sleep: float,
    log=print,
    kinds=None,
    layout: str | None = None,
    parity: int = 0,
) -> dict:
    """Run the soak and the reference; the report (``table``, ``results``, ``bitwise_equal``...);
    ``parity``: the agents' ``--snapshot-parity``."""
    import torch

    chaos = Chaos(endpoint, workdir, seed, faults, steps, step_sleep, log=log, kinds=kinds, layout=layout, parity=parity)
    try:
        run = chaos.run()
    except BaseException:
        log(chaos.job.logs_tail())
        raise
    finally:
        chaos.job.stop()
    steps = chaos.end
    report = {
        "layout": layout,
        "active": chaos.active,
        "seed": seed,
        "steps": steps,
        "faults": len(chaos.results),
        "seconds": round(run["seconds"], 1),
        "codes": run["codes"],
        "results": chaos.results,
        "table": summarize(chaos.results),
        "spares_started": chaos.spare_count,
        **generations(chaos.job.events(), chaos.results),
    }
    if layout is None:
        got = torch.load(chaos.out) if os.path.exists(chaos.out) else None
    else:
        got = load_ranks(chaos.out)
        got = got if sorted(got) == [f"rank{r}" for r in range(chaos.active)] else None
    if got is None:
        report["bitwise_equal"], report["error"] = False, f"no final parameters: the job ended with {run['codes']}\n{chaos.job.logs_tail()}"
        return report
    ref = reference_params(endpoint, workdir, steps) if layout is None else reference_state(workdir, layout, steps)
    report["diff"] = bitwise_diff(got, ref)
    report["bitwise_equal"] = not report["diff"]
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--faults", type=int, default=24)
    p.add_argument("--steps", type=int, default=800, help="at most this many training steps (the run ends 20 steps after the last fault)")
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--etcd", default=None, help="an etcd endpoint (default: start a private one)")
    p.add_argument("--out-dir", default=os.path.join(BENCH, "results"))
    p.add_argument("--kinds", default=None, help="comma-separated kinds to inject in this order instead of the schedule (debugging)")
    p.add_argument(
        "--layout",
        default=None,
        choices=LAYOUTS,
        help="soak tests/scripts/hybrid.py in this layout (4 nodes x 1 worker; live from snapshots, or from replicas: hsdp, ddp-tp) "
        "instead of the DDP job",
    )
    p.add_argument(
        "--snapshot-parity", type=int, default=0, metavar="K", help="with --layout: the agents' --snapshot-parity (no double failure)"
    )
    args = p.parse_args()
    kinds = args.kinds.split(",") if args.kinds else None
    known = kinds_of(args.layout, args.snapshot_parity)
    unknown = [k for k in kinds or () if k not in known]
    if unknown:
        print(f"chaos: error: unknown fault kind(s) {', '.join(unknown)}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    try:
        if not kinds:
            schedule(args.seed, args.faults, args.layout, args.snapshot_parity)
    except ValueError as e:
        print(f"chaos: error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup (no orphaned agents)
    name = f"chaos-{args.layout}-{args.seed}" if args.layout else f"chaos-{args.seed}"
    workdir = tempfile.mkdtemp(prefix=f"tm-{name}-")
    server = None
    if args.etcd is None:
        from rendezvous.etcd_server import EtcdServer

        server = EtcdServer().start()
    try:
        report = soak(
            args.etcd or server.endpoint,
            workdir,
            args.seed,
            args.faults,
            args.steps,
            args.step_sleep,
            kinds=kinds,
            layout=args.layout,
            parity=args.snapshot_parity,
        )
    except SoakError as e:
        print(f"chaos: error: {e}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()
    os.makedirs(args.out_dir, exist_ok=True)
    table = markdown(report["table"])
    what = "final parameters" if args.layout is None else "every rank's final parameters and optimizer state"
    head = (
        f"Chaos soak{f' ({args.layout}, tests/scripts/hybrid.py)' if args.layout else ''}, seed {args.seed}: "
        f"{report['faults']} faults in {report['seconds']:.0f} s, {report['steps']} steps, "
        f"{report['active']} active nodes x 1 worker, {report['spares_started']} spares started; "
        f"{report['generation_changes']} generation changes ({len(report['restarts'])} in restart mode, "
        f"{len(report['unexplained'])} no fault explains), {len(report['state_lost'])} state lost; "
        f"{sum(1 for r in report['results'] if r.get('live'))} of {report['faults']} faults recovered live; {what} "
        f"{'bitwise equal to' if report['bitwise_equal'] else 'DIFFERENT from'} the fault-free run"
    )
    with open(os.path.join(args.out_dir, f"{name}.md"), "w") as f:
        f.write(head + "\n\n" + table + "\n")
    with open(os.path.join(args.out_dir, f"{name}.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(head + "\n\n" + table)
    ok = (
        report["bitwise_equal"]
        and all(r["recovered"] for r in report["results"])
        and len(report["results"]) == len(kinds or schedule(args.seed, args.faults, args.layout))
        and (args.layout is None or not (report["restarts"] or report["state_lost"] or report["unexplained"]))
        and (args.layout is None or all(r.get("live") for r in report["results"]))
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
