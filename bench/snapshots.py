#!/usr/bin/env python3
"""What per-step snapshots cost and what they buy, as the state per rank grows.

    .venv/bin/python bench/snapshots.py --sizes 1,64,256 --repeat 3     # ~20-40 minutes on 2 cores
    .venv/bin/python bench/snapshots.py --nproc-per-node 1 --redundancy copy,parity2   # a copy against parity

Pure FSDP2 (``tests/scripts/hybrid.py --layout fsdp``) on 4 ranks (2 nodes x 2 workers, or 4
nodes x 1 with ``--nproc-per-node 1``), tm-launch live mode, the hybrid model widened
(``--width``) until each rank holds about SIZE MiB of state (its shards of the parameters and
of AdamW's two moments). For every size and every redundancy (``copy``: a whole copy on the
next node, the default; ``parityK``: ``--snapshot-parity K``, which needs more than K nodes):

* **overhead**: the median step time with ``--snapshot-every 1`` against the same job with
  ``--snapshot-every 0``, runs alternating (A B A B ...), the ratio pair by pair; and the bytes
  each node sent to its holders per step (``ctl status``: the workers' ``snapshot_sent``), and
  the host memory each node keeps for other nodes' ranks (``snapshot_held``: copies or stripes);
* **recovery**: with a parked spare, the worker holding rank 0 is SIGKILLed mid-step
  (``--fault-at`` of a step after the step log shows the fault step): the downtime (TrainMover's
  measure, ``tm_launch.local.localjob.downtime``), the recovery overhead (downtime minus the part
  of the step before the fault and one step, the interrupted step run again), the steps run
  again, and the bytes the joiner received for its snapshot (its log line: from the holder, or
  the parity's stripes and its group's other snapshots).

The side-by-side with torchrun's checkpoint restart of the same job is ``bench/downtime.py
--layout fsdp``. Results: bench/results/snapshots-<time>.md and .json (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
import uuid

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, REPO)

from rendezvous.etcd_server import EtcdServer  # noqa: E402
from tm_launch.local.localjob import LocalJob, downtime  # noqa: E402

HYBRID = os.path.join(REPO, "tests", "scripts", "hybrid.py")
WORLD = 4  # ranks (``--nproc-per-node`` of them per node)
D, DEPTH = 32, 2  # the hybrid model's width and depth (tests/scripts/hybrid.py)


def say(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def width_for(mib: float) -> int:
    """The hidden width at which each of WORLD ranks holds ``mib`` MiB of FSDP2 state: the
    parameters (depth blocks of d x h + h + h x d + d, the 16 x d input and d x 8 output layers)
    and AdamW's two moments, float32, sharded over the world."""
    per_h = DEPTH * (2 * D + 1)  # parameters per unit of width
    fixed = DEPTH * D + 16 * D + D + D * 8 + 8
    want = mib * 2**20 * WORLD / (3 * 4)  # parameters in the whole model
    return max(8, int((want - fixed) / per_h))


def step_times(records: list, since: int) -> list[float]:
    """Per step, the time from the slowest rank finishing the step before to the slowest rank
    finishing it (steps >= ``since``, one generation)."""
    done: dict[int, float] = {}
    for t, _, step, _, _ in records:
        done[step] = max(done.get(step, 0.0), t)
    steps = sorted(s for s in done if s >= since)
    return [done[b] - done[a] for a, b in zip(steps, steps[1:]) if b == a + 1]


class Bench:
    def __init__(self, args, etcd: str, workdir: str):
        self.args, self.etcd, self.workdir = args, etcd, workdir

    @property
    def nodes(self) -> list[str]:
        return [f"n{i}" for i in range(WORLD // self.args.nproc_per_node)]

    def job(self, name: str, mib: float, every: int, spare: bool, steps: int, extra=(), redundancy: str = "copy") -> LocalJob:
        parity = ["--snapshot-parity", redundancy.removeprefix("parity")] if redundancy.startswith("parity") else []
        job = LocalJob(
            endpoint=self.etcd,
            run_id=f"snap-{name}-{uuid.uuid4().hex[:6]}",
            workdir=os.path.join(self.workdir, name),
            nnodes=str(len(self.nodes)),
            nproc=self.args.nproc_per_node,
            script=HYBRID,
            launcher_args=["--max-restarts", "3", "--snapshot-every", str(every), *parity, *(["--spares", "1"] if spare else [])],
        )
        os.makedirs(job.workdir, exist_ok=True)
        job.env = {"OMP_NUM_THREADS": "1"}
        job.script_args = ["--layout", "fsdp", "--width", str(width_for(mib)), "--steps", str(steps), "--step-sleep",
                           str(self.args.step_sleep), "--step-log", job.step_log, *extra]  # fmt: skip
        return job

    def overhead_run(self, mib: float, every: int, i: int, redundancy: str = "copy") -> dict:
        job = self.job(f"o{mib}-{every}-{redundancy}-{i}", mib, every, spare=False, steps=self.args.warmup + self.args.steps,
                       redundancy=redundancy)  # fmt: skip
        try:
            job.start_all(self.nodes)
            per_step, held = self.sent_per_node_per_step(job)
            codes = job.wait(timeout=self.args.timeout)
            if any(codes.values()):
                raise RuntimeError(f"overhead run failed: {codes}\n{job.logs_tail()}")
            times = step_times(job.step_records(), self.args.warmup)
        finally:
            job.stop()
        return {"step_s": statistics.median(times), "sent_per_node_per_step": per_step, "held_per_node": held}

    def sent_per_node_per_step(self, job: LocalJob) -> tuple[float, float]:
        """Bytes a node's workers sent to their holders per step, and the most host memory a
        node keeps for other nodes' ranks, from one ``ctl status`` read
        half-way through the timed steps (the agents publish each worker's ``snapshot_sent`` and
        step with its progress while the job runs; once it ends nobody does). One read only:
        each ``ctl`` is a process of its own, and its CPU would be counted in the step times."""
        half = self.args.warmup + self.args.steps // 2
        while any(n.proc.poll() is None for n in job.nodes.values()):
            done = job.steps_done()
            if len(done) == WORLD and min(done.values()) >= half:
                try:
                    nodes = job.status()["nodes"]
                except RuntimeError:
                    return 0.0, 0.0
                workers = [w for n in nodes for w in (n["progress"] or {}).values()]
                steps = min((int(w.get("step") or 0) for w in workers), default=0)
                held = max((sum(int(w.get("snapshot_held") or 0) for w in (n["progress"] or {}).values()) for n in nodes), default=0)
                return (sum(int(w.get("snapshot_sent") or 0) for w in workers) / len(nodes) / steps if steps else 0.0), held
            time.sleep(0.2)
        return 0.0, 0.0

    def recovery_run(self, mib: float, i: int, redundancy: str = "copy") -> dict:
        a = self.args
        trigger = os.path.join(self.workdir, f"r{mib}-{redundancy}-{i}.release")
        job = self.job(f"r{mib}-{redundancy}-{i}", mib, 1, spare=True, steps=a.pause + a.fault_after + 15,
                       extra=("--pause-step", str(a.pause), "--pause-file", trigger), redundancy=redundancy)  # fmt: skip
        try:
            job.start_all(self.nodes)
            job.wait_for(lambda s: s["generation"] is not None, a.timeout, "generation 0")
            job.start("spare")
            job.wait_parked("spare", timeout=a.timeout)
            victim = next(n["id"] for n in job.status()["nodes"] if 0 in n["ranks"])
            pid = job.worker_pids(victim)[0]  # the worker holding rank 0 (local rank 0)
            open(trigger, "w").close()
            job.wait_step(a.pause + a.fault_after, timeout=a.timeout)
            step = statistics.median(step_times(job.step_records(), a.pause) or [0.05])
            time.sleep(a.fault_at * step)
            fault = time.time()
            os.kill(pid, signal.SIGKILL)
            codes = job.wait(timeout=a.timeout)
            d = downtime(job.step_records(), fault)
            after = step_times(job.step_records(), (d["first_step_after"] or 0) + 1)
            one = statistics.median(after or [step])
            text = "\n".join(n.log() for n in job.nodes.values())
            got = re.findall(r"received this rank's snapshot of step \d+ \([^,]+, ([\d.]+) (KiB|MiB)\)", text)
            got += re.findall(r"rebuilt this rank's snapshot of step \d+ \([^,]+, [\d.]+ \w+; ([\d.]+) (KiB|MiB) received\)", text)
            received = sum(float(v) * (2**10 if u == "KiB" else 2**20) for v, u in got)
            live = [c for n, c in codes.items() if n != victim]
            if any(live) or d["downtime_s"] is None:
                raise RuntimeError(f"recovery run failed: {codes}\n{job.logs_tail()}")
        finally:
            job.stop()
        return {"downtime_s": d["downtime_s"], "before_fault_s": fault - d["last_step_at"], "step_s": one,
                "overhead_s": d["downtime_s"] - (fault - d["last_step_at"]) - one, "redone": d["steps_redone"],
                "received_bytes": received}  # fmt: skip


def median(rows: list[dict], key: str):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1,64,256", help="MiB of state per rank, comma list")
    p.add_argument("--repeat", type=int, default=3, help="overhead pairs and recovery runs per size (medians)")
    p.add_argument("--steps", type=int, default=40, help="timed steps per overhead run")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.0, help="stand-in compute per step (s)")
    p.add_argument("--pause", type=int, default=10)
    p.add_argument("--fault-after", type=int, default=5)
    p.add_argument("--fault-at", type=float, default=0.5)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--no-recovery", action="store_true")
    p.add_argument("--nproc-per-node", type=int, choices=(1, 2, 4), default=2, help="workers per node (4 ranks in all)")
    p.add_argument("--redundancy", default="copy", help="comma list of copy and parityK (--snapshot-parity K)")
    args = p.parse_args(argv)
    sizes = [float(s) for s in args.sizes.split(",")]
    out = os.path.join(BENCH, "results")
    os.makedirs(out, exist_ok=True)
    results = []
    with EtcdServer() as etcd, tempfile.TemporaryDirectory(prefix="tm-bench-snap-") as workdir:
        bench = Bench(args, etcd.endpoint, workdir)
        modes = args.redundancy.split(",")
        for mib, mode in [(mib, mode) for mib in sizes for mode in modes]:
            pairs = []
            for i in range(args.repeat):
                on, off = bench.overhead_run(mib, 1, i, mode), bench.overhead_run(mib, 0, i)
                pairs.append({"on": on, "off": off, "ratio": on["step_s"] / off["step_s"]})
                say(f"{mib} MiB/rank {mode}, pair {i}: snapshots {on['step_s'] * 1000:.1f} ms, none {off['step_s'] * 1000:.1f} ms")
            rec = [] if args.no_recovery else [bench.recovery_run(mib, i, mode) for i in range(args.repeat)]
            row = {
                "mib_per_rank": mib, "width": width_for(mib), "redundancy": mode,
                "held_per_node_mib": statistics.median(p["on"]["held_per_node"] for p in pairs) / 2**20,
                "step_ms_snapshots": 1000 * statistics.median(p["on"]["step_s"] for p in pairs),
                "step_ms_none": 1000 * statistics.median(p["off"]["step_s"] for p in pairs),
                "overhead_pct": 100 * (statistics.median(p["ratio"] for p in pairs) - 1),
                "sent_per_node_per_step_mib": statistics.median(p["on"]["sent_per_node_per_step"] for p in pairs) / 2**20,
                "downtime_s": median(rec, "downtime_s"), "recovery_overhead_ms": (median(rec, "overhead_s") or 0) * 1000 if rec else None,
                "redone": median(rec, "redone"), "joiner_received_mib": (median(rec, "received_bytes") or 0) / 2**20 if rec else None,
                "runs": {"pairs": pairs, "recovery": rec},
            }  # fmt: skip
            results.append(row)
            say(json.dumps({k: v for k, v in row.items() if k != "runs"}))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    cmd = " ".join(["bench/snapshots.py", *(argv if argv is not None else sys.argv[1:])])
    lines = [
        f"Pure FSDP2, {len(bench.nodes)} nodes x {args.nproc_per_node} worker(s), tm-launch live; medians of {args.repeat}. "
        f"Command: `.venv/bin/python {cmd}`",
        "",
        "| state per rank | redundancy | step, snapshots every step | step, none | overhead | sent per node per step "
        "| kept for other nodes, per node | downtime | recovery overhead | steps run again | joiner received |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        rec = r["downtime_s"] is not None
        down = f"{r['downtime_s']:.3f} s" if rec else "-"
        over = f"{r['recovery_overhead_ms']:.0f} ms" if rec else "-"
        got = f"{r['joiner_received_mib']:.2f} MiB" if rec else "-"
        lines.append(
            f"| {r['mib_per_rank']:g} MiB | {r['redundancy']} | {r['step_ms_snapshots']:.1f} ms | {r['step_ms_none']:.1f} ms "
            f"| {r['overhead_pct']:+.1f} % | {r['sent_per_node_per_step_mib']:.2f} MiB | {r['held_per_node_mib']:.2f} MiB "
            f"| {down} | {over} | {r['redone'] if rec else '-'} | {got} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(out, f"snapshots-{stamp}.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, f"snapshots-{stamp}.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
