#!/usr/bin/env python3
"""What torch.compile costs a joiner, and a live recovery's downtime compiled against not.

    .venv/bin/python bench/compile_cost.py                            # ddp and torchtitan, compiled and not: 4 runs
    .venv/bin/python bench/compile_cost.py --modes compiled --victim-rank 0   # a spare taking another rank

The jobs are the compiled e2e tests' (``tests/e2e/test_exactness.py``'s compiled DDP case,
``tests/e2e/test_torchtitan.py``'s compiled FSDP2 case), each also run without the compile:

  ddp         ``tests/scripts/ordinary.py`` (``--compile``: ``torch.compile(DDP(model))``), 24 steps,
              every rank held at step 8 until the spare has parked, rank ``--victim-rank`` SIGKILLed in
              its backward of step 12
  torchtitan  torchtitan 0.3.0's trainer through ``tests/titan_cpu/cpu_train.py`` live
              (``tm_launch.torchtitan``; ``--compile.enable``: each transformer block compiled, then
              FSDP2, and the loss), the tiny llama3 with FSDP over 2 ranks, 10 steps, every rank held
              after step 2 until the spare has parked, rank ``--victim-rank`` SIGKILLed right after step 6

Both live: 2 nodes of 1 worker and a spare node, started once generation 0 is out; the spare warms
up as rank 1 in its sandbox (where it compiles) and parks. Inductor on the CPU, its cache under
``/tmp`` shared with earlier runs (as a user's second job meets it), ``OMP_NUM_THREADS=1``.

Read per run from the scripts' own per-step records (``tests/scripts/compile_records.py``: graphs,
Dynamo's compile seconds, each step's start and end; ``ordinary.py`` writes them with
``--compile`` only) and their step logs (``summarize``):

  warm-up              the spare's warm-up in its sandbox, from its first step's start to its last's
                       end, and the seconds Dynamo and inductor spent compiling in it
  script again         promoted to another rank than it warmed up as (``--victim-rank 0``): the
                       script run again for that rank, after the promotion, and what it compiled
  joiner's 1st step    the joiner's first step of the job, start to end, beside the survivor's same
                       step and the median step after it (both ranks)
  compiled after       what the joiner compiled after its promotion and the survivor after the
                       kill (seconds, graphs): 0 where the compile stayed off the critical path
  downtime             ``tm_launch.local.localjob.downtime``: from the last step every rank completed
                       before the kill to the first step every rank completed after it

Every process carries ``TM_BENCH_TAG`` (bench/downtime.py's hygiene: what is left is SIGKILLed by pid
after each run). The 1-minute load average is taken at each run's start and end and printed beside
its numbers: the machine is shared. Results: bench/results/compile_cost.md and .json (git-ignored).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
import uuid

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, REPO)
sys.path.append(BENCH)
sys.path.append(os.path.join(REPO, "tests", "scripts"))
sys.path.append(os.path.join(REPO, "tests", "titan_cpu"))

import downtime as base  # noqa: E402  (bench/downtime.py: etcd on demand, tagging, reaping)
from compile_records import by_process  # noqa: E402
from compile_records import read as read_records  # noqa: E402
from titan_job import titan_args  # noqa: E402  (the e2e test's torchtitan job)

from tm_launch.local.localjob import LocalJob, downtime  # noqa: E402

ORDINARY = os.path.join(REPO, "tests", "scripts", "ordinary.py")
HARNESS = os.path.join(REPO, "tests", "titan_cpu", "cpu_train.py")
SCRIPTS = ("ddp", "torchtitan")
say = base.say

DDP_STEPS, DDP_HOLD, DDP_KILL = 24, 8, 12  # test_exactness's
TITAN_STEPS, TITAN_HOLD, TITAN_KILL = 10, 2, 6  # test_torchtitan's steps and kill; the hold before it


# -- what a run's records say (pure) --------------------------------------------------------------------
def summarize(records: list[dict], kill_time: float) -> dict:
    """The joiner's and the survivor's compile costs from one run's per-step records (every
    process's, the victim's up to its kill). The joiner is the process whose first step was a
    sandbox step; its warm-up is the sandbox steps it ran as its first rank, and sandbox steps as
    another rank are the script run again after its promotion. A step's duration is its record's
    end minus its start; the survivor's "same step" is its last attempt of the joiner's first
    step (an interrupted attempt comes before it)."""
    procs = by_process(records)
    joiners = [rs for rs in procs.values() if rs[0]["sandbox"]]
    if len(joiners) != 1:
        raise ValueError(f"expected one process that warmed up in a sandbox, found {len(joiners)}")
    joiner = joiners[0]
    survivors = [rs for rs in procs.values() if not rs[0]["sandbox"] and rs[0]["start"] < kill_time < rs[-1]["end"]]
    warm = [r for r in joiner if r["sandbox"] and r["rank"] == joiner[0]["rank"]]
    again = [r for r in joiner if r["sandbox"] and r["rank"] != joiner[0]["rank"]]
    trained = [r for r in joiner if not r["sandbox"]]
    if not trained:
        raise ValueError("the joiner ran no step of the job")
    entered = (again or warm)[-1]  # its last step before it ran the job's
    first = trained[0]
    same = [r for rs in survivors for r in rs if r["step"] == first["step"]]
    after = [r["end"] - r["start"] for rs in [*survivors, trained] for r in rs if r["step"] > first["step"] and r["start"] > kill_time]
    before_kill = {id(rs): [r for r in rs if r["end"] < kill_time] for rs in survivors}
    return {
        "warmup_s": warm[-1]["end"] - warm[0]["start"],
        "warmup_compile_s": warm[-1]["compile_s"],
        "warmup_graphs": warm[-1]["graphs"],
        "again_s": (again[-1]["end"] - again[0]["start"]) if again else None,
        "again_compile_s": (again[-1]["compile_s"] - warm[-1]["compile_s"]) if again else None,
        "again_graphs": (again[-1]["graphs"] - warm[-1]["graphs"]) if again else None,
        "joiner_first_step": first["step"],
        "joiner_first_step_s": first["end"] - first["start"],
        "survivor_same_step_s": (same[-1]["end"] - same[-1]["start"]) if same else None,
        "median_step_after_s": statistics.median(after) if after else None,
        "joiner_compiled_after_s": trained[-1]["compile_s"] - entered["compile_s"],
        "joiner_graphs_after": trained[-1]["graphs"] - entered["graphs"],
        "survivor_compiled_after_s": sum(rs[-1]["compile_s"] - (before_kill[id(rs)] or rs[:1])[-1]["compile_s"] for rs in survivors),
        "survivor_graphs_after": sum(rs[-1]["graphs"] - (before_kill[id(rs)] or rs[:1])[-1]["graphs"] for rs in survivors),
    }


def fault_time(marker_mtime: float, step_records: list[tuple]) -> float:
    """When the victim died: its kill marker's mtime, but never before the victim's own last step
    record (a file's mtime comes from the kernel's coarse clock, up to a tick behind the step log's
    ``time.time()``; read alone it put a kill before the step the victim logged just ahead of it,
    and the downtime then ended at that step). The victim is the process whose last step is not
    the job's last."""
    last_step = max(step for _, _, step, _, _ in step_records)
    ends: dict[int, tuple[int, float]] = {}
    for t, _, step, _, pid in step_records:
        ends[pid] = max(ends.get(pid, (-1, 0.0)), (step, t))
    victims = [t for step, t in ends.values() if step < last_step]
    return max([marker_mtime, *victims])


# -- one run --------------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args):
        self.args = args
        self.logdir = os.path.join(args.out_dir, "logs", "compile_cost")
        self.etcd = base.EtcdOnDemand()
        self.assets: dict[str, str] | None = None

    def close(self) -> None:
        base.reap()
        self.etcd.stop()

    def titan_assets(self) -> dict[str, str]:
        if self.assets is None:
            from offline_assets import build
            from tiny_llama3 import VOCAB

            self.assets = build(os.path.join(self.logdir, "assets"), VOCAB)
        return self.assets

    def make_job(self, script: str, compiled: bool, name: str) -> tuple[LocalJob, str, str, str]:
        """(job, records file, kill marker, release file) for ``script``, compiled or not."""
        a = self.args
        workdir = os.path.join(self.logdir, name)
        shutil.rmtree(workdir, ignore_errors=True)
        os.makedirs(workdir)
        marker, go = os.path.join(workdir, "killed"), os.path.join(workdir, "release")
        job = LocalJob(
            endpoint=self.etcd.endpoint(),
            run_id=f"bench-compile-{name}-{uuid.uuid4().hex[:6]}",
            workdir=workdir,
            nnodes="2",
            nproc=1,
            env={base.TAG_VAR: base.TAG, "OMP_NUM_THREADS": "1"},
            launcher_args=["--max-restarts", "3"],
        )
        if script == "ddp":
            out = os.path.join(workdir, "out")
            job.script = ORDINARY
            job.script_args = ["--steps", str(DDP_STEPS), "--out", out, "--pause-step", str(DDP_HOLD), "--pause-file", go]
            job.script_args += ["--kill-rank", str(a.victim_rank), "--kill-step", str(DDP_KILL), "--kill-phase", "backward"]
            job.script_args += ["--kill-trigger", go, "--kill-marker", marker, "--step-log", job.step_log]
            job.script_args += ["--compile"] if compiled else []
            return job, os.path.join(out, "compile.jsonl"), marker, go
        records = os.path.join(workdir, "compile.jsonl")
        job.script = HARNESS
        steps = TITAN_STEPS
        job.script_args = titan_args(self.titan_assets(), os.path.join(workdir, "titan"), steps, steps)
        job.script_args += ["--compile.enable"] if compiled else []
        job.env.update(TT_LIVE="1", TT_STEP_LOG=job.step_log, TT_COMPILE_LOG=records, TT_HOLD_STEP=str(TITAN_HOLD), TT_HOLD_UNTIL=go)
        job.env.update(TT_KILL_RANK=str(a.victim_rank), TT_KILL_STEP=str(TITAN_KILL), TT_KILL_MARKER=marker)
        return job, records, marker, go

    def run(self, script: str, compiled: bool, repeat: int) -> dict:
        a = self.args
        label = f"{script} {'compiled' if compiled else 'eager'} run {repeat + 1}"
        name = f"{script}-{'compiled' if compiled else 'eager'}-r{repeat}"
        job, records_path, marker, go = self.make_job(script, compiled, name)
        result = {"script": script, "compiled": compiled, "repeat": repeat, "workdir": job.workdir, "load_start": os.getloadavg()[0]}
        t0 = time.time()
        say(f"{label}: starting (load {result['load_start']:.1f})")
        try:
            job.start_all(["n0", "n1"])
            job.wait_for(lambda s: s["generation"] is not None, a.start_timeout, "generation 0")
            spare_started = time.time()
            job.start("s0")
            job.wait_parked("s0", timeout=a.start_timeout)
            result["spare_parked_s"] = time.time() - spare_started
            open(go, "w").close()
            codes = result["exit_codes"] = job.wait(timeout=a.finish_timeout)
            if codes.get("s0") != 0 or sorted(codes.values()).count(0) != 2:
                raise RuntimeError(f"exit codes {codes}")
            kill_time = result["kill_time"] = fault_time(os.path.getmtime(marker), job.step_records())
            result.update(downtime(job.step_records(), kill_time))
            plans = [e for e in job.events() if e["kind"] == "plan" and e.get("generation") == 1]
            result["live"] = bool(plans) and plans[0]["live"]
            if os.path.exists(records_path):
                result.update(summarize(read_records(records_path), kill_time))
            say(f"{label}: downtime {fmt(result['downtime_s'])} s, {line(result)}")
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001 - the other runs go on
            base.record_failure(result, label, job, e)
        finally:
            job.stop()
            result["orphans_reaped"] = base.reap()
            result["wall_s"] = time.time() - t0
            result["load_end"] = os.getloadavg()[0]
        return result


def fmt(x, spec: str = "{:.2f}") -> str:
    return "n/a" if x is None else spec.format(x)


def line(r: dict) -> str:
    if "warmup_s" not in r:
        return "no per-step records (ordinary.py writes them with --compile only)"
    return (
        f"spare warm-up {fmt(r['warmup_s'], '{:.1f}')} s ({fmt(r['warmup_compile_s'], '{:.1f}')} s compiling, "
        f"{r['warmup_graphs']} graphs), joiner's first step {fmt(r['joiner_first_step_s'])} s, survivor's "
        f"{fmt(r['survivor_same_step_s'])} s, median after {fmt(r['median_step_after_s'], '{:.3f}')} s, compiled after the "
        f"promotion {fmt(r['joiner_compiled_after_s'])} s / {r['joiner_graphs_after']} graphs"
    )


COLUMNS = [
    ("script", lambda r: r["script"]),
    ("compile", lambda r: "torch.compile" if r["compiled"] else "eager"),
    ("run", lambda r: str(r["repeat"] + 1)),
    ("downtime s", lambda r: fmt(r.get("downtime_s"))),
    ("redone", lambda r: fmt(r.get("steps_redone"), "{}")),
    ("spare parked after s", lambda r: fmt(r.get("spare_parked_s"), "{:.1f}")),
    ("warm-up s (compiling)", lambda r: f"{fmt(r.get('warmup_s'), '{:.1f}')} ({fmt(r.get('warmup_compile_s'), '{:.1f}')})"),
    ("script again s (compiling)", lambda r: f"{fmt(r.get('again_s'), '{:.1f}')} ({fmt(r.get('again_compile_s'), '{:.1f}')})"),
    ("joiner's 1st step s", lambda r: fmt(r.get("joiner_first_step_s"), "{:.3f}")),
    ("survivor's same step s", lambda r: fmt(r.get("survivor_same_step_s"), "{:.3f}")),
    ("median step after s", lambda r: fmt(r.get("median_step_after_s"), "{:.3f}")),
    (
        "compiled after: joiner / survivor s",
        lambda r: f"{fmt(r.get('joiner_compiled_after_s'))} / {fmt(r.get('survivor_compiled_after_s'))}",
    ),
    ("load (start-end)", lambda r: f"{r['load_start']:.1f}-{r['load_end']:.1f}"),
]


def markdown(runs: list[dict], args, meta: dict) -> str:
    lines = ["| " + " | ".join(c for c, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in runs:
        if r.get("error"):
            lines.append(
                f"| {r['script']} | {'torch.compile' if r['compiled'] else 'eager'} | {r['repeat'] + 1} | error: {r['error'].splitlines()[0][:160]} |"
            )
        else:
            lines.append("| " + " | ".join(fn(r) for _, fn in COLUMNS) + " |")
    lines += [
        "",
        f"Setup: {meta['host_cpus']} CPU cores, torch {meta['torch']} (CPU, gloo, inductor), loopback; live, 2 nodes x 1 worker "
        f"and a spare warmed up as rank 1; rank {args.victim_rank} SIGKILLed (ddp: in its backward of step {DDP_KILL}; torchtitan: "
        f"right after step {TITAN_KILL}); OMP_NUM_THREADS=1. Load average at the start: {meta['load_start']:.1f}, at the end: "
        f"{meta['load_end']:.1f} (the machine is shared).",
        f"Command: `{meta['command']}` (total {meta['total_s']:.0f} s)",
    ]
    return "\n".join(lines) + "\n"


def parse(argv=None):
    p = argparse.ArgumentParser(description="What torch.compile costs a joiner; live downtime compiled against not.")
    p.add_argument("--scripts", default=",".join(SCRIPTS), help=f"comma list of {', '.join(SCRIPTS)}")
    p.add_argument("--repeat", type=int, default=1, help="runs per script and mode, compiled and eager alternating")
    p.add_argument("--modes", default="eager,compiled", help="comma list of eager, compiled")
    p.add_argument("--victim-rank", type=int, default=1, choices=(0, 1), help="0: the spare (warmed up as rank 1) takes another rank")
    p.add_argument("--start-timeout", type=float, default=900, help="seconds to generation 0 and to the spare's park (compiles)")
    p.add_argument("--finish-timeout", type=float, default=600)
    p.add_argument("--out-dir", default=os.path.join(BENCH, "results"))
    args = p.parse_args(argv)
    args.scripts = [x.strip() for x in args.scripts.split(",") if x.strip()]
    for x in args.scripts:
        if x not in SCRIPTS:
            p.error(f"--scripts: unknown script {x!r}")
    modes = [x.strip() for x in args.modes.split(",") if x.strip()]
    if not modes or set(modes) - {"eager", "compiled"}:
        p.error(f"--modes: eager and/or compiled, not {args.modes!r}")
    args.compiled = [m == "compiled" for m in ("eager", "compiled") if m in modes]
    return args


def main(argv=None) -> int:
    args = parse(argv)
    bench = Bench(args)
    started, load_start = time.time(), os.getloadavg()[0]
    plan = [
        (s, c, rep) for rep in range(args.repeat) for s in args.scripts for c in (args.compiled if rep % 2 == 0 else args.compiled[::-1])
    ]
    runs, interrupted = base.run_all(bench, plan, lambda item: bench.run(*item))
    meta = base.session_meta(base.command_line(__file__, argv), started, load_start, interrupted)
    base.write_results(args.out_dir, "compile_cost", markdown(runs, args, meta), {"meta": meta, "config": vars(args), "runs": runs})
    return 130 if interrupted else (1 if any(r.get("error") for r in runs) else 0)


if __name__ == "__main__":
    sys.exit(main())
