"""``make demo``: live substitution on one machine, in a minute.

A private etcd, two active "nodes" and one spare (three tm-launch agents on loopback), the
example DDP job; once the spare has warmed up in its sandbox, one worker is SIGKILLed. The spare
takes its rank while the other node's worker keeps its process, and the demo prints what
happened and what it cost, phase by phase, next to what a cold restart costs on this machine.
Everything it says is read back, none of it assumed: ranks from the plans (``ctl status
--json``: join order decides them), processes and downtime from the training script's step
log, the phases from the agents' stamps (``ctl timeline --json``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time

from rendezvous.etcd_server import EtcdServer

from ..joblog import PHASES
from ..logs import logger
from .localjob import LocalJob, downtime

log = logger("tm_launch.local.demo")  # not __name__: `python -m` runs it as __main__


def say(message: str) -> None:
    """The demo's progress, ``[demo] message`` on stderr (its report goes to stdout)."""
    log.info("%s", message)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tm_launch.local.demo", description=__doc__)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--kill-step", type=int, default=40, help="the worker is killed when training passes this step")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, step log, events)")
    args = p.parse_args(argv)
    logger(prog="demo", libraries=logging.WARNING)

    workdir = tempfile.mkdtemp(prefix="tm-launch-demo-")
    say("starting a private etcd on loopback")
    with EtcdServer(data_dir=os.path.join(workdir, "etcd")) as etcd:
        job = LocalJob(
            endpoint=etcd.endpoint,
            run_id="demo",
            workdir=workdir,
            nnodes="2",
            nproc=1,
            launcher_args=["--max-restarts", "3", "--spares", "1"],
        )
        trigger = os.path.join(workdir, "go")
        job.script_args = [
            "--steps",
            str(args.steps),
            "--step-sleep",
            "0.05",
            "--step-log",
            job.step_log,
            "--pause-step",
            "10",
            "--pause-file",
            trigger,
        ]
        try:
            return _run(job, etcd, trigger, args, workdir)
        finally:
            job.stop()
            if args.keep:
                say(f"logs kept in {workdir}")
            else:
                shutil.rmtree(workdir, ignore_errors=True)


def _run(job: LocalJob, etcd: EtcdServer, trigger: str, args, workdir: str) -> int:
    say(f"etcd at {etcd.endpoint}; starting node0 and node1 (active) with tm-launch --rdzv-backend etcd-v3")
    job.start_all(["node0", "node1"])
    first = ranks(job.wait_for(lambda s: s if s["generation"] is not None else None, 180, "the first generation"))
    say(f"generation 0 formed: node0 has rank(s) {first['node0']}, node1 has rank(s) {first['node1']}; starting node2 (spare)")
    job.start("node2")
    t0 = time.time()
    job.wait_parked("node2", timeout=240)
    say(f"node2 warmed up in its sandbox (imports, model, DDP, {2} real steps, no traffic) and parked after {time.time() - t0:.1f}s")
    open(trigger, "w").close()
    job.wait_step(args.kill_step, timeout=240)
    victim = job.worker_pids("node1")[0]
    fault_time = time.time()
    os.kill(victim, signal.SIGKILL)
    say(f"SIGKILL to node1's worker (pid {victim}) at step ~{args.kill_step}")
    second = ranks(job.wait_for(lambda s: s if s["generation"] == 1 else None, 60, "the failover"))
    say("etcd view after the failover (tm-launch ctl status):")
    print(_indent(job.ctl("status").stdout), flush=True)
    codes = job.wait(timeout=300)
    out = job.ctl("timeline", "--json")
    changes = json.loads(out.stdout)["generations"] if out.returncode == 0 else []
    parts = next((g["breakdown"] for g in changes if g["generation"] == 1), None)
    return _report(job, codes, fault_time, first, second, parts)


def ranks(status: dict) -> dict[str, list[int]]:
    """Node -> its ranks in the plan ``ctl status --json`` shows (nodes without ranks left out)."""
    return {n["id"]: n["ranks"] for n in status["nodes"] if n["ranks"]}


def processes(records, held: list[int], fault_time: float) -> tuple[list[int], list[int]]:
    """The training processes (pids in the step log) that ran ``held`` ranks before and after the fault."""
    before = sorted({pid for t, rank, step, g, pid in records if rank in held and t < fault_time})
    after = sorted({pid for t, rank, step, g, pid in records if rank in held and t > fault_time})
    return before, after


def breakdown_table(parts: dict, step_log_s: float | None) -> list[str]:
    """The downtime phase by phase, one column per node: each column adds up to its total."""
    nodes = sorted(parts["nodes"])
    who = {p["phase"]: p["node"] for p in parts["phases"]}
    notes = {
        "detect": f"{who['detect']} reported the failure" if who["detect"] else "",
        "plan": f"{who['plan']} published the plan" if who["plan"] else "",
    }

    def cell(seconds):
        return f"{'-' if seconds is None else f'{seconds:.3f}s':>9}"

    lines = [f"  {'by phase':<15}: {'':<13}" + "".join(f"{n:>9}" for n in nodes)]
    for phase in PHASES:
        row = "".join(cell(parts["nodes"][n]["phases"][phase]) for n in nodes)
        lines.append(f"  {'':<15}  {phase:<13}{row}   {notes.get(phase, '')}".rstrip())
    row = "".join(cell(parts["nodes"][n]["total_s"]) for n in nodes)
    last = f"{parts['critical_node']} resumed last" if parts["critical_node"] else "no node recorded its first step"
    measured = f"; step log: {step_log_s:.3f}s from the last step every rank logged" if step_log_s is not None else ""
    lines.append(f"  {'':<15}  {'total':<13}{row}   {last}{measured}")
    return lines


def _report(job: LocalJob, codes: dict, fault_time: float, first: dict, second: dict, parts: dict | None) -> int:
    events = job.events()
    records = job.step_records()
    d = downtime(records, fault_time)
    plan = next((e for e in events if e["kind"] == "plan" and e.get("generation") == 1), None)
    failed = next((e for e in events if e["kind"] in ("worker_failed", "node_lost") and e["time"] >= fault_time - 1), None)
    formed = next((e for e in events if e["kind"] == "plan" and e.get("generation") == 0), None)
    step0 = min((t for t, rank, step, g, pid in records if step == 0), default=None)
    cold = step0 - formed["time"] if formed and step0 else None
    ok = codes.get("node0") == 0 and codes.get("node2") == 0 and d["downtime_s"] is not None
    print()
    print("tm-launch demo: what happened")
    print(f"  job            : {'finished' if ok else 'FAILED'}; exit codes {codes}")
    print(f"  ranks          : generation 0: {_held(first)}; generation 1: {_held(second)}")
    if failed:
        print(f"  detected       : +{failed['time'] - fault_time:.3f}s  {failed['message']}")
    if plan:
        print(f"  new plan       : +{plan['time'] - fault_time:.3f}s  {plan['message']}")
    for e in events:
        if e["kind"] == "entered" and e.get("generation") == 1:
            print(f"  {e['node']:<15}: {e['message']}")
    if d["downtime_s"] is not None:
        print(
            f"  downtime       : {d['downtime_s']:.3f}s  (last step every rank finished before the fault, "
            f"{d['last_step_before']}, to step {d['first_step_after']} finished by every rank after it)"
        )
    if parts is not None:
        print("\n".join(breakdown_table(parts, d["downtime_s"])))
    print(f"  steps redone   : {d['steps_redone']}  (the interrupted step ran once more; nothing older)")
    for node in sorted(set(first) & set(second)):  # in both plans: a survivor
        before, after = processes(records, first[node], fault_time)
        kept = bool(before) and after == before
        print(
            f"  survivor {node:<6}: {'kept its process' if kept else 'process changed'} for rank(s) {first[node]} "
            f"(pid {before} before the fault, {after} after, from the step log)"
        )
    if cold is not None:
        print(
            f"  a restart      : >= {cold:.1f}s here just to start cold workers (process start -> first step, measured"
            " in this run),\n                   plus rendezvous and checkpoint reload (torchrun: see the README's Benchmarks)"
        )
    return 0 if ok else 1


def _held(held: dict[str, list[int]]) -> str:
    return ", ".join(f"{node} {r}" for node, r in sorted(held.items()))


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines())


if __name__ == "__main__":
    sys.exit(main())
