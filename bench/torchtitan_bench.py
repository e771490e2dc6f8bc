#!/usr/bin/env python3
"""torchtitan's own trainer after a worker SIGKILL: torchrun's restart against tm-launch's spare,
side by side in one run on loopback.

    .venv/bin/python bench/torchtitan_bench.py                  # --repeat 3: ~3-6 minutes on 2 cores
    .venv/bin/python bench/torchtitan_bench.py --repeat 1 --no-check
    .venv/bin/python bench/torchtitan_bench.py --steady --launchers torchrun,tm-live --steps 40   # no fault: the live step's overhead

The job is the e2e test's (``tests/e2e/test_torchtitan.py``): torchtitan 0.3.0's own trainer,
unchanged, through the CPU harness ``tests/titan_cpu/cpu_train.py``, training the tiny llama3 of
``tests/titan_cpu/tiny_llama3.py`` with FSDP over 2 ranks (2 nodes x 1 worker), offline tokenizer
and data (``tests/titan_cpu/offline_assets.py``), a DCP checkpoint every ``--ckpt-every`` steps,
a fixed seed and deterministic kernels. torchrun and tm-launch run torchtitan's own
``torchtitan.train`` and restart every worker, which resumes from torchtitan's last checkpoint;
tm-live runs the same arguments through ``tm_launch.torchtitan`` (live mode).

Launchers, alternating run by run (torchrun first in even rounds, tm-launch first in odd ones) so
that drifting background load hits both alike:
  torchrun   2 agents (``--nnodes 2 --nproc-per-node 1 --rdzv-backend c10d`` on loopback, node 0
             hosting the store), ``--max-restarts 1``, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
             (without it torch 2.13's restart with gloo reads the previous attempt's addresses:
             /work/shared/ARCHITECTURE.md): torchrun at its best. Its agents restart both workers
             in place.
  tm-launch  2 agents + 1 spare agent (``--nnodes 2 --nproc-per-node 1 --rdzv-backend etcd-v3``, the
             spare started once generation 0 is published), ``--max-restarts 1``, default mode
             (no ``--no-live``: what a user runs; the plan says why it restarts: torchtitan's loop
             does not enter the live loop). The spare takes the lost node's rank and every worker
             restarts.
  tm-live    as tm-launch, with ``python -m tm_launch.torchtitan`` in place of ``torchtitan.train``
             (the harness's ``TT_LIVE=1``): the spare warms up and parks before the kill (the
             benchmark waits for it), takes the lost rank's FSDP shards from its snapshot on the
             other node, and the survivor keeps its process.

The fault: once every rank completed step ``--kill-after`` (read from the harness's step log,
``TT_STEP_LOG``), the benchmark waits ``--fault-at`` of a median step (0.5: a fault that may come
at any time lands mid-step on average) and SIGKILLs the worker of rank ``--victim-rank``, whose pid
the step log gives; the fault time is taken right when the signal is sent. tm-launch's spare has
registered by then (the benchmark checks, torchtitan takes 10+ s to its first step).

Measures, per run, from the step log (``tm_launch.local.localjob.downtime``, bench/downtime.py's
definition): downtime, from the last step every rank completed before the fault to the first step
every rank completed after it, and the steps redone (completed by every rank before the fault and
run again: those since the last checkpoint). The time after the kill, split for both launchers
at the slowest new worker (every rank waits for it): ``kill -> workers started``, to the start of
the last new worker process (read from ``/proc/<pid>/stat`` while it runs, on CLOCK_BOOTTIME:
truncated to 10 ms), the launcher's part; ``-> torchtitan imported``, to torchtitan's first log
line (``torchtitan version``: Python, torch and torchtitan imported); ``-> checkpoint loaded``
(``Finished loading the checkpoint``: process group, mesh, model, FSDP, data loader and the
checkpoint); ``-> first step after``, every rank redoing the steps since that checkpoint and the
interrupted step. torchtitan's log lines carry local wall-clock times to the millisecond. For
tm-launch, its own part from the agents' ``--event-log``: ``kill -> failure reported`` (the
victim's agent's ``worker_failed`` event) and ``-> plan published`` (generation 1's ``plan`` event).

``--check`` (default on): one fault-free torchrun run first, the reference, and every fault run's
final torchtitan checkpoint compared with it bitwise (model, optimizer, LR scheduler, data loader
and train state; the e2e test's ``assert_same_state``).

Environment, the same for every launcher: ``OMP_NUM_THREADS=1`` (``--omp-threads``; 2 workers on
2 cores). Every process carries ``TM_BENCH_TAG`` (bench/downtime.py's hygiene): after each run,
on errors and on Ctrl-C every process still carrying it is SIGKILLed by pid.

Results: bench/results/torchtitan.md and torchtitan.json (git-ignored), the table also printed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import sys
import time
import uuid

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, REPO)
sys.path.append(BENCH)

import downtime as base  # noqa: E402  (bench/downtime.py: TorchrunJob, tagging, step-log arithmetic)

from tm_launch.local.localjob import LocalJob, downtime  # noqa: E402

HARNESS = os.path.join(REPO, "tests", "titan_cpu", "cpu_train.py")
TITAN_DIR = os.path.dirname(HARNESS)
LAUNCHERS = ("torchrun", "tm-launch", "tm-live")
say = base.say
sys.path.insert(0, TITAN_DIR)
from titan_job import final_state, titan_args  # noqa: E402  (the e2e test's job and checkpoint reader)

sys.path.remove(TITAN_DIR)


def build_assets(folder: str) -> dict[str, str]:
    """The offline tokenizer and data set, once per benchmark run."""
    sys.path.insert(0, TITAN_DIR)
    try:
        from offline_assets import build
        from tiny_llama3 import VOCAB
    finally:
        sys.path.remove(TITAN_DIR)
    return build(folder, VOCAB)


# -- checkpoints ---------------------------------------------------------------------------------------
def differences(state: dict, ref: dict) -> list[str]:
    """The keys whose values differ from the reference (empty: bitwise equal)."""
    import torch

    if state.keys() != ref.keys():
        return sorted(set(state) ^ set(ref))
    out = []
    for k, v in ref.items():
        if isinstance(v, torch.Tensor):
            if not torch.equal(state[k], v):
                out.append(k)
        elif state[k] != v:
            out.append(k)
    return out


# -- process start times -------------------------------------------------------------------------------
CLK = os.sysconf("SC_CLK_TCK")


def boot_time() -> float:
    """The wall-clock time of boot on the clock ``/proc/<pid>/stat`` counts start times on
    (CLOCK_BOOTTIME): ``btime`` in /proc/stat is whole seconds and was 0.12 s off here."""
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


def process_start(pid: int) -> float | None:
    """Wall-clock start of a running process (truncated to 1/CLK_TCK: up to 10 ms early); None
    once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return boot_time() + int(fields[19]) / CLK
    except (OSError, IndexError, ValueError):
        return None


# -- torchtitan's own log ---------------------------------------------------------------------------
TITAN_LINE = re.compile(r"\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) - \S+ - \S+ - (.*)")
MILESTONES = {"imported": "torchtitan version", "loaded": "Finished loading the checkpoint"}


def titan_milestones(log: str, after: float) -> dict[str, float]:
    """When one worker's torchtitan logged its first line (Python, torch and torchtitan
    imported) and finished loading the checkpoint, from torchtitan's own log lines (local time,
    ms resolution) later than ``after``."""
    out: dict[str, float] = {}
    for m in TITAN_LINE.finditer(log):
        t = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
        if t <= after:
            continue
        for name, text in MILESTONES.items():
            if name not in out and m.group(3).startswith(text):
                out[name] = t
    return out


# -- the benchmark -----------------------------------------------------------------------------------
class Bench:
    def __init__(self, args):
        self.args = args
        self.logdir = os.path.join(args.out_dir, "logs", "torchtitan")
        self.etcd = base.EtcdOnDemand()
        self.assets: dict[str, str] = {}
        self.reference: dict | None = None

    def close(self) -> None:
        base.reap()
        self.etcd.stop()

    def make_job(self, launcher: str, name: str, env: dict[str, str]) -> LocalJob:
        a = self.args
        workdir = os.path.join(self.logdir, name)
        shutil.rmtree(workdir, ignore_errors=True)
        os.makedirs(workdir)
        run_id = f"bench-titan-{name}-{uuid.uuid4().hex[:6]}"
        env = {base.TAG_VAR: base.TAG, **env}
        if a.omp_threads:
            env["OMP_NUM_THREADS"] = str(a.omp_threads)
        common = dict(run_id=run_id, workdir=workdir, nnodes="2", nproc=1, env=env, script=HARNESS)
        restarts = ["--max-restarts", str(a.max_restarts)]
        if launcher == "tm-live":
            env["TT_LIVE"] = "1"
        if launcher == "torchrun":
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
            from rendezvous.etcd_server import free_ports

            job = base.TorchrunJob(endpoint=f"127.0.0.1:{free_ports(1)[0]}", launcher_args=restarts, **common)
        else:
            job = LocalJob(endpoint=self.etcd.endpoint(), launcher_args=[*restarts, "--spares", "1"], **common)
        job.env["TT_STEP_LOG"] = job.step_log
        job.script_args = titan_args(
            self.assets, os.path.join(workdir, "titan"), a.steps, a.ckpt_every, seq_len=a.seq_len, local_batch_size=a.local_batch_size
        )
        return job

    # -- fault-free runs: the reference, the steady state ---------------------------------------------
    def clean_run(self, launcher: str, name: str, label: str, finish) -> dict:
        """One fault-free run on 2 nodes (no spare: a parked spare does nothing per step);
        ``finish(job, result)`` once it ended well. The median step leaves steps 1-2 out (the
        first steps' set-up)."""
        a = self.args
        t0 = time.time()
        job = self.make_job(launcher, name, {})
        result = {"launcher": launcher, "fault": None, "workdir": job.workdir, "load": os.getloadavg()[0]}
        try:
            job.start_all(["n0", "n1"])
            codes = result["exit_codes"] = job.wait(timeout=a.start_timeout + a.steps * 10)
            if any(codes.values()):
                raise RuntimeError(f"{label} failed: exit codes {codes}\n{job.logs_tail()}")
            records = job.step_records()
            result["step_time_s"] = base.median_step_time(records, first=2)
            result["first_step_s"] = min(t for t, _, s, _, _ in records if s == 1) - t0
            finish(job, result)
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001 - the other runs go on
            result["error"] = f"{type(e).__name__}: {e}"[:4000]
            say(f"{label}: ERROR {result['error'].splitlines()[0]}")
        finally:
            job.stop()
            result["orphans_reaped"] = base.reap()
            result["wall_s"] = time.time() - t0
        return result

    def reference_run(self) -> dict:
        """torchrun without a fault: the final checkpoint every fault run is compared with."""
        t0 = time.time()

        def finish(job, result):
            self.reference = final_state(os.path.join(job.workdir, "titan"), self.args.steps)
            say(f"reference: done in {time.time() - t0:.0f} s (first step {result['first_step_s']:.1f} s after the start)")

        say("reference: torchrun, no fault")
        return self.clean_run("torchrun", "reference", "reference", finish)

    def steady_run(self, launcher: str, repeat: int) -> dict:
        """``--steady``: one fault-free run, its median step."""
        label = f"steady {launcher} run {repeat + 1}"
        result = self.clean_run(
            launcher, f"steady-{launcher}-r{repeat}", label, lambda job, r: say(f"{label}: median step {r['step_time_s'] * 1000:.1f} ms")
        )
        return {**result, "repeat": repeat, "steady": True}

    # -- one fault run ----------------------------------------------------------------------------------
    def fault_run(self, launcher: str, repeat: int) -> dict:
        a = self.args
        t0 = time.time()
        job = self.make_job(launcher, f"{launcher}-r{repeat}", {})
        tm = launcher != "torchrun"
        if launcher == "tm-live":
            # the job holds after step 1 until its spare parked (warm-up included, it takes longer
            # to get ready than this short job takes to end); the kill comes many steps later
            job.env.update(TT_HOLD_STEP="1", TT_HOLD_UNTIL=os.path.join(job.workdir, "spare-parked"))
        result = {"launcher": launcher, "repeat": repeat, "workdir": job.workdir, "load": os.getloadavg()[0]}
        label = f"{launcher} run {repeat + 1}"
        try:
            say(f"{label}: starting (2 nodes x 1 worker{' + 1 spare' if tm else ''})")
            job.start_all(["n0", "n1"])
            if tm:
                job.wait_for(lambda s: s["generation"] is not None, a.start_timeout, "generation 0")
                job.start("s0")
                job.wait_for(
                    lambda s: any(n["id"] == "s0" and n["role"] == "spare" for n in s["nodes"]), a.start_timeout, "spare s0 to register"
                )
                if launcher == "tm-live":
                    job.wait_parked("s0", timeout=a.start_timeout)
                    open(job.env["TT_HOLD_UNTIL"], "w").close()
            result["spare_ready_s"] = time.time() - t0 if tm else None
            fault_time, pid = self.kill_mid_step(job, label)
            result.update(fault_time=fault_time, fault=f"kill -9 worker pid {pid} (rank {a.victim_rank})", killed_pid=pid)
            result["first_step_s"] = min(t for t, _, s, _, _ in job.step_records() if s == 1) - t0
            starts = self.wait_recovered(job, fault_time)
            if starts is None:
                result["recovered"] = False
                result["error"] = f"no step completed by every rank within {a.recover_timeout:.0f} s of the fault"
                result["log_tail"] = job.logs_tail(40)
                say(f"{label}: NOT recovered")
            else:
                result["recovered"] = True
                try:
                    result["exit_codes"] = job.wait(timeout=a.finish_timeout + a.steps * 5)
                except TimeoutError:
                    result["exit_codes"] = {n: node.proc.poll() for n, node in job.nodes.items()}
                    result["finish_timeout"] = True
                    result["log_tail"] = job.logs_tail(15)
                records = job.step_records()
                milestones = [titan_milestones(node.log(), fault_time) for node in job.nodes.values()]
                result.update(self.measure(records, fault_time, starts, milestones))
                if tm:
                    result.update(self.tm_phases(job, fault_time))
                say(
                    f"{label}: downtime {base.fmt_num(result.get('downtime_s'), '{:.2f}')} s, "
                    f"{result.get('steps_redone')} steps redone, kill -> workers started "
                    f"{base.fmt_num(result.get('kill_to_started_s'), '{:.2f}')} s"
                    + (
                        f" (failure reported {base.fmt_num(ms(result.get('kill_to_reported_s')), '{:.0f}')} ms, "
                        f"plan published {base.fmt_num(ms(result.get('reported_to_plan_s')), '{:.0f}')} ms later)"
                        if tm
                        else ""
                    )
                )
                if self.reference is not None and not result.get("finish_timeout"):
                    diff = differences(final_state(os.path.join(job.workdir, "titan"), a.steps), self.reference)
                    result["bitwise_equal"] = not diff
                    if diff:
                        result["differs"] = diff[:20]
                    say(f"{label}: final checkpoint {'bitwise equal to' if not diff else 'DIFFERS from'} torchrun's fault-free run")
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001 - one broken run must not lose the others
            base.record_failure(result, label, job, e)
        finally:
            if tm:
                result["events"] = [e for e in job.events() if e.get("kind") != "info"]
            job.stop()
            result["orphans_reaped"] = base.reap()
            result["wall_s"] = time.time() - t0
        return result

    def kill_mid_step(self, job: LocalJob, label: str) -> tuple[float, int]:
        """SIGKILL the victim rank's worker ``--fault-at`` of a median step after every rank
        completed step ``--kill-after``; returns the time of the signal and the pid."""
        a = self.args
        deadline = time.time() + a.start_timeout
        while time.time() < deadline:
            records = job.step_records()
            done = base.step_completion(records)
            if a.kill_after in done:
                first = min(t for t, _, s, _, _ in records if s == a.kill_after)
                length = base.median_step_time(records, first=1) or 0.1
                pid = max((t, p) for t, r, _, _, p in records if r == a.victim_rank)[1]
                time.sleep(max(0.0, first + a.fault_at * length - time.time()))
                t = time.time()
                os.kill(pid, signal.SIGKILL)
                say(f"{label}: killed rank {a.victim_rank}'s worker (pid {pid}) {time.time() - first:.2f} s after step {a.kill_after}")
                return t, pid
            if job.nodes and all(n.proc.poll() is not None for n in job.nodes.values()):
                break
            time.sleep(0.002)
        raise TimeoutError(f"step {a.kill_after} was not completed by every rank\n{job.logs_tail()}")

    def wait_recovered(self, job: LocalJob, fault_time: float) -> dict[int, float] | None:
        """Poll the step log until every rank completed a step after the fault; meanwhile read
        the start time of every worker process started after the fault while it runs (tm-live's
        spare started before). Returns pid -> start time."""
        deadline = time.time() + self.args.recover_timeout
        starts: dict[int, float] = {}
        old = {p for t, _, _, _, p in job.step_records() if t < fault_time}
        while time.time() < deadline:
            records = job.step_records()
            for pid in {p for t, _, _, _, p in records if t > fault_time and p not in old} - set(starts):
                start = process_start(pid)
                if start is not None and start > fault_time - 0.02:  # /proc's start time: 10 ms ticks
                    starts[pid] = start
            if downtime(records, fault_time)["first_step_after"] is not None:
                return starts
            if job.nodes and all(n.proc.poll() is not None for n in job.nodes.values()):
                return None
            time.sleep(0.05)
        return None

    def measure(self, records, fault_time: float, starts: dict[int, float], milestones: list[dict[str, float]]) -> dict:
        d = downtime(records, fault_time)
        out = dict(d)
        out["step_time_s"] = base.median_step_time([r for r in records if r[0] < fault_time], first=1)
        if d["downtime_s"] is None:
            return out
        out["before_fault_s"] = fault_time - d["last_step_at"]
        resumed_at = d["last_step_at"] + d["downtime_s"]
        new_ranks = {r: p for t, r, _, _, p in sorted(records) if t > fault_time and p in starts}
        out["new_workers"] = len(new_ranks)
        if len(new_ranks) == len({r for _, r, _, _, _ in records}):
            started = max(starts[p] for p in new_ranks.values())
            out["kill_to_started_s"] = started - fault_time
            out["started_to_resumed_s"] = resumed_at - started
            # of that: the new workers' first step (torchtitan's start and checkpoint load included)
            first_new = max(min(t for t, r, _, _, p in records if p == pid) for pid in new_ranks.values())
            out["started_to_first_step_s"] = first_new - started
            out["resume_step"] = min(s for t, _, s, _, p in records if p in starts)
            # and the slowest new worker's torchtitan milestones (each node's log holds one worker)
            at = started
            for name in MILESTONES:
                times = [m[name] for m in milestones if name in m]
                if len(times) == len(new_ranks):
                    out[f"to_{name}_s"] = max(times) - at
                    at = max(times)
            out["to_resumed_s"] = resumed_at - at
        return out

    @staticmethod
    def tm_phases(job: LocalJob, fault_time: float) -> dict:
        """tm-launch's own part from its agents' event logs: the fault -> the victim's agent
        reported the worker's failure -> generation 1's plan was published."""
        events = job.events()
        failed = next((e for e in events if e["kind"] == "worker_failed" and e["time"] >= fault_time), None)
        plan = next((e for e in events if e["kind"] == "plan" and e.get("generation") == 1), None)
        out = {}
        if failed:
            out["kill_to_reported_s"] = failed["time"] - fault_time
        if failed and plan:
            out["reported_to_plan_s"] = plan["time"] - failed["time"]
        if plan:
            out["kill_to_plan_s"] = plan["time"] - fault_time
            out["plan_live"] = plan.get("live")
            out["restart_why"] = plan.get("restart_why")
            out["replaced"] = plan.get("replaced")
        return out


def load_range(runs: list[dict]) -> str:
    loads = [r["load"] for r in runs if r.get("load") is not None]
    return f"{min(loads):.1f}-{max(loads):.1f}" if loads else "—"


def ms(x):
    return None if x is None else x * 1000


# -- reporting -------------------------------------------------------------------------------------------
FIELDS = (
    "downtime_s",
    "steps_redone",
    "before_fault_s",
    "kill_to_started_s",
    "started_to_resumed_s",
    "started_to_first_step_s",
    "to_imported_s",
    "to_loaded_s",
    "to_resumed_s",
    "kill_to_reported_s",
    "reported_to_plan_s",
    "kill_to_plan_s",
    "step_time_s",
    "first_step_s",
)


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    for launcher in LAUNCHERS:
        group = [r for r in runs if r["launcher"] == launcher and r.get("fault") is not None]
        if not group:
            continue
        ok = [r for r in group if r.get("recovered") and r.get("downtime_s") is not None]
        row = {"launcher": launcher, "runs": len(group), "failed": len(group) - len(ok)}
        for key in FIELDS:
            values = [r[key] for r in ok if r.get(key) is not None]
            row[key] = statistics.median(values) if values else None
            if key == "downtime_s":
                row["downtime_all_s"] = values
        checked = [r["bitwise_equal"] for r in group if "bitwise_equal" in r]
        row["bitwise_equal"] = f"{sum(checked)} of {len(checked)}" if checked else None
        rows.append(row)
    ref = next((r for r in rows if r["launcher"] == "torchrun"), None)
    for row in rows:
        row["ratio"] = ref["downtime_s"] / row["downtime_s"] if ref and ref.get("downtime_s") and row.get("downtime_s") else None
    return rows


def steady_markdown(runs: list[dict], args, meta) -> str:
    """Median step per launcher (the median of each run's median) and the overhead against torchrun."""
    medians = {}
    for launcher in args.launchers:
        values = [r["step_time_s"] for r in runs if r["launcher"] == launcher and r.get("step_time_s")]
        medians[launcher] = (statistics.median(values), values) if values else (None, values)
    ref = medians.get("torchrun", (None, []))[0]
    lines = ["| launcher | median step ms (runs) | against torchrun |", "|---|---|---|"]
    for launcher, (median, values) in medians.items():
        runs_text = ", ".join(f"{v * 1000:.1f}" for v in values)
        against = "ref" if launcher == "torchrun" else (f"{(median / ref - 1) * 100:+.1f}%" if median and ref else "—")
        lines.append(f"| {launcher} | {base.fmt_num(median * 1000 if median else None, '{:.1f}')} ({runs_text}) | {against} |")
    errors = [f"{r['launcher']} run {r['repeat'] + 1}: {r['error'].splitlines()[0][:200]}" for r in runs if r.get("error")]
    if errors:
        lines += ["", "Errors:"] + [f"- {e}" for e in errors]
    lines += [
        "",
        f"Setup: {meta['host_cpus']} CPU cores, torch {meta['torch']}, torchtitan {meta['torchtitan']} (CPU, gloo), loopback; "
        f"the fault runs' job without a fault or a spare: tiny llama3, FSDP over 2 ranks (2 nodes x 1 worker), "
        f"{args.local_batch_size} x {args.seq_len} tokens per rank and step, {args.steps} steps, "
        f"a DCP checkpoint every {args.ckpt_every} steps; step = time between consecutive steps completed by every rank, "
        f"steps 1-2 left out. {args.repeat} run(s) per launcher, alternating. Load average {meta['load_start']:.1f} at the "
        f"start, {load_range(runs)} per run, {meta['load_end']:.1f} at the end (the machine is shared).",
        f"Command: `{meta['command']}` (total {meta['total_s']:.0f} s)",
    ]
    return "\n".join(lines) + "\n"


def markdown(rows: list[dict], runs: list[dict], reference: dict | None, args, meta) -> str:
    f = base.fmt_num
    lines = [
        "| launcher | downtime s (runs) | steps redone | kill -> new workers started s | -> torchtitan imported s "
        "| -> checkpoint loaded s | -> first step after, every rank s | tm-launch: kill -> failure reported ms "
        "| -> plan published ms | final checkpoint bitwise = fault-free torchrun | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tm = r["launcher"] != "torchrun"
        runs_text = ", ".join(f"{v:.2f}" for v in r["downtime_all_s"])
        failed = f"; {r['failed']} of {r['runs']} failed" if r["failed"] else ""
        ratio = "1.0x (ref)" if r["launcher"] == "torchrun" else f(r["ratio"], "{:.2f}x")
        lines.append(
            f"| {r['launcher']} | {f(r['downtime_s'], '{:.2f}')} ({runs_text}{failed}) | {f(r['steps_redone'], '{:g}')} "
            f"| {f(r['kill_to_started_s'], '{:.2f}')} | {f(r['to_imported_s'], '{:.2f}')} | {f(r['to_loaded_s'], '{:.2f}')} "
            f"| {f(r['to_resumed_s'], '{:.2f}')} "
            f"| {f(ms(r['kill_to_reported_s']), '{:.0f}') if tm else 'n/a'} | {f(ms(r['reported_to_plan_s']), '{:.0f}') if tm else 'n/a'} "
            f"| {r['bitwise_equal'] or '—'} | {ratio} |"
        )
    notes = []
    for r in runs:
        name = "reference" if r.get("repeat") is None else f"{r['launcher']} run {r['repeat'] + 1}"
        if r.get("error"):
            notes.append(f"{name}: {r['error'].splitlines()[0][:200]}")
        elif r.get("finish_timeout"):
            notes.append(f"{name}: recovered, but the job did not end afterwards (stopped; exit codes {r.get('exit_codes')})")
        elif r.get("differs"):
            notes.append(f"{name}: final checkpoint differs from the reference in {', '.join(r['differs'][:5])}")
    if notes:
        lines += ["", "Notes:"] + [f"- {n}" for n in notes]
    steps = [r["step_time_s"] for r in rows if r.get("step_time_s")]
    firsts = [r["first_step_s"] for r in rows if r.get("first_step_s")]
    ref_text = (
        f"; fault-free torchrun reference: first step {reference['first_step_s']:.1f} s after the agents started"
        if reference and reference.get("first_step_s")
        else ""
    )
    lines += [
        "",
        "The columns after the steps redone split what follows the kill (each a median on its own, so they add up "
        "only roughly; the downtime also holds the part of the interrupted step done before the kill): the launcher "
        "starts new workers; they import Python, torch and torchtitan (torchtitan's first log line); torchtitan "
        "builds the process group, mesh, model and data loader and loads its last checkpoint ('Finished loading the "
        "checkpoint'); then every rank redoes the steps since that checkpoint and the interrupted step. tm-launch's "
        "own part, from its agents' event logs, is inside the first column. tm-live starts no worker: the parked "
        "spare and the survivor go on in their processes, so its columns between are empty.",
        "",
        f"Setup: {meta['host_cpus']} CPU cores, torch {meta['torch']}, torchtitan {meta['torchtitan']} (CPU, gloo), loopback. "
        f"torchtitan's trainer via tests/titan_cpu/cpu_train.py, tiny llama3, FSDP over 2 ranks (2 nodes x 1 worker), "
        f"{args.local_batch_size} x {args.seq_len} tokens per rank and step, {args.steps} steps, DCP checkpoint every {args.ckpt_every} steps, median step before the fault "
        f"{f(statistics.median(steps) * 1000 if steps else None, '{:.0f}')} ms, first step "
        f"{f(statistics.median(firsts) if firsts else None, '{:.1f}')} s after the agents started{ref_text}. "
        f"Rank {args.victim_rank}'s worker SIGKILLed {args.fault_at:g} of a step after step {args.kill_after}; "
        f"--max-restarts {args.max_restarts} for both; torchrun: c10d, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; "
        f"tm-launch and tm-live: etcd, 1 spare node. OMP_NUM_THREADS={args.omp_threads or 'unset'}. "
        f"Median over {args.repeat} run(s) per launcher, alternating. "
        f"Load average at the start of the benchmark: {meta['load_start']:.1f}, of each run: {load_range(runs)}, at the end: "
        f"{meta['load_end']:.1f} (the machine is shared).",
        f"Command: `{meta['command']}` (total {meta['total_s']:.0f} s)",
    ]
    return "\n".join(lines) + "\n"


# -- main ----------------------------------------------------------------------------------------------
def parse(argv=None):
    p = argparse.ArgumentParser(description="torchtitan after a worker SIGKILL: torchrun's restart against tm-launch with a spare.")
    p.add_argument("--repeat", type=int, default=3, help="fault runs per launcher, alternating; the table shows medians")
    p.add_argument("--steps", type=int, default=20, help="torchtitan's --training.steps")
    p.add_argument("--ckpt-every", type=int, default=5, help="torchtitan's --checkpoint.interval, the same for both launchers")
    p.add_argument("--seq-len", type=int, default=128, help="torchtitan's --training.seq-len (more: more compute per step)")
    p.add_argument("--local-batch-size", type=int, default=2, help="torchtitan's --training.local-batch-size")
    p.add_argument("--kill-after", type=int, default=12, help="the kill comes after every rank completed this step")
    p.add_argument("--fault-at", type=float, default=0.5, help="where in the next step the kill strikes, as a fraction of the median step")
    p.add_argument("--victim-rank", type=int, default=1, choices=(0, 1), help="the rank whose worker is killed")
    p.add_argument("--max-restarts", type=int, default=1)
    p.add_argument("--omp-threads", type=int, default=1, help="OMP_NUM_THREADS for every worker (0: leave unset)")
    p.add_argument("--launchers", default=",".join(LAUNCHERS), help="comma list of torchrun, tm-launch, tm-live")
    p.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a fault-free torchrun run first, and every final checkpoint compared with it bitwise",
    )
    p.add_argument(
        "--steady",
        action="store_true",
        help="no fault: fault-free runs per launcher, the median step against torchrun's (the live step's overhead)",
    )
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--recover-timeout", type=float, default=300)
    p.add_argument("--finish-timeout", type=float, default=60)
    p.add_argument("--out-dir", default=os.path.join(BENCH, "results"))
    args = p.parse_args(argv)
    args.launchers = [x.strip() for x in args.launchers.split(",") if x.strip()]
    for x in args.launchers:
        if x not in LAUNCHERS:
            p.error(f"--launchers: unknown launcher {x!r}")
    if not 0 < args.kill_after < args.steps:
        p.error("--kill-after must be within --steps")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    bench = Bench(args)
    started, load_start = time.time(), os.getloadavg()[0]
    reference = None
    plan = [(launcher, rep) for rep in range(args.repeat) for launcher in (args.launchers if rep % 2 == 0 else args.launchers[::-1])]
    say(f"{len(plan)} fault run(s){' + a fault-free reference' if args.check else ''}; logs under {os.path.relpath(bench.logdir)}")

    def before() -> None:
        nonlocal reference
        bench.assets = build_assets(os.path.join(bench.logdir, "assets"))
        if args.check and not args.steady:
            reference = bench.reference_run()

    def run_one(item):
        return bench.steady_run(*item) if args.steady else bench.fault_run(*item)

    runs, interrupted = base.run_all(bench, plan, run_one, before=before)
    import importlib.metadata

    meta = base.session_meta(
        base.command_line(__file__, argv),
        started,
        load_start,
        interrupted,
        torchtitan=importlib.metadata.version("torchtitan"),
        tag=base.TAG,
        runs_done=len(runs),
        runs_planned=len(plan),
    )
    name = "torchtitan-steady" if args.steady else "torchtitan"
    rows = [] if args.steady else summarize(runs)
    md = steady_markdown(runs, args, meta) if args.steady else markdown(rows, runs, reference, args, meta)
    base.write_results(args.out_dir, name, md, {"meta": meta, "config": vars(args), "rows": rows, "reference": reference, "runs": runs})
    failed = any(r.get("error") for r in runs) or any(r.get("bitwise_equal") is False for r in runs)
    return 130 if interrupted else (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
