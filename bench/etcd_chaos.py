#!/usr/bin/env python3
"""Control-plane chaos soak: a live job on a 3-member etcd cluster, a seeded random schedule of
etcd faults, and the promise that none of them makes the job notice.

    .venv/bin/python bench/etcd_chaos.py --seed 1 --faults 12                  # DDP, etcd's v3 API
    .venv/bin/python bench/etcd_chaos.py --seed 1 --faults 12 --api v2 --layout fsdp

One job (2 active nodes x 2 workers and 1 parked spare; ``tests/scripts/train.py`` under DDP, or
``tests/scripts/hybrid.py --layout fsdp``, where no live rank replicates a rank's state) trains
while the driver injects etcd faults one after another, each a real signal to real etcd members
(``rendezvous.etcd_server.EtcdCluster``):

  member-kill      a random member SIGKILLed, restarted on its data dir 1-5 s later
  leader-kill      the leader SIGKILLed (the others elect one), restarted 1-5 s later
  member-restart   a random member SIGKILLed and restarted at once, on its data dir
  all-stop         every member SIGSTOPped for 1-10 s (a frozen VM, a paused container), then SIGCONT
  all-kill         every member SIGKILLed for 1-10 s, then restarted on their data dirs
  worker-kill-in-outage
                   every member SIGKILLed, an active node's worker SIGKILLed 1 s later, etcd back
                   after 1-10 s: the job must recover live once etcd is back (the spare takes the
                   node's ranks); a fresh spare is then started and parked

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

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, REPO)
sys.path.insert(0, BENCH)

from chaos import HYBRID, SoakError, bitwise_diff, in_generation, load_ranks, reference_state  # noqa: E402

from tm_launch.local.localjob import LocalJob  # noqa: E402

KINDS = ("member-kill", "leader-kill", "member-restart", "all-stop", "all-kill", "worker-kill-in-outage")
LAYOUTS = ("ddp", "fsdp")
ACTIVE, NPROC = 2, 2
TTL = 3.0


def schedule(seed: int, faults: int) -> list[tuple[str, float]]:
    """Every kind once, the rest drawn at random, each with how long etcd (or the member) stays
    down: (kind, seconds), in a seeded random order (pure). At most one worker kill per soak
    beyond the first: each uses up a spare, which the driver replaces and waits to park."""
    if faults < len(KINDS):
        raise ValueError(f"--faults must be at least {len(KINDS)} (one of each kind), got {faults}")
    rng = random.Random(seed)
    calm = [k for k in KINDS if k != "worker-kill-in-outage"]
    kinds = list(KINDS) + [rng.choice(calm) for _ in range(faults - len(KINDS))]
    rng.shuffle(kinds)
    out = []
    for kind in kinds:
        if kind in ("all-stop", "all-kill", "worker-kill-in-outage"):
            out.append((kind, round(rng.uniform(1.0, 10.0), 2)))
        elif kind == "member-restart":
            out.append((kind, 0.0))
        else:
            out.append((kind, round(rng.uniform(1.0, 5.0), 2)))
    return out


def budget(plan: list[tuple[str, float]], step_sleep: float) -> int:
    """Steps enough for ``plan`` (pure): setup, each fault's outage and the gap after it, a
    worker kill's recovery and a fresh spare's warm-up, at one step per ``step_sleep`` and a
    fifth more (a step takes longer than its sleep: 18 steps a second were measured at 0.03 s)."""
    seconds = 60.0 + sum(down + 6.0 + (90.0 if kind == "worker-kill-in-outage" else 0.0) for kind, down in plan)
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
    def __init__(self, cluster, workdir: str, seed: int, faults: int, api: str, layout: str, step_sleep: float, log=print):
        self.cluster, self.workdir, self.seed, self.api, self.layout, self.log = cluster, workdir, seed, api, layout, log
        self.rng = random.Random(seed * 104729 + 3)
        self.plan = schedule(seed, faults)
        self.chaos = os.path.join(workdir, "chaos")
        os.makedirs(self.chaos, exist_ok=True)
        self.job = LocalJob(
            endpoint=",".join(cluster.endpoints),
            run_id=f"etcd-chaos-{seed}-{uuid.uuid4().hex[:8]}",
            workdir=workdir,
            nnodes=str(ACTIVE),
            nproc=NPROC,
            backend="etcd-v3" if api == "v3" else "etcd-v2",
            launcher_args=["--lease-ttl", str(TTL), "--max-restarts", "3"],
        )
        # The script's step budget (``budget``); the driver ends the run 20 steps after the last
        # fault (``DIR/end``), and the steps left over after that run empty, at full speed.
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

        return Membership(connect(self.api, etcd_options(self.job.endpoint, self.job.run_id, None)))

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

    def inject(self, kind: str, down: float) -> dict:
        cluster = self.cluster
        info: dict = {"kind": kind, "down_s": down, "start": time.time()}
        if kind in ("member-kill", "leader-kill", "member-restart"):
            victim = cluster.leader() if kind == "leader-kill" else self.rng.randrange(len(cluster.members))
            info["member"] = victim
            info["start"] = time.time()
            cluster.kill(victim)
            time.sleep(down)
            cluster.restart(victim)
        elif kind == "all-stop":
            self._signal_all(signal.SIGSTOP)
            time.sleep(down)
            self._signal_all(signal.SIGCONT)
        elif kind == "all-kill":
            for i in range(len(cluster.members)):
                cluster.kill(i)
            time.sleep(down)
            cluster.restart()
        elif kind == "worker-kill-in-outage":
            s = self.status()
            gen = s["generation"]
            actives = [n for n in s["nodes"] if n["role"] == "active"]
            victim = self.rng.choice(actives)
            for i in range(len(cluster.members)):
                cluster.kill(i)
            time.sleep(min(1.0, down / 2))
            info["node"], info["worker"] = victim["id"], self.job.kill_worker(victim["id"])
            time.sleep(max(down - 1.0, 0.0))
            cluster.restart()
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
            for i, (kind, down) in enumerate(self.plan):
                if self.max_step() > self.steps - 200:
                    raise SoakError(f"the step budget ({self.steps}) ran out after {i} faults: a slower machine than budget() allows")
                result = self.inject(kind, down)
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


def reference_ddp(endpoint: str, workdir: str, steps: int):
    """The DDP job's fault-free final parameters: the same script, nodes and steps, no faults."""
    import torch

    out = os.path.join(workdir, "reference.pt")
    job = LocalJob(
        endpoint=endpoint,
        run_id=f"etcd-chaos-ref-{uuid.uuid4().hex[:8]}",
        workdir=os.path.join(workdir, "reference"),
        nnodes=str(ACTIVE),
        nproc=NPROC,
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


def soak(cluster, workdir: str, seed: int, faults: int, api: str, layout: str, step_sleep: float = 0.03, log=print) -> dict:
    """Run the soak and the reference; the report (pure data, JSON-able)."""
    import torch

    run_ = EtcdChaos(cluster, workdir, seed, faults, api, layout, step_sleep, log=log)
    try:
        run = run_.run()
    except BaseException:
        log(run_.job.logs_tail())
        raise
    finally:
        run_.job.stop()
    job, events = run_.job, run_.job.events()
    records = job.step_records()
    replaced = {e["node"] for e in events if e["kind"] == "left"}
    failed_nodes = {n: c for n, c in run["codes"].items() if c != 0 and n not in replaced}
    ranks0 = [t for t, r, _, _, _ in records if r == 0]
    calm = [r["max_step_gap_s"] for r in run_.results if r["kind"] != "worker-kill-in-outage" and r["max_step_gap_s"] is not None]
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
        "fencings": [{"node": e["node"], "why": e["message"]} for e in events if e["kind"] in ("fenced", "etcd_gone")],
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
    ref = reference_ddp(",".join(cluster.endpoints), workdir, run_.end) if layout == "ddp" else reference_state(workdir, layout, run_.end)
    report["diff"] = bitwise_diff(got, ref)
    report["bitwise_equal"] = not report["diff"]
    return report


def table(report: dict) -> str:
    rows = ["| fault | injected | etcd/member down (s) | max step gap, median / max (s) |", "|---|---:|---:|---:|"]
    for kind in KINDS:
        mine = [r for r in report["results"] if r["kind"] == kind]
        if not mine:
            continue
        gaps = [r["max_step_gap_s"] for r in mine if r["max_step_gap_s"] is not None]
        downs = ", ".join(f"{r['down_s']:g}" for r in mine)
        gap = f"{statistics.median(gaps):.2f} / {max(gaps):.2f}" if gaps else "—"
        rows.append(f"| {kind} | {len(mine)} | {downs} | {gap} |")
    return "\n".join(rows)


def headline(report: dict) -> str:
    return (
        f"etcd chaos soak ({report['layout']}, etcd {report['api']}), seed {report['seed']}: {len(report['results'])} faults in "
        f"{report['seconds']:.0f} s, {report['steps']} steps; job failures {report['job_failures']}, worker restarts of ranks no "
        f"fault took {sum(report['worker_restarts'].values())}, fencings {len(report['fencings'])}, re-registrations "
        f"{report['rejoined']}, longest stall {report['longest_stall_s'] or 0:.2f} s "
        f"({report['longest_stall_without_worker_kill_s'] or 0:.2f} s without the worker kill); every rank's final state "
        f"{'bitwise equal to' if report.get('bitwise_equal') else 'DIFFERENT from'} the fault-free run"
    )


def ok(report: dict) -> bool:
    return bool(report.get("bitwise_equal")) and report["job_failures"] == 0 and not report["worker_restarts"] and not report["fencings"]


def main() -> int:
    from rendezvous.etcd_server import EtcdCluster

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=None, help="default: a random one (printed)")
    p.add_argument("--faults", type=int, default=12)
    p.add_argument("--api", choices=("v3", "v2"), default="v3")
    p.add_argument("--layout", choices=LAYOUTS, default="ddp")
    p.add_argument("--step-sleep", type=float, default=0.03)
    p.add_argument("--out-dir", default=os.path.join(BENCH, "results"))
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1, 10**6)
    print(f"[etcd-chaos] seed {seed}", flush=True)
    try:
        schedule(seed, args.faults)
    except ValueError as e:
        print(f"etcd-chaos: error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    name = f"etcd-chaos-{args.api}-{args.layout}-{seed}"
    workdir = tempfile.mkdtemp(prefix=f"tm-{name}-")
    cluster = EtcdCluster().start()
    try:
        report = soak(cluster, workdir, seed, args.faults, args.api, args.layout, args.step_sleep)
    except SoakError as e:
        print(f"etcd-chaos: error: {e}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
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
