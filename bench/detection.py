#!/usr/bin/env python3
"""Detection latency per signal, and the NVML monitor's CPU cost per poll.

    .venv/bin/python bench/detection.py            # ~3 minutes on 2 cores

For each signal a real fault is injected into a live tm-launch job (2 active nodes x 1 worker and
a parked spare, agents on loopback around a private etcd) and three moments are read back from
the agents' event logs and the training script's step log:

    detected   the agent that saw the fault published it (failure report, alarm, hang kill)
    plan       the next generation's plan was published (the spare named)
    first step the replacement rank finished its first step

Signals: worker SIGKILL (process exit), agent SIGKILL (node loss: peers probe the dead agent's
port), fatal XID 79 from the scripted fake NVML (measured from the moment the NVML event wait
returned, i.e. the alarm's own timestamp, since the driver's XID posting time is not observable),
SIGSTOP hang (with --health-hang-timeout 2: the latency is that timeout plus the heartbeat
period) and a straggler 80% slower than its peers (5-step windows, 3 slow windows of 5).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from rendezvous.etcd_server import EtcdServer  # noqa: E402
from tm_launch.local.localjob import LocalJob  # noqa: E402


def say(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def first_event(job: LocalJob, kinds: tuple[str, ...], after: float, generation: int | None = None) -> dict | None:
    for e in job.events():
        if e["kind"] in kinds and e["time"] >= after and (generation is None or e.get("generation") == generation):
            return e
    return None


def first_step_of_new_process(job: LocalJob, fault: float) -> float | None:
    before = {pid for t, _, _, _, pid in job.step_records() if t < fault}
    return min((t for t, _, _, _, pid in job.step_records() if t > fault and pid not in before), default=None)


def run_case(
    endpoint: str, name: str, workdir: str, launcher=(), script=(), env_for=None, inject=None, spare_after=True, fault_step=20
) -> dict:
    nodes = ["a", "b", "d"] if name == "straggler" else ["a", "b"]
    job = LocalJob(
        endpoint=endpoint,
        run_id=f"det-{name}-{time.time_ns()}",
        workdir=os.path.join(workdir, name),
        nnodes=str(len(nodes)),
        nproc=1,
        launcher_args=["--max-restarts", "3", *launcher],
    )
    trigger = os.path.join(job.workdir, "go")
    job.script_args = [
        "--steps",
        "200",
        "--step-sleep",
        "0.05",
        "--step-log",
        job.step_log,
        "--pause-step",
        "10",
        "--pause-file",
        trigger,
        *script,
    ]
    try:
        for n in nodes:
            job.start(n, (env_for or {}).get(n))
            time.sleep(0.2)
        job.wait_for(lambda s: s["generation"] is not None, 180, "generation 0")
        job.start("c")
        job.wait_parked("c", timeout=240)
        open(trigger, "w").close()
        job.wait_step(fault_step, timeout=180)
        fault = inject(job) if inject else time.time()
        job.wait_for(lambda s: s["generation"] == 1, 180, f"{name}: the new generation")
        time.sleep(2)
        detected = first_event(job, ("culprit", "worker_failed", "node_lost", "alarm", "hang"), fault - 1)
        plan = first_event(job, ("plan",), fault - 1, generation=1)
        first = first_step_of_new_process(job, fault)
        if name == "xid" and detected:
            fault = detected["alarm"]["time"]  # when NVML's event wait returned
        return {
            "signal": name,
            "detected_s": detected["time"] - fault if detected else None,
            "plan_s": plan["time"] - fault if plan else None,
            "first_step_s": first - fault if first else None,
            "how": detected["message"] if detected else "",
        }
    finally:
        job.stop()


def poll_cost() -> dict:
    """CPU per batched poll of 8 fake GPUs with 18 NVLink links each (the production code path)."""
    from health.__main__ import measure_poll_cost
    from health.config import HealthConfig
    from health.nvml_monitor import NvmlMonitor
    from tests.doubles.fake_nvml import FakeNvml

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write("gpus: 8\ninit: {nvlinks: 18}\nevents: []\n")
    fake = FakeNvml.from_file(f.name) if hasattr(FakeNvml, "from_file") else FakeNvml(f.name)
    monitor = NvmlMonitor("bench", [str(i) for i in range(8)], HealthConfig(), lambda a: None, nvml=fake)
    monitor.start()
    try:
        return measure_poll_cost(monitor, 200)
    finally:
        monitor.stop()
        os.unlink(f.name)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--signals", default="worker,agent,xid,hang,straggler")
    args = p.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="tm-detect-")
    xid = os.path.join(workdir, "xid.yaml")
    busy = os.path.join(workdir, "busy")
    rows = []
    with EtcdServer(data_dir=os.path.join(workdir, "etcd")) as etcd:
        cases = {
            "worker": dict(inject=lambda j: (os.kill(j.worker_pids("b")[0], signal.SIGKILL), time.time())[1]),
            "agent": dict(inject=lambda j: (j.kill_agent("b"), time.time())[1]),
            "xid": dict(env_for={"b": {"TM_FAKE_NVML": xid}}, inject=lambda j: _xid(j, xid)),
            "hang": dict(
                launcher=["--health-hang-timeout", "2", "--health-hang-warmup-steps", "0"],
                inject=lambda j: (os.kill(j.worker_pids("b")[0], signal.SIGSTOP), time.time())[1],
            ),
            # C4: a worker stopped (SIGSTOP: no thread runs) or spinning in Python (its heartbeat
            # lives on), found from the collectives with the default health settings; and the same
            # stop with the collective watch off, left to the hang watchdog's defaults (60 s floor).
            "c4-stop": dict(inject=lambda j: (os.kill(j.worker_pids("b")[0], signal.SIGSTOP), time.time())[1]),
            "c4-busy": dict(
                script=[
                    "--kill-rank",
                    "1",
                    "--kill-step",
                    "20",
                    "--kill-how",
                    "busy",
                    "--kill-trigger",
                    busy,
                    "--kill-marker",
                    busy + ".fired",
                ],
                inject=lambda j: (open(busy, "w").close(), time.time())[1],
            ),
            "watchdog-stop": dict(
                launcher=["--health-collective-watch", "false"],
                # 25 steps after the pause: the paused step (as long as the spare's warm-up) has left the
                # watchdog's 20-step history, else its limit is 10x that step, not its 60 s floor
                fault_step=35,
                inject=lambda j: (os.kill(j.worker_pids("b")[0], signal.SIGSTOP), time.time())[1],
            ),
            "straggler": dict(
                launcher=["--health-straggler-window", "5"],
                script=["--slow-node", "b", "--slow-factor", "0.8"],
                inject=lambda j: time.time(),
            ),
        }
        for name in args.signals.split(","):
            if name == "xid":
                with open(xid, "w") as f:
                    f.write(f"gpus: 1\nevents:\n  - {{at: 0, after_file: {xid}.go, gpu: 0, xid: 79}}\n")
            say(f"{name}: starting")
            row = run_case(etcd.endpoint, name, workdir, **cases[name])
            say(f"{name}: detected +{row['detected_s']}s, plan +{row['plan_s']}s, first step +{row['first_step_s']}s")
            rows.append(row)
    cost = poll_cost()
    out = ["| signal | detected (s) | plan published (s) | replacement's first step (s) | how it was detected |", "|---|---|---|---|---|"]
    fmt = lambda x: "—" if x is None else f"{x:.3f}"  # noqa: E731
    for r in rows:
        out.append(f"| {r['signal']} | {fmt(r['detected_s'])} | {fmt(r['plan_s'])} | {fmt(r['first_step_s'])} | {r['how'][:90]} |")
    out.append("")
    out.append(
        f"NVML monitor: {cost['cpu_ms_per_poll']:.2f} ms CPU per batched poll of {cost['gpus']} fake GPUs "
        f"(18 NVLink links each), {100 * cost['cpu_share_of_one_core']:.3f}% of one core at a {cost['poll_interval']:.0f} s poll interval."
    )
    text = "\n".join(out)
    print(text)
    os.makedirs(os.path.join(REPO, "bench", "results"), exist_ok=True)
    with open(os.path.join(REPO, "bench", "results", "detection.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(REPO, "bench", "results", "detection.json"), "w") as f:
        json.dump({"rows": rows, "poll_cost": cost}, f, indent=2)
    return 0


def _xid(job: LocalJob, path: str) -> float:
    """Arm the fake NVML's XID 79 (its timeline waits for this file)."""
    open(path + ".go", "w").close()
    return time.time()


if __name__ == "__main__":
    sys.exit(main())
