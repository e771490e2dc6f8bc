#!/usr/bin/env python3
"""Downtime and overhead of tm-launch against torchrun, measured in one run on loopback.

    .venv/bin/python bench/downtime.py --quick          # ~2-3 minutes
    .venv/bin/python bench/downtime.py --repeat 1 --sizes 2,4,8

Every run starts real launcher agents as separate processes (``tm_launch.local.localjob``), holds
training at ``--pause-step`` until everything is ready (tm-launch: the spare is parked), releases
it, injects a real fault a few steps later and reads the training script's step log.

Downtime is TrainMover's definition (``tm_launch.local.localjob.downtime``): from the last step every
rank completed before the fault to the first step every rank completed after it. Steps redone are
steps that had been completed by every rank before the fault and were run again. The fault time
is taken right when the signal is sent. It strikes ``--fault-at`` of a step (default 0.5) after the
step log shows step pause + fault-after: a fault that can come at any time lands mid-step on
average, and that part of the interrupted step, lost whatever the launcher, is its own column
(``before_fault``) beside the agents' phases. (The benchmark used to poll the log every 50 ms and
look the victim's pids up afterwards, so its faults landed 45-68 ms into a 54 ms step.)

Cases
  worker-sigkill  external ``kill -9`` of one worker process of the victim node (``--victim``:
                  tm-launch's node holding rank 0 by default; torchrun's n1)
  worker-sigstop  external ``kill -STOP`` of the same worker: a hung process. tm-live finds it from
                  the collectives (C4, ``health/culprit.py``); ``tm-watchdog`` is tm-live with that
                  off (``--health-collective-watch false``): the hang watchdog's defaults (60 s
                  floor); torchrun has no hang detection (gloo's collective timeout: 30 min)
  node-sigkill    ``kill -9`` of the victim's agent; its workers die with it (tm-launch: PDEATHSIG;
                  torchrun's workers live in their own sessions, so the benchmark kills them too)
  drain           ``tm-launch ctl drain <victim>`` (planned). torchrun has no drain: n/a. Training goes
                  on during the drain's prepare phase, so the fault time is the start of the stall
                  (the longest gap in the step log after the request), not the request itself.
  overhead        no fault: median step time, tm-launch live (job.steps()/job.group over LiveGroup)
                  against torchrun (plain DDP over WORLD), same script and world size.

Launchers
  torchrun        ``torchrun --rdzv-backend c10d --max-restarts 3``, checkpoint every 10 steps and
                  resume from it. Fixed ``--nnodes N`` cannot lose a node for good, so for
                  node-sigkill a standby torchrun agent joins first (c10d keeps it in its
                  redundancy list and promotes it on the next round).
  tm-restart      tm-launch ``--no-live`` with one spare node, same checkpointing.
  tm-live         tm-launch live mode with one spare node (parked), no checkpoint.
  tm-watchdog     tm-live with ``--health-collective-watch false`` (worker-sigstop only).

Scripts: ``tests/scripts/train.py`` (DDP) by default; ``--layout ddp-tp|hsdp|pp|fsdp-tp|fsdp|zero``
runs ``tests/scripts/hybrid.py`` instead (4 ranks = 2 nodes x 2 workers; the worker killed holds
rank 2). Layouts without replicas (fsdp-tp, fsdp, zero's optimizer partitions) recover live from
the in-memory snapshots (``--snapshot-every``, default every step); torchrun and tm-restart
restart from the DCP checkpoint (``--ckpt-every``). ``--script-args`` passes more arguments to the
script under every launcher (``'--device cuda --backend gloo'``: a GPU job; ``'--width 20000'``:
a bigger hybrid model).

World sizes: 2 ranks = 2 nodes x 1 worker (torchrun's anchor layout); N > 2 = N/2 nodes x 2
workers. The size sweep runs worker-sigkill for torchrun and tm-live; the other cases run at the
smallest size with all launchers.

Environment, the same for every launcher: OMP_NUM_THREADS=1 (``--omp-threads``; otherwise
torch's spinning OpenMP threads saturate 2 cores). torchrun runs with
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (``--torchrun-shared-store`` to keep torch's default):
with the shared store, torch 2.13 restarts read the previous attempt's gloo addresses and often
hang, and a standby never gets through its first round.

Every process the benchmark starts carries ``TM_BENCH_TAG=<unique id>`` in its environment
(inherited by every worker); after each run, on errors and on Ctrl-C/SIGTERM, every process
still carrying this run's tag is SIGKILLed by pid, so no orphans are left (torchrun's workers do
not die with their agent).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, REPO)

from rendezvous.etcd_server import free_ports  # noqa: E402
from tm_launch.local.localjob import LocalJob, Node, downtime  # noqa: E402

HYBRID = os.path.join(REPO, "tests", "scripts", "hybrid.py")

TAG_VAR = "TM_BENCH_TAG"
TAG = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
CASES = ("worker-sigkill", "worker-sigstop", "node-sigkill", "drain", "overhead")
LAUNCHERS = ("torchrun", "tm-restart", "tm-live", "tm-watchdog")
VICTIMS = ("first", "last", "n1")  # --victim: which node loses a worker / dies / is drained


def victim_node(choice: str, job, nodes: int) -> str:
    """The node the fault hits. tm-launch: ``first`` is the node holding rank 0 and ``last`` the
    node holding the highest ranks, read from the plan (group ranks follow join order, not node
    names). A spare warms up as the last node's ranks (``runtime``): replacing the last node needs
    no second set-up; replacing any other node runs the script again for the ranks taken, so
    ``first`` is the general case. torchrun: always n1 (n0 hosts its store, and its cold restart
    costs the same whichever node fails); ``n1`` names that node for tm-launch as well."""
    if choice == "n1" or isinstance(job, TorchrunJob):
        return "n1"
    active = [n for n in job.status()["nodes"] if n["role"] in ("active", "draining") and n["ranks"]]
    by_rank = sorted(active, key=lambda n: min(n["ranks"]))
    if len(by_rank) != nodes:
        raise RuntimeError(f"expected {nodes} active nodes in the plan, found {[n['id'] for n in by_rank]}")
    return (by_rank[0] if choice == "first" else by_rank[-1])["id"]


def say(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def record_failure(result: dict, label: str, job, e: Exception) -> None:
    """A run that broke: its error, said once, and its agents' log tails (the other runs go on)."""
    result["recovered"] = False
    result["error"] = f"{type(e).__name__}: {e}"[:4000]
    say(f"{label}: ERROR {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    try:
        result["log_tail"] = job.logs_tail(40)
    except OSError:
        pass


# -- process hygiene --------------------------------------------------------------------------------
def tagged_pids() -> list[int]:
    needle = f"{TAG_VAR}={TAG}".encode()
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(d))
        except OSError:
            continue
    return pids


def reap(wait: float = 5.0) -> int:
    """SIGKILL every process that still carries this benchmark's tag; returns how many."""
    killed = 0
    deadline = time.time() + wait
    while True:
        pids = tagged_pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        if not pids or time.time() > deadline:
            return killed
        time.sleep(0.1)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


# -- one benchmark session: its runs, its record --------------------------------------------------------
def command_line(script: str, argv) -> str:
    """The command that ran ``script`` (a bench file) with ``argv``, as the results quote it."""
    return shlex.join([".venv/bin/python", os.path.relpath(os.path.abspath(script), REPO), *(sys.argv[1:] if argv is None else argv)])


def run_all(bench, plan: list, run_one, before=None) -> tuple[list[dict], bool]:
    """``run_one(item)`` for each item of ``plan`` (after ``before()``, when given) on a fresh
    ``bench.logdir``; Ctrl-C, SIGTERM and SIGHUP stop the runs, and ``bench.close()`` (the
    clean-up of every job left) runs to its end whatever happened: a second Ctrl-C must not cut
    it short. Returns (the runs' records, interrupted)."""
    import shutil

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    shutil.rmtree(bench.logdir, ignore_errors=True)
    os.makedirs(bench.logdir)
    runs: list[dict] = []
    interrupted = False
    try:
        if before is not None:
            before()
        for item in plan:
            runs.append(run_one(item))
    except KeyboardInterrupt:
        interrupted = True
        say("interrupted: cleaning up")
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        bench.close()
    return runs, interrupted


def session_meta(command: str, started: float, load_start: float, interrupted: bool, **more) -> dict:
    """What every result file says of its session: the command, how long, the load, the host."""
    import torch

    return {
        "command": command,
        "total_s": time.time() - started,
        "load_start": load_start,
        "load_end": os.getloadavg()[0],
        "host_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "started": started,
        "interrupted": interrupted,
        **more,
    }


def write_results(out_dir: str, name: str, md: str, record: dict) -> None:
    """``<name>.md`` (the table) and ``<name>.json`` (``record``: every run's numbers) under
    ``out_dir``; the table is printed too."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(record, f, indent=1, default=str)
    print(md, flush=True)
    say(f"wrote {os.path.relpath(os.path.join(out_dir, name + '.md'))} and {name}.json ({record['meta']['total_s']:.0f} s)")


# -- jobs ---------------------------------------------------------------------------------------------
class TorchrunJob(LocalJob):
    """The same harness around plain torchrun agents (c10d rendezvous on loopback)."""

    def start(self, name: str, extra_env: dict[str, str] | None = None) -> Node:
        os.makedirs(self.workdir, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            self.nnodes,
            "--nproc-per-node",
            str(self.nproc),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            self.endpoint,
            "--rdzv-id",
            self.run_id,
            *self.launcher_args,
            self.script,
            *self.script_args,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env, **(extra_env or {})}
        log_path = os.path.join(self.workdir, f"{name}.log")
        proc = subprocess.Popen(cmd, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        node = Node(name, proc, log_path)
        self.nodes[name] = node
        return node

    def start_all(self, names: list[str], gap: float = 0.2) -> None:
        """Node 0 first, and the others once its c10d store listens: node 0 hosts the store, as on
        a real cluster where the endpoint names node 0 (on loopback every agent would match)."""
        first, *rest = names
        self.start(first)
        host, port = self.endpoint.rsplit(":", 1)
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                socket.create_connection((host, int(port)), timeout=0.5).close()
                break
            except OSError:
                if self.nodes[first].proc.poll() is not None:
                    raise RuntimeError(f"torchrun agent {first} exited early\n{self.logs_tail()}") from None
                time.sleep(0.1)
        super().start_all(rest, gap)

    def standby_waiting(self) -> bool:
        """True once c10d's rendezvous state lists a node in its redundancy list (a standby)."""
        import base64
        import datetime
        import pickle

        import torch.distributed as dist

        host, port = self.endpoint.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)
        key = "torch.rendezvous." + self.run_id
        if not store.check([key]):
            return False
        state = pickle.loads(base64.b64decode(store.get(key)))
        return bool(getattr(state, "redundancy_list", None))

    def stop(self) -> None:
        for node in self.nodes.values():
            if node.proc.poll() is None:
                for pid in self.worker_pids(node.name):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        super().stop()


class CpuSampler:
    """CPU seconds used by a job's agents and workers (last reading of each process before it exits)."""

    CLK = os.sysconf("SC_CLK_TCK")

    def __init__(self, job: LocalJob):
        self.job = job
        self.agents: dict[int, float] = {}
        self.workers: dict[int, float] = {}

    @classmethod
    def cpu(cls, pid: int) -> float | None:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / cls.CLK
        except (OSError, IndexError, ValueError):
            return None

    def sample(self) -> None:
        for node in self.job.nodes.values():
            pid = node.proc.pid
            c = self.cpu(pid)
            if c is not None:
                self.agents[pid] = c
            try:
                with open(f"/proc/{pid}/task/{pid}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except OSError:
                kids = []
            for k in kids:
                c = self.cpu(k)
                if c is not None:
                    self.workers[k] = c

    def totals(self) -> tuple[float, float]:
        return sum(self.agents.values()), sum(self.workers.values())


@dataclass
class Spec:
    case: str
    size: int
    launcher: str
    repeat: int = 0

    @property
    def layout(self) -> tuple[int, int]:
        return (2, 1) if self.size <= 2 else (self.size // 2, 2)

    @property
    def label(self) -> str:
        return f"{self.launcher} {self.case} {self.size} ranks"

    @property
    def name(self) -> str:
        return f"{self.case}-{self.size}-{self.launcher}-r{self.repeat}"


class EtcdOnDemand:
    """One etcd server for a benchmark's tm-launch runs, started by the first run that needs it
    (a torchrun-only benchmark starts none)."""

    def __init__(self):
        self._server = None

    def endpoint(self) -> str:
        if self._server is None:
            from rendezvous.etcd_server import EtcdServer

            self._server = EtcdServer().start()
        return self._server.endpoint

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


class Bench:
    def __init__(self, args):
        self.args = args
        self.etcd = EtcdOnDemand()
        self.logdir = os.path.join(args.out_dir, "logs")
        self.current: LocalJob | None = None

    def close(self) -> None:
        if self.current is not None:
            self.current.stop()
            self.current = None
        reap()
        self.etcd.stop()

    # -- building jobs ----------------------------------------------------------------------------
    def make_job(self, spec: Spec, script_args: list[str], spare: bool) -> LocalJob:
        nodes, nproc = spec.layout
        workdir = os.path.join(self.logdir, spec.name)
        os.makedirs(workdir, exist_ok=True)
        run_id = f"bench-{spec.name}-{uuid.uuid4().hex[:6]}"
        env = {TAG_VAR: TAG}
        if self.args.omp_threads:
            # 2 ranks per 2 cores: torch's OpenMP threads spin between ops and starve everything
            # else (torchrun sets this itself only for --nproc-per-node > 1); same for every launcher
            env["OMP_NUM_THREADS"] = str(self.args.omp_threads)
        common = dict(run_id=run_id, workdir=workdir, nnodes=str(nodes), nproc=nproc, env=env)
        if spec.launcher == "torchrun":
            if not self.args.torchrun_shared_store:
                # torch 2.13 shares the rendezvous TCPStore with the workers and does not prefix
                # it per restart: restarted workers can read the previous attempt's gloo
                # addresses (connect refused or a hang; pytorch issue 135712), and a standby
                # joining a later round waits for a MASTER_ADDR rank 0 wrote only in its first
                # round. torch's documented opt-out gives torchrun its best chance.
                env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
            job = TorchrunJob(endpoint=f"127.0.0.1:{free_ports(1)[0]}", launcher_args=["--max-restarts", "3"], **common)
        else:
            launcher_args = ["--max-restarts", "3"]
            if spare:
                launcher_args += ["--spares", "1"]
            if spec.launcher == "tm-restart":
                launcher_args.append("--no-live")
            elif spec.launcher == "tm-watchdog":  # live, stuck collectives left to the hang watchdog's defaults
                launcher_args += ["--health-collective-watch", "false", "--snapshot-every", str(self.args.snapshot_every)]
            else:
                launcher_args += ["--snapshot-every", str(self.args.snapshot_every)]
            job = LocalJob(endpoint=self.etcd.endpoint(), launcher_args=launcher_args, **common)
        if self.args.layout:
            job.script = HYBRID
            script_args = ["--layout", self.args.layout, *script_args]
        job.script_args = [*script_args, *shlex.split(self.args.script_args), "--step-log", job.step_log]
        if os.path.exists(job.step_log):
            os.remove(job.step_log)
        self.current = job
        return job

    # -- one fault run ----------------------------------------------------------------------------
    def fault_run(self, spec: Spec) -> dict:
        a = self.args
        nodes, nproc = spec.layout
        workdir = os.path.join(self.logdir, spec.name)
        trigger = os.path.join(workdir, "release")
        pause, fault_step = a.pause_step, a.pause_step + a.fault_after
        script = ["--steps", str(a.steps), "--step-sleep", str(a.step_sleep), "--pause-step", str(pause), "--pause-file", trigger]
        if spec.launcher in ("torchrun", "tm-restart"):
            script += ["--ckpt-dir", os.path.join(workdir, "ckpt"), "--ckpt-every", str(a.ckpt_every)]
        tm = spec.launcher != "torchrun"
        standby = spec.launcher == "torchrun" and spec.case == "node-sigkill"
        result = {
            "case": spec.case,
            "size": spec.size,
            "launcher": spec.launcher,
            "repeat": spec.repeat,
            "nodes": nodes,
            "nproc": nproc,
            "spare": tm or standby,
            "workdir": workdir,
            "load": os.getloadavg()[0],
        }
        t0 = time.time()
        job = self.make_job(spec, script, spare=tm)
        actives = [f"n{i}" for i in range(nodes)]
        try:
            say(f"{spec.label}: starting ({nodes} node(s) x {nproc} worker(s){' + 1 spare' if tm else ' + 1 standby' if standby else ''})")
            job.start_all(actives)
            if tm:
                job.wait_for(lambda s: s["generation"] is not None, a.start_timeout, "generation 0")
            self.wait_all_ranks(job, pause - 1, nodes * nproc, a.start_timeout)
            if tm:
                job.start("s0")
                if spec.launcher in ("tm-live", "tm-watchdog"):
                    job.wait_parked("s0", timeout=a.start_timeout)
                else:
                    job.wait_for(
                        lambda s: any(n["id"] == "s0" and n["role"] == "spare" for n in s["nodes"]), a.start_timeout, "spare s0 to register"
                    )
            elif standby:
                job.start("s0")
                self.wait_standby(job, a.start_timeout)
            result["ready_s"] = time.time() - t0
            victim = result["victim"] = victim_node(a.victim, job, nodes)  # before the release: `ctl status` takes a while
            targets = self.victim_pids(job, spec, victim)  # ahead: pgrep takes tens of ms
            open(trigger, "w").close()
            if spec.case == "drain":
                job.wait_step(fault_step, timeout=a.start_timeout)
            else:
                self.wait_fault_moment(job, fault_step, a.start_timeout)
            fault_time, how = self.inject(job, spec, victim, targets)
            result["fault_time"] = fault_time
            result["fault"] = how
            say(f"{spec.label}: fault injected ({how})")
            rec = self.wait_recovered(job, spec, fault_time, victim)
            result["recovered"] = rec is not None
            if rec is None:
                say(f"{spec.label}: NOT recovered within {a.recover_timeout:.0f} s")
                result["error"] = f"no recovery within {a.recover_timeout} s"
                result["log_tail"] = job.logs_tail(40)
            else:
                left = max(0, a.steps - (rec.get("first_step_after") or 0) if isinstance(rec, dict) else a.steps)
                finish = a.finish_timeout + left * max(a.step_sleep, 0.02) * 3
                try:
                    result["exit_codes"] = job.wait(timeout=finish)
                except TimeoutError:
                    result["exit_codes"] = {n: node.proc.poll() for n, node in job.nodes.items()}
                    result["finish_timeout"] = True
                    say(f"{spec.label}: job did not finish within {finish:.0f} s after recovering (stopped; see the notes)")
                    result["log_tail"] = job.logs_tail(15)
            records = job.step_records()
            result.update(self.measure(records, spec, fault_time))
            if rec is not None and result.get("downtime_s") is not None:
                say(
                    f"{spec.label}: recovered in {result['downtime_s']:.1f} s ({result['steps_redone']} steps redone, "
                    f"step time {fmt_num(result['step_time_s'] and result['step_time_s'] * 1000, '{:.0f}')} ms)"
                )
            elif rec is not None:
                result["recovered"] = False
                result["error"] = "the step log shows no step completed by every rank after the fault"
            if spec.launcher != "torchrun":
                result["events"] = [e for e in job.events() if e.get("kind") not in ("info",)]
            if spec.launcher in ("tm-live", "tm-watchdog") and spec.case != "overhead":
                result["breakdown"] = self.breakdown(job, None if spec.case == "drain" else fault_time)
                result["connections"] = connections_opened(result["events"])
                spare = job.nodes.get("s0")
                result["spare_reran"] = bool(spare and "running the script again" in spare.log())
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001 - one broken run must not lose the others
            record_failure(result, spec.label, job, e)
        finally:
            self.finish(job, result, t0)
        return result

    @staticmethod
    def breakdown(job: LocalJob, fault_time: float | None) -> dict | None:
        """The agents' downtime breakdown of the change to generation 1 (``ctl timeline
        --json``): the phases of the node that resumed last, whose phases add up to the total.
        The agents' ``detect`` runs from the last step completed to the failure report; the
        benchmark knows when the fault struck and splits it: ``before_fault``, the part of the
        interrupted step done before the fault, and ``detect``, the fault to the report."""
        out = job.ctl("timeline", "--json")
        if out.returncode != 0:
            return None
        timeline = json.loads(out.stdout)
        change = next((g for g in timeline.get("generations", []) if g.get("generation") == 1), None)
        parts = change.get("breakdown") if change else None
        if not parts or not parts.get("critical_node"):
            return None
        phases = {"total": parts["total_s"], **parts["nodes"][parts["critical_node"]]["phases"]}
        if fault_time is not None and phases.get("detect") is not None:
            origin = timeline["start"] + parts["origin"]  # the timeline's times count from the job's start
            before = min(phases["detect"], max(0.0, fault_time - origin))
            phases.update(before_fault=before, detect=phases["detect"] - before)
        return phases

    def finish(self, job: LocalJob, result: dict, t0: float) -> None:
        """Every run ends the same way: stop its processes, reap orphans, record the wall time."""
        job.stop()
        self.current = None
        result["orphans_reaped"] = reap()
        result["wall_s"] = time.time() - t0

    @staticmethod
    def victim_pids(job: LocalJob, spec: Spec, VICTIM: str) -> list[int]:
        """The processes ``inject`` signals besides the agent, looked up before the release:
        the worker it kills, or (node loss under torchrun, whose workers live in their own
        sessions and outlive their agent) every worker of the node; a lost machine takes them
        along, tm-launch's die with their agent by PDEATHSIG."""
        if spec.case in ("worker-sigkill", "worker-sigstop"):
            pids = job.worker_pids(VICTIM)
            if not pids:
                raise RuntimeError(f"node {VICTIM} has no workers to kill\n{job.logs_tail()}")
            return pids[:1]
        if spec.case == "node-sigkill" and isinstance(job, TorchrunJob):
            return job.worker_pids(VICTIM)
        return []

    def wait_fault_moment(self, job: LocalJob, step: int, timeout: float) -> None:
        """Return when the fault is due: ``--fault-at`` of a step after the step log first shows
        ``step`` (the median step since the pause). The log is read every 2 ms, so the fault
        lands where it is meant to, not where a coarser poll happens to notice the step."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            records = job.step_records()
            done = [t for t, _, s, _, _ in records if s == step]
            if done:
                length = median_step_time(records, first=self.args.pause_step) or self.args.step_sleep
                time.sleep(max(0.0, min(done) + self.args.fault_at * length - time.time()))
                return
            if job.nodes and all(n.proc.poll() is not None for n in job.nodes.values()):
                break
            time.sleep(0.002)
        raise TimeoutError(f"timed out waiting for step {step}\n{job.logs_tail()}")

    def inject(self, job: LocalJob, spec: Spec, VICTIM: str, pids: list[int]) -> tuple[float, str]:
        """The fault, and its time: taken right when the signal goes."""
        if spec.case == "worker-sigkill":
            t = time.time()
            os.kill(pids[0], signal.SIGKILL)
            return t, f"kill -9 worker pid {pids[0]} on {VICTIM}"
        if spec.case == "worker-sigstop":
            t = time.time()
            os.kill(pids[0], signal.SIGSTOP)
            return t, f"kill -STOP worker pid {pids[0]} on {VICTIM}"
        if spec.case == "node-sigkill":
            agent = job.nodes[VICTIM].proc
            t = time.time()
            agent.send_signal(signal.SIGKILL)
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return t, f"kill -9 agent of {VICTIM}" + (f" and its workers {pids}" if pids else "")
        if spec.case == "drain":
            t = time.time()
            out = job.ctl("drain", VICTIM)
            if out.returncode != 0:
                raise RuntimeError(f"ctl drain {VICTIM} failed ({out.returncode}): {out.stderr.strip()}")
            return t, f"ctl drain {VICTIM}"
        raise ValueError(spec.case)

    def wait_all_ranks(self, job: LocalJob, step: int, world: int, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            done = job.steps_done()
            if len(done) >= world and all(s >= step for s in done.values()):
                return
            if job.nodes and all(n.proc.poll() is not None for n in job.nodes.values()):
                break
            time.sleep(0.1)
        raise TimeoutError(f"not every rank reached step {step} in {timeout:.0f} s\n{job.logs_tail()}")

    def wait_standby(self, job: TorchrunJob, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if job.standby_waiting():
                return
            time.sleep(0.3)
        raise TimeoutError(f"the standby torchrun agent did not reach c10d's redundancy list in {timeout:.0f} s\n{job.logs_tail()}")

    def wait_recovered(self, job: LocalJob, spec: Spec, fault_time: float, VICTIM: str):
        """Poll the step log until every rank completed a step after the fault (drain: after the
        drained node left); None on timeout or when the job died without recovering."""
        deadline = time.time() + self.args.recover_timeout
        left_at = None
        while time.time() < deadline:
            records = job.step_records()
            finished = job.nodes and all(n.proc.poll() is not None for n in job.nodes.values())
            if spec.case == "drain":
                if left_at is None and job.nodes[VICTIM].proc.poll() is not None:
                    left_at = time.time()
                done = step_completion(records)
                if left_at is not None and any(t > left_at for t in done.values()):
                    return True
                if finished:
                    return True if left_at is not None else None
            else:
                d = downtime(records, fault_time)
                if d["first_step_after"] is not None:
                    return d
                if finished:
                    return None
            time.sleep(0.1)
        return None

    def measure(self, records, spec: Spec, fault_time: float) -> dict:
        out = {}
        step = median_step_time([r for r in records if r[0] < fault_time], first=self.args.pause_step)
        if spec.case == "drain":
            switch = switch_time(records, fault_time)
            out["drain_requested"] = fault_time
            out["switch_time"] = switch
            ft = switch if switch is not None else fault_time
            d = downtime(records, ft)
            out["request_to_switch_s"] = (switch - fault_time) if switch is not None else None
            # training goes on during the prepare phase, but the spare's warm-up competes for CPU:
            if switch is not None:
                out["prepare_time_lost_s"] = time_lost(records, fault_time, switch, step)
        else:
            d = downtime(records, fault_time)
            if d["downtime_s"] is not None:
                # the part of the interrupted step done before the fault, and the rest: the recovery
                out["fault_offset_s"] = fault_time - d["last_step_at"]
                out["after_fault_s"] = d["downtime_s"] - out["fault_offset_s"]
                if step:  # issue 32's figure: what the recovery adds to the interrupted step run again
                    out["recovery_overhead_s"] = out["after_fault_s"] - step
        out.update(d)
        out["step_time_s"] = step
        return out

    # -- overhead ---------------------------------------------------------------------------------
    def overhead_run(self, spec: Spec) -> dict:
        a = self.args
        nodes, nproc = spec.layout
        script = ["--steps", str(a.overhead_steps), "--step-sleep", str(a.step_sleep)]
        t0 = time.time()
        result = {
            "case": "overhead",
            "size": spec.size,
            "launcher": spec.launcher,
            "repeat": spec.repeat,
            "nodes": nodes,
            "nproc": nproc,
            "steps": a.overhead_steps,
            "load": os.getloadavg()[0],
        }
        job = self.make_job(spec, script, spare=False)
        result["workdir"] = job.workdir
        try:
            say(f"{spec.launcher} overhead {spec.size} ranks: starting ({a.overhead_steps} steps, no fault)")
            job.start_all([f"n{i}" for i in range(nodes)])
            cpu = CpuSampler(job)
            deadline = time.time() + a.start_timeout + a.overhead_steps * a.step_sleep * 4 + 60
            steady = None  # (agent CPU, worker CPU, step) once past the warm-up steps
            last = (0.0, 0.0, 0)
            while any(n.proc.poll() is None for n in job.nodes.values()):
                if time.time() > deadline:
                    raise TimeoutError(f"job did not finish\n{job.logs_tail()}")
                cpu.sample()
                done = job.steps_done()
                step = min(done.values()) if len(done) >= nodes * nproc else -1
                if step >= a.overhead_warmup and steady is None:
                    steady = (*cpu.totals(), step)
                if steady is not None and step < a.overhead_steps - 1:
                    last = (*cpu.totals(), step)  # the last reading while every rank still runs
                time.sleep(0.25)
            if steady is not None and last[2] > steady[2]:
                n = last[2] - steady[2]
                result["steady_agent_cpu_ms_per_step"] = (last[0] - steady[0]) / n * 1000
                result["steady_worker_cpu_ms_per_step"] = (last[1] - steady[1]) / n * 1000
            result["exit_codes"] = {name: n.proc.returncode for name, n in job.nodes.items()}
            records = job.step_records()
            result["step_time_s"] = median_step_time(records, first=a.overhead_warmup)
            result["measured_steps"] = max(0, a.overhead_steps - a.overhead_warmup - 1)
            result["agent_cpu_s"], result["worker_cpu_s"] = cpu.totals()
            say(
                f"{spec.launcher} overhead {spec.size} ranks: median step {result['step_time_s'] * 1000:.2f} ms "
                f"(steady-state CPU per step: agents {fmt_num(result.get('steady_agent_cpu_ms_per_step'))} ms, "
                f"workers {fmt_num(result.get('steady_worker_cpu_ms_per_step'))} ms; load {result['load']:.1f})"
            )
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001
            result["error"] = f"{type(e).__name__}: {e}"[:4000]
            say(f"{spec.launcher} overhead {spec.size} ranks: ERROR {type(e).__name__}")
        finally:
            self.finish(job, result, t0)
        return result


# -- step-log arithmetic ----------------------------------------------------------------------------
def step_completion(records) -> dict[int, float]:
    """Step -> the time the last rank first completed it (the step's all-rank completion)."""
    first: dict[tuple[int, int], float] = {}
    ranks = set()
    for t, rank, step, _, _ in records:
        ranks.add(rank)
        key = (step, rank)
        if key not in first or t < first[key]:
            first[key] = t
    by_step: dict[int, list[float]] = {}
    for (step, rank), t in first.items():
        by_step.setdefault(step, []).append(t)
    return {s: max(ts) for s, ts in by_step.items() if len(ts) == len(ranks)}


def median_step_time(records, first: int = 0) -> float | None:
    done = step_completion(records)
    gaps = [done[s] - done[s - 1] for s in sorted(done) if s > first and s - 1 in done]
    return statistics.median(gaps) if gaps else None


def switch_time(records, request_time: float) -> float | None:
    """For a drain: just after the last step every rank completed in the old configuration.

    Training goes on while a drain prepares, so the request time is not where training stops.
    The old configuration is each rank's process before the request; the switch is the first
    record from a new process. The returned time is where ``downtime`` should put the "fault"."""
    old: dict[int, int] = {}
    for t, rank, _, _, pid in sorted(records):
        if t < request_time:
            old[rank] = pid
    new = [t for t, rank, _, _, pid in records if t >= request_time and pid != old.get(rank)]
    if not old or not new:
        return None
    first_new = min(new)
    by_step: dict[int, dict[int, float]] = {}
    for t, rank, step, _, pid in records:
        if pid == old.get(rank) and t < first_new:
            by_step.setdefault(step, {})
            by_step[step][rank] = min(t, by_step[step].get(rank, t))
    complete = [st for st, done in by_step.items() if set(done) >= set(old)]
    if not complete:
        return None
    return max(by_step[max(complete)].values()) + 1e-6


def time_lost(records, start: float, end: float, normal_step: float | None) -> float | None:
    """Seconds lost against normal step time between ``start`` and ``end`` (all-rank completions)."""
    if not normal_step:
        return None
    done = step_completion(records)
    times = sorted(t for t in done.values() if start <= t <= end)
    if len(times) < 2:
        return None
    return max(0.0, (times[-1] - times[0]) - normal_step * (len(times) - 1))


# -- reporting ----------------------------------------------------------------------------------------
def summarize(runs: list[dict], args) -> tuple[list[dict], list[dict]]:
    rows = []
    keys = []
    for r in runs:
        if r["case"] == "overhead":
            continue
        k = (r["case"], r["size"], r["launcher"])
        if k not in keys:
            keys.append(k)
    for case, size, launcher in keys:
        group = [r for r in runs if (r["case"], r["size"], r["launcher"]) == (case, size, launcher)]
        ok = [r for r in group if r.get("recovered") and r.get("downtime_s") is not None]
        row = {
            "case": case,
            "size": size,
            "launcher": launcher,
            "runs": len(group),
            "failed": len(group) - len(ok),
            "downtime_s": _median_of(ok, "downtime_s"),
            "steps_redone": _median_of(ok, "steps_redone"),
            "after_fault_s": _median_of(ok, "after_fault_s"),
            "fault_offset_s": _median_of(ok, "fault_offset_s"),
            "recovery_overhead_s": _median_of(ok, "recovery_overhead_s"),
            "step_time_s": statistics.median([r["step_time_s"] for r in ok if r.get("step_time_s")])
            if any(r.get("step_time_s") for r in ok)
            else None,
            "note": "; ".join(sorted({r["error"].splitlines()[0][:120] for r in group if r.get("error")})),
        }
        rows.append(row)
    # torchrun has no drain: an explicit n/a row where tm-launch drain rows exist
    for case, size in {(r["case"], r["size"]) for r in rows if r["case"] == "drain"}:
        if not any(r["case"] == case and r["size"] == size and r["launcher"] == "torchrun" for r in rows) and "torchrun" in args.launchers:
            rows.append(
                {
                    "case": case,
                    "size": size,
                    "launcher": "torchrun",
                    "runs": 0,
                    "failed": 0,
                    "downtime_s": None,
                    "steps_redone": None,
                    "step_time_s": None,
                    "na": True,
                    "note": "torchrun has no drain",
                }
            )
    order = {c: i for i, c in enumerate(CASES)}
    lorder = {l: i for i, l in enumerate(LAUNCHERS)}
    rows.sort(key=lambda r: (order[r["case"]], r["size"], lorder[r["launcher"]]))
    for row in rows:
        ref = next((r for r in rows if (r["case"], r["size"], r["launcher"]) == (row["case"], row["size"], "torchrun")), None)
        if ref and ref.get("downtime_s") and row.get("downtime_s"):
            row["ratio"] = ref["downtime_s"] / row["downtime_s"]
        else:
            row["ratio"] = None
    overhead = []
    oruns = [r for r in runs if r["case"] == "overhead" and r.get("step_time_s")]
    for size in sorted({r["size"] for r in oruns}):
        mine = [r for r in oruns if r["size"] == size]
        per = {l: [r["step_time_s"] for r in mine if r["launcher"] == l] for l in ("torchrun", "tm-live")}
        pairs = []
        for n in sorted({r["repeat"] for r in mine}):
            tr = [r["step_time_s"] for r in mine if r["repeat"] == n and r["launcher"] == "torchrun"]
            tm = [r["step_time_s"] for r in mine if r["repeat"] == n and r["launcher"] == "tm-live"]
            if tr and tm:
                pairs.append(tm[0] / tr[0] - 1)
        tr = statistics.median(per["torchrun"]) if per["torchrun"] else None
        tm = statistics.median(per["tm-live"]) if per["tm-live"] else None

        def cpu(key, launcher):
            vals = [r[key] for r in mine if r["launcher"] == launcher and r.get(key) is not None]
            return statistics.median(vals) if vals else None

        overhead.append(
            {
                "size": size,
                "torchrun_step_s": tr,
                "tm_live_step_s": tm,
                "pair_overheads_pct": [p * 100 for p in pairs],
                "overhead_pct": statistics.median(pairs) * 100 if pairs else None,
                "overhead_ms": (tm - tr) * 1000 if tr and tm else None,
                "agent_cpu_ms_per_step": {l: cpu("steady_agent_cpu_ms_per_step", l) for l in ("torchrun", "tm-live")},
                "worker_cpu_ms_per_step": {l: cpu("steady_worker_cpu_ms_per_step", l) for l in ("torchrun", "tm-live")},
                "runs": len(mine),
            }
        )
    return rows, overhead


def _median_of(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


VICTIM_TEXT = {
    "first": "the node holding rank 0",
    "last": "the node holding the last ranks (the ranks the spare warmed up as)",
    "n1": "node n1",
}


def fmt_num(x, spec="{:.1f}", none="—"):
    return none if x is None else spec.format(x)


def run_notes(runs: list[dict]) -> list[str]:
    """One line per run that did not go cleanly: no recovery, errors, a job that never ended."""
    notes = []
    for r in runs:
        label = f"{r['launcher']} {r['case']} {r['size']} ranks (run {r['repeat'] + 1})"
        if r.get("error"):
            notes.append(f"{label}: {r['error'].splitlines()[0][:200]}")
        elif r.get("finish_timeout"):
            notes.append(
                f"{label}: recovered, but the job did not end afterwards (stopped by the benchmark; exit codes {r.get('exit_codes')})"
            )
        elif r.get("exit_codes") and any(c != 0 for n, c in r["exit_codes"].items() if n != r.get("victim") or r["case"] == "overhead"):
            notes.append(f"{label}: exit codes {r['exit_codes']}")
        if r["case"] == "drain" and r.get("request_to_switch_s") is not None:
            lost = r.get("prepare_time_lost_s")
            notes.append(
                f"{label}: switch {r['request_to_switch_s']:.2f} s after the drain request; training went on meanwhile"
                + (f" (time lost to slower steps while preparing: {lost:.2f} s)" if lost is not None else "")
            )
    return notes


def connections_opened(events) -> dict | None:
    """Per substitution (the change to generation 1): the most TCP connections one worker of a
    surviving node and one of a joining node opened while entering, and the most communicators
    one worker rebuilt (the agents' ``entered`` events, from ``tm_launch.worker.comms.connections``)."""
    plan = next((e for e in events if e.get("kind") == "plan" and e.get("generation") == 1), None)
    entered = [e for e in events if e.get("kind") == "entered" and e.get("generation") == 1]
    if plan is None or not entered:
        return None
    joiners = set((plan.get("replaced") or {}).keys())

    def most(rows):
        values = [e["tcp_opened"] for e in rows if e.get("tcp_opened") is not None]
        return max(values) if values else None

    return {
        "survivor": most([e for e in entered if e["node"] not in joiners]),
        "joiner": most([e for e in entered if e["node"] in joiners]),
        "groups_rebuilt": max((e.get("groups_rebuilt") or 0) for e in entered),
    }


BREAKDOWN_PHASES = ("before_fault", "detect", "plan", "seen", "directed", "communicator", "state", "first_step", "total")


def breakdown_table(runs) -> list[str]:
    """tm-live's downtime by phase (``tm_launch.joblog``, median per case and size, in ms),
    with how often the spare took ranks it had not warmed up as (it then runs the script again
    inside the communicator phase)."""
    groups: dict = {}
    for r in runs:
        if r.get("breakdown"):
            groups.setdefault((r["case"], r["size"]), []).append(r)
    if not groups:
        return []
    lines = [
        "",
        "tm-live downtime by phase (ms, median; the phases of the node that resumed last, which add up to its total; "
        "the step log's downtime adds the gap between the agents' stamps and the script's step log):",
        "",
        "| case | world size | " + " | ".join(BREAKDOWN_PHASES) + " | spare ran the script again "
        "| connections opened per worker: survivor / joiner | communicators rebuilt per worker |",
        "|---|---|" + "---|" * len(BREAKDOWN_PHASES) + "---|---|---|",
    ]
    order = {c: i for i, c in enumerate(CASES)}
    for (case, size), group in sorted(groups.items(), key=lambda kv: (order.get(kv[0][0], 9), kv[0][1])):
        cells = []
        for phase in BREAKDOWN_PHASES:
            values = [r["breakdown"][phase] for r in group if r["breakdown"].get(phase) is not None]
            cells.append(fmt_num(statistics.median(values) * 1000, "{:.0f}") if values else "—")
        reran = sum(1 for r in group if r.get("spare_reran"))
        counted = [r["connections"] for r in group if r.get("connections")]

        def span(key, counted=counted):
            values = sorted({c[key] for c in counted if c.get(key) is not None})
            return "—" if not values else str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"

        lines.append(
            f"| {case} | {size} | " + " | ".join(cells) + f" | {reran} of {len(group)} | {span('survivor')} / {span('joiner')} "
            f"| {span('groups_rebuilt')} |"
        )
    return lines


def markdown(rows, overhead, args, meta, runs=()) -> str:
    lines = (
        [
            "| case | world size | launcher | downtime s | of it before the fault, ms | recovery overhead, ms | steps redone | ratio vs torchrun |",
            "|---|---|---|---|---|---|---|---|",
        ]
        if rows
        else []
    )
    for r in rows:
        extra = "—"
        if r.get("na"):
            dt, before, redone, ratio = "n/a (no drain)", "n/a", "n/a", "n/a"
        elif r["downtime_s"] is None:
            dt, before, redone, ratio = "no recovery", "—", "—", "—"
        else:
            extra = fmt_num(None if r.get("recovery_overhead_s") is None else r["recovery_overhead_s"] * 1000, "{:.0f}")
            dt = fmt_num(r["downtime_s"], "{:.2f}")
            if r["failed"]:
                dt += f" ({r['failed']}/{r['runs']} runs failed)"
            before = fmt_num(r.get("fault_offset_s") and r["fault_offset_s"] * 1000, "{:.0f}")
            redone = fmt_num(r["steps_redone"], "{:g}")
            ratio = "1.0x (ref)" if r["launcher"] == "torchrun" else (fmt_num(r["ratio"], "{:.1f}x") if r["ratio"] else "n/a")
        case = f"{r['case']} ({args.layout})" if args.layout else r["case"]
        lines.append(f"| {case} | {r['size']} | {r['launcher']} | {dt} | {before} | {extra} | {redone} | {ratio} |")
    if overhead:
        lines += [
            "" if rows else None,
            "| steady state (no fault) | world size | torchrun median step ms | tm-live median step ms | overhead (median of A/B pairs) | CPU ms/step, workers: torchrun / tm-live | CPU ms/step, agents: torchrun / tm-live |",
            "|---|---|---|---|---|---|---|",
        ]
        for o in overhead:
            pct = (
                "—"
                if o["overhead_pct"] is None
                else f"{o['overhead_pct']:+.1f} % (pairs: {', '.join(f'{p:+.0f}' for p in o['pair_overheads_pct'])} %)"
            )
            acpu, wcpu = o["agent_cpu_ms_per_step"], o["worker_cpu_ms_per_step"]
            lines.append(
                f"| overhead{f' ({args.layout})' if args.layout else ''} | {o['size']} | {fmt_num(o['torchrun_step_s'] and o['torchrun_step_s'] * 1000, '{:.1f}')} | "
                f"{fmt_num(o['tm_live_step_s'] and o['tm_live_step_s'] * 1000, '{:.1f}')} | {pct} | "
                f"{fmt_num(wcpu.get('torchrun'))} / {fmt_num(wcpu.get('tm-live'))} | "
                f"{fmt_num(acpu.get('torchrun'))} / {fmt_num(acpu.get('tm-live'))} |"
            )
    lines += breakdown_table(runs)
    notes = run_notes(runs)
    if notes:
        lines += ["", "Notes:"] + [f"- {n}" for n in notes]
    steps = [r["step_time_s"] for r in rows if r.get("step_time_s")]
    device_text = f"GPU {meta.get('gpu')}, script args {args.script_args!r}" if args.script_args else "CPU, gloo"
    overhead_text = (
        f"Overhead: median step over {args.overhead_steps} steps (first {args.overhead_warmup} skipped), no spare, "
        f"{args.overhead_pairs * args.repeat} alternating torchrun/tm-live pair(s). "
        if overhead
        else ""
    )
    cut_short = (
        f" (interrupted: {meta.get('runs_done')} of {meta.get('runs_planned')} runs done; medians over those)"
        if meta.get("interrupted")
        else ""
    )
    lines += [
        "",
        f"Setup: {meta['host_cpus']} CPU cores, torch {meta['torch']} ({device_text}), loopback. "
        f"Step = {args.step_sleep * 1000:.0f} ms sleep + "
        f"{f'tests/scripts/hybrid.py --layout {args.layout} (AdamW, LR schedule, loss all-reduced after the optimizer step) ' if args.layout else 'a tiny MLP forward/backward/allreduce '}"
        f"(measured median step before the fault: {fmt_num(statistics.median(steps) * 1000 if steps else None, '{:.0f}')} ms). "
        f"Training paused at step {args.pause_step} until ready, an unplanned fault {args.fault_at:g} of a step after step "
        f'{args.pause_step + args.fault_after} completed ("before the fault": the part of the interrupted step done before it; '
        f'"recovery overhead": the downtime less that part and one step before the fault, the interrupted step run again); '
        f"checkpoint every {args.ckpt_every} steps for torchrun and tm-restart; one spare node for tm-launch "
        f"(torchrun: a standby agent for node-sigkill{'' if args.torchrun_shared_store else '; TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1'}). "
        f"{f'OMP_NUM_THREADS={args.omp_threads} for every launcher. ' if args.omp_threads else ''}Layout: 2 ranks = 2 nodes x 1, N ranks = N/2 nodes x 2. "
        f"Fault on {VICTIM_TEXT[args.victim]} (torchrun: n1). "
        f"Median over {args.repeat} run(s) per row{cut_short}. "
        f"{overhead_text}"
        f"Load average at start: {meta['load_start']:.1f} (the machine is shared).",
        f"Command: `{meta['command']}` (total {meta['total_s']:.0f} s)",
    ]
    return "\n".join(l for l in lines if l is not None) + "\n"


# -- main -----------------------------------------------------------------------------------------------
def parse(argv=None):
    p = argparse.ArgumentParser(description="Downtime and step-time overhead: tm-launch against torchrun, in one run.")
    p.add_argument("--quick", action="store_true", help="worker-sigkill at 2 ranks under all three launchers + overhead (~2-3 min)")
    p.add_argument(
        "--layout",
        default="",
        choices=("", "ddp-tp", "hsdp", "pp", "fsdp-tp", "fsdp", "zero"),
        help="run tests/scripts/hybrid.py with this layout (4 ranks) instead of the DDP script",
    )
    p.add_argument(
        "--victim",
        default="first",
        choices=VICTIMS,
        help="the node that loses a worker, dies or is drained (tm-launch; "
        "torchrun: n1): first = the node holding rank 0 (default; the spare runs the script again for those ranks), "
        "last = the node holding the last ranks, which the spare warmed up as, n1 = the node named n1 (see victim_node)",
    )
    p.add_argument(
        "--sizes",
        default="2,4,8",
        help="world sizes for the worker-sigkill sweep (torchrun vs tm-live), e.g. 2,4,8,16; the largest is the cap",
    )
    p.add_argument(
        "--cases",
        default=",".join(c for c in CASES if c != "worker-sigstop"),
        help=f"comma list of {', '.join(CASES)} (worker-sigstop only when named: torchrun waits out --recover-timeout)",
    )
    p.add_argument("--launchers", default=",".join(LAUNCHERS), help=f"comma list of {', '.join(LAUNCHERS)}")
    p.add_argument("--repeat", type=int, default=1, help="runs per row; the table shows the median")
    p.add_argument("--step-sleep", type=float, default=0.05, help="seconds of stand-in compute per step")
    p.add_argument(
        "--script-args",
        default="",
        help="more arguments for the training script of every launcher, e.g. "
        "'--device cuda --backend gloo' (a GPU job whose ranks share one GPU)",
    )
    p.add_argument("--steps", type=int, default=100, help="steps per fault run")
    p.add_argument("--pause-step", type=int, default=20, help="training waits here until everything is ready")
    p.add_argument("--fault-after", type=int, default=5, help="inject the fault this many steps after the release")
    p.add_argument(
        "--fault-at",
        type=float,
        default=0.5,
        help="where in the next step the fault strikes, as a fraction of the median step after the step log shows "
        "step pause+fault-after: 0.5 (default) is where a fault that may come at any time lands on average",
    )
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument(
        "--snapshot-every",
        type=int,
        default=1,
        help="tm-live's --snapshot-every (0: off, so a layout without replicas falls back to the checkpoint)",
    )
    p.add_argument("--overhead-steps", type=int, default=150, help="steps per overhead run")
    p.add_argument("--overhead-pairs", type=int, default=3, help="torchrun/tm-live overhead runs, alternating (per --repeat)")
    p.add_argument("--overhead-warmup", type=int, default=20)
    p.add_argument("--overhead-size", type=int, default=2, help="world size of the overhead runs")
    p.add_argument(
        "--torchrun-shared-store",
        action="store_true",
        help="run torchrun with torch's default shared rendezvous store (by default the benchmark sets "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with sharing, torch 2.13 restarts often hang on stale gloo addresses)",
    )
    p.add_argument("--omp-threads", type=int, default=1, help="OMP_NUM_THREADS for every worker of every launcher (0: leave unset)")
    p.add_argument("--start-timeout", type=float, default=180)
    p.add_argument("--recover-timeout", type=float, default=120)
    p.add_argument(
        "--finish-timeout", type=float, default=30, help="seconds (plus 3 x the remaining steps' time) for the job to end after recovering"
    )
    p.add_argument("--out-dir", default=os.path.join(BENCH, "results"))
    args = p.parse_args(argv)
    args.sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    args.launchers = [l.strip() for l in args.launchers.split(",") if l.strip()]
    for c in args.cases:
        if c not in CASES:
            p.error(f"--cases: unknown case {c!r} (known: {', '.join(CASES)})")
    for l in args.launchers:
        if l not in LAUNCHERS:
            p.error(f"--launchers: unknown launcher {l!r} (known: {', '.join(LAUNCHERS)})")
    for s in args.sizes:
        if s < 2 or (s > 2 and s % 2):
            p.error(f"--sizes: {s} must be 2 or an even number (N/2 nodes x 2 workers)")
    if args.layout:
        if args.sizes != [4] or args.overhead_size not in (2, 4):
            say("--layout: hybrid layouts run at 4 ranks (2 nodes x 2 workers)")
        args.sizes, args.overhead_size = [4], 4
    if args.quick:
        args.sizes = [2]
        args.cases = ["worker-sigkill", "overhead"]
        args.overhead_steps = min(args.overhead_steps, 100)
        args.overhead_pairs = min(args.overhead_pairs, 2)
    return args


def plan_runs(args) -> list[Spec]:
    specs = []
    base = args.sizes[0]
    for rep in range(args.repeat):
        for case in ("worker-sigkill", "worker-sigstop", "node-sigkill", "drain"):
            if case not in args.cases:
                continue
            sizes = args.sizes if case == "worker-sigkill" else [base]
            for size in sizes:
                for launcher in args.launchers:
                    if case == "drain" and launcher == "torchrun":
                        continue  # n/a
                    if launcher == "tm-watchdog" and case != "worker-sigstop":
                        continue  # the watchdog-only variant differs from tm-live for a hung worker only
                    if size != base and launcher == "tm-restart":
                        continue  # the sweep compares live against torchrun
                    specs.append(Spec(case, size, launcher, rep))
        if "overhead" in args.cases:
            # alternate A/B, B/A, ... so that drifting background load hits both launchers alike
            for pair in range(args.overhead_pairs):
                n = rep * args.overhead_pairs + pair
                for launcher in ("torchrun", "tm-live") if n % 2 == 0 else ("tm-live", "torchrun"):
                    specs.append(Spec("overhead", args.overhead_size, launcher, n))
    # group repeats of the same configuration next to each other is worse for drift; keep rounds
    return specs


def main(argv=None) -> int:
    args = parse(argv)
    bench = Bench(args)
    specs = plan_runs(args)
    say(f"{len(specs)} run(s); logs under {os.path.relpath(bench.logdir)}; tag {TAG_VAR}={TAG}")
    started, load_start = time.time(), os.getloadavg()[0]
    runs, interrupted = run_all(bench, specs, lambda spec: bench.overhead_run(spec) if spec.case == "overhead" else bench.fault_run(spec))
    import torch

    meta = session_meta(
        command_line(__file__, argv),
        started,
        load_start,
        interrupted,
        tag=TAG,
        runs_done=len(runs),
        runs_planned=len(specs),
        gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    )
    rows, overhead = summarize(runs, args)
    md = markdown(rows, overhead, args, meta, runs)
    write_results(args.out_dir, "downtime", md, {"meta": meta, "config": vars(args), "rows": rows, "overhead": overhead, "runs": runs})
    return 130 if interrupted else (1 if any(r.get("error") for r in runs) else 0)


if __name__ == "__main__":
    sys.exit(main())
