#!/usr/bin/env python3
"""What the operator surface reports for a live failover, against the step log's ground truth.

    .venv/bin/python bench/ops_failover.py [--repeat 3] [--out timeline.png]

2 active nodes x 1 worker + 1 parked spare on loopback (``tm_launch.local.localjob``), every agent with
its own ``--metrics-port`` (PET_METRICS_PORT). Training is held until the spare is parked, then one
worker of node b gets an external SIGKILL a few steps later. Per run it prints three downtimes:

  step log   TrainMover's definition (``localjob.downtime``): last step every rank completed
             before the kill -> first step every rank completed after it (ground truth)
  timeline   ``ctl timeline --json``: first failure report -> workers entered the new generation
  metric     the spare's ``tm_launch_last_downtime_seconds`` (same span, seen by its agent)

plus how long ``ctl timeline --out`` took and the size of the per-node step series in etcd.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rendezvous.etcd_server import EtcdServer, free_ports  # noqa: E402
from tm_launch.local.localjob import LocalJob, downtime  # noqa: E402


def metric(port: int, name: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for family in text_string_to_metric_families(r.read().decode()):
            for s in family.samples:
                if s.name == name:
                    return s.value
    return None


def one_run(endpoint: str, workdir: str, png: str | None) -> dict:
    job = LocalJob(
        endpoint=endpoint,
        run_id=f"ops-{time.time_ns()}",
        workdir=workdir,
        nnodes="2",
        nproc=1,
        launcher_args=["--max-restarts", "3"],
        env={"OMP_NUM_THREADS": "1"},
    )
    trigger = os.path.join(workdir, "trigger")
    job.script_args = ["--steps", "200", "--step-sleep", "0.03", "--step-log", job.step_log, "--pause-step", "10", "--pause-file", trigger]
    ports = dict(zip("abc", free_ports(3)))
    try:
        for n in "ab":
            job.start(n, extra_env={"PET_METRICS_PORT": str(ports[n])})
            time.sleep(0.2)
        job.wait_for(lambda s: s["generation"] is not None, 120, "generation 0")
        job.start("c", extra_env={"PET_METRICS_PORT": str(ports["c"])})
        job.wait_parked("c")
        open(trigger, "w").close()
        job.wait_step(40)
        fault = time.time()
        job.kill_worker("b")
        deadline, seen = time.time() + 120, None
        while time.time() < deadline and seen is None:
            time.sleep(0.2)
            try:
                seen = metric(ports["c"], "tm_launch_last_downtime_seconds")
            except OSError:
                pass
        job.wait(timeout=240)
        t0 = time.time()
        out = job.ctl("timeline", "--json", *(["--out", png] if png else []), timeout=120)
        took = time.time() - t0
        if out.returncode != 0:
            raise RuntimeError(out.stderr)
        data = json.loads(out.stdout)
        g1 = next(g for g in data["generations"] if g["generation"] == 1)
        truth = downtime(job.step_records(), fault)
        from rendezvous.kv import EtcdOptions, connect
        from rendezvous.membership import run_prefix

        kv = connect("v3", EtcdOptions(endpoints=(endpoint,), prefix=run_prefix(job.run_id)))
        size = max(len(e.value) for e in kv.get_prefix("log/steps/"))
        return {
            "step_log_s": truth["downtime_s"],
            "timeline_s": g1["downtime_s"],
            "metric_s": seen,
            "kind": g1["kind"],
            "ctl_timeline_s": took,
            "series_bytes": size,
            "steps_redone": truth["steps_redone"],
        }
    finally:
        job.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--out", default=None, help="also draw the last run's timeline here")
    args = p.parse_args()
    rows = []
    with EtcdServer() as server, tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            png = args.out if i == args.repeat - 1 else None
            rows.append(one_run(server.endpoint, os.path.join(tmp, f"run{i}"), png))
            print(json.dumps(rows[-1]), flush=True)
    print(
        "\n| run | cause | step log downtime (s) | timeline downtime (s) | metric downtime (s) | steps redone | ctl timeline (s) | log/steps key (bytes) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        print(
            f"| {i + 1} | {r['kind']} | {r['step_log_s']:.3f} | {r['timeline_s']:.3f} | {r['metric_s']:.3f} | {r['steps_redone']} | {r['ctl_timeline_s']:.1f} | {r['series_bytes']} |"
        )
    if len(rows) > 1:
        med = {k: statistics.median(r[k] for r in rows) for k in ("step_log_s", "timeline_s", "metric_s")}
        print(f"| median | | {med['step_log_s']:.3f} | {med['timeline_s']:.3f} | {med['metric_s']:.3f} | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
