#!/usr/bin/env python3
"""Chaos soak: one long live job, a seeded random schedule of real faults, a bitwise check.

    .venv/bin/python bench/chaos.py --seed 1 --faults 24      # ~6-10 minutes on 2 cores

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

Results: bench/results/chaos-<seed>.md and .json (git-ignored).
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
PLANNED = ("straggler", "drain")
ACTIVE = 3  # straggler detection needs three ranks to single one out
CKPT_EVERY = 10


def schedule(seed: int, faults: int) -> list[str]:
    """Every kind once, the rest drawn at random, in a seeded random order (pure)."""
    if faults < len(KINDS):
        raise ValueError(f"--faults must be at least {len(KINDS)} (one of each kind), got {faults}")
    rng = random.Random(seed)
    kinds = list(KINDS) + [rng.choice(KINDS) for _ in range(faults - len(KINDS))]
    rng.shuffle(kinds)
    return kinds


def summarize(results: list[dict]) -> list[dict]:
    """Per kind: injected, recovered, median and max downtime of the recovered ones (pure)."""
    rows = []
    for kind in KINDS:
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


class SoakError(RuntimeError):
    """The job did not recover from a fault within the bound: the soak stops there."""


class Chaos:
    def __init__(self, endpoint: str, workdir: str, seed: int, faults: int, steps: int, step_sleep: float, log=print, kinds=None):
        self.seed, self.rng = seed, random.Random(seed * 7919 + 1)
        self.kinds = list(kinds) if kinds else schedule(seed, faults)
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
            nnodes=str(ACTIVE),
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
            ],
        )
        self.job.script_args = [
            "--steps",
            str(steps),
            "--step-sleep",
            str(step_sleep),
            "--out",
            self.out,
            "--step-log",
            self.job.step_log,
            "--chaos-dir",
            self.chaos,
            "--ckpt-dir",
            os.path.join(workdir, "ckpt"),
            "--ckpt-every",
            str(CKPT_EVERY),
            "--slow-factor",
            "8",
        ]
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

    def parked(self, s: dict) -> list[str]:
        return [
            n["id"]
            for n in self.roles(s, "spare")
            if n["id"] in self.job.nodes
            and self.job.nodes[n["id"]].proc.poll() is None
            and n["progress"]
            and all(w.get("state") == "parked" for w in n["progress"].values())
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
        for i in range(ACTIVE):
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
        used = {n for plan in self.members.history() for n in plan.nodes}  # ever active: not a spare any more
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
            phase = kind.split("-", 1)[1]
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
            plan = self.wait(lambda s: s if s["generation"] > gen else None, 60, "the plan that promotes a spare", interval=0.01)
            joiners = [n["id"] for n in plan["nodes"] if n["role"] in ("active", "draining") and n["id"] not in {a["id"] for a in actives}]
            if not joiners:
                raise SoakError(f"no spare was promoted for {victim['id']}: {plan['cause']}")
            self.job.kill_agent(joiners[0])
            info["promoted_and_killed"] = joiners[0]
        elif kind == "double-failure":
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

    def recover(self, kind: str, info: dict, fault_time: float, gen: int, victim: str, expect_plan: bool) -> dict:
        """Wait (bounded) until the victim is out of the job and every rank trained on; measure."""
        try:
            if expect_plan:

                def replaced(s):
                    active = {n["id"] for n in s["nodes"] if n["role"] in ("active", "draining")}
                    return s["generation"] > gen and victim not in active and len(active) == ACTIVE

                self.wait(replaced, 90, f"{victim} to be replaced after {kind}", interval=0.1)
            elif info.get("how") == "worker":
                # Its progress record says "parked" until the agent publishes the restart (~1 s).
                self.wait(lambda s: victim not in self.parked(s), 30, f"spare {victim}'s agent to restart its worker", interval=0.1)
                self.wait(lambda s: victim in self.parked(s), 90, f"spare {victim} to warm up again", interval=0.3)

            def trained(_):
                d = downtime(self.job.step_records(), fault_time)
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


def reference_params(endpoint: str, workdir: str, steps: int):
    """The fault-free run's final parameters (same script, same steps, no step sleep)."""
    import torch

    out = os.path.join(workdir, "reference.pt")
    job = LocalJob(
        endpoint=endpoint,
        run_id=f"chaos-ref-{uuid.uuid4().hex[:8]}",
        workdir=os.path.join(workdir, "reference"),
        nnodes=str(ACTIVE),
        nproc=1,
        launcher_args=["--lease-ttl", "15"],
        script_args=["--steps", str(steps), "--out", out],
    )
    job.start_all([f"r{i}" for i in range(ACTIVE)])
    try:
        codes = job.wait(timeout=300)
    finally:
        job.stop()
    if set(codes.values()) != {0}:
        raise SoakError(f"the reference run failed: {codes}\n{job.logs_tail()}")
    return torch.load(out)


def bitwise_diff(params: dict, ref: dict) -> dict:
    import torch

    if params.keys() != ref.keys():
        return {"keys": sorted(set(params) ^ set(ref))}
    return {k: (params[k] - ref[k]).abs().max().item() for k in ref if not torch.equal(params[k], ref[k])}


def soak(endpoint: str, workdir: str, seed: int, faults: int, steps: int, step_sleep: float, log=print, kinds=None) -> dict:
    """Run the soak and the reference; the report (``table``, ``results``, ``bitwise_equal``...)."""
    import torch

    chaos = Chaos(endpoint, workdir, seed, faults, steps, step_sleep, log=log, kinds=kinds)
    try:
        run = chaos.run()
    except BaseException:
        log(chaos.job.logs_tail())
        raise
    finally:
        chaos.job.stop()
    steps = chaos.end
    report = {
        "seed": seed,
        "steps": steps,
        "faults": len(chaos.results),
        "seconds": round(run["seconds"], 1),
        "codes": run["codes"],
        "results": chaos.results,
        "table": summarize(chaos.results),
        "spares_started": chaos.spare_count,
    }
    if not os.path.exists(chaos.out):
        report["bitwise_equal"], report["error"] = False, f"no final parameters: the job ended with {run['codes']}\n{chaos.job.logs_tail()}"
        return report
    report["diff"] = bitwise_diff(torch.load(chaos.out), reference_params(endpoint, workdir, steps))
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
    args = p.parse_args()
    kinds = args.kinds.split(",") if args.kinds else None
    unknown = [k for k in kinds or () if k not in KINDS]
    if unknown:
        print(f"chaos: error: unknown fault kind(s) {', '.join(unknown)}; known: {', '.join(KINDS)}", file=sys.stderr)
        return 2
    try:
        if not kinds:
            schedule(args.seed, args.faults)
    except ValueError as e:
        print(f"chaos: error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup (no orphaned agents)
    workdir = tempfile.mkdtemp(prefix=f"tm-chaos-{args.seed}-")
    server = None
    if args.etcd is None:
        from rendezvous.etcd_server import EtcdServer

        server = EtcdServer().start()
    try:
        report = soak(args.etcd or server.endpoint, workdir, args.seed, args.faults, args.steps, args.step_sleep, kinds=kinds)
    except SoakError as e:
        print(f"chaos: error: {e}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()
    os.makedirs(args.out_dir, exist_ok=True)
    table = markdown(report["table"])
    head = (
        f"Chaos soak, seed {args.seed}: {report['faults']} faults in {report['seconds']:.0f} s, {report['steps']} steps, "
        f"{ACTIVE} active nodes x 1 worker, {report['spares_started']} spares started; final parameters "
        f"{'bitwise equal to' if report['bitwise_equal'] else 'DIFFERENT from'} the fault-free run"
    )
    with open(os.path.join(args.out_dir, f"chaos-{args.seed}.md"), "w") as f:
        f.write(head + "\n\n" + table + "\n")
    with open(os.path.join(args.out_dir, f"chaos-{args.seed}.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(head + "\n\n" + table)
    ok = (
        report["bitwise_equal"]
        and all(r["recovered"] for r in report["results"])
        and len(report["results"]) == len(kinds or schedule(args.seed, args.faults))
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
