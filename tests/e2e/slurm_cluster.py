"""A real Slurm on this one machine: munged, slurmctld and three ``slurmd -N n1..n3``.

Debian's ``slurm-wlm`` and ``munge`` (``make slurm-deps``), everything on loopback and under one
temporary directory: a munge key and socket of its own, a ``slurm.conf`` whose state, spool, pid
and log paths are there, and one line per node name with **its own port** (with one shared port
the steps fail with "Job credential replayed"). The recipe is the one measured in
``/work/shared/ARCHITECTURE.md`` ("Facts added in turn 5"). Needs root (slurmd runs the tasks as
the submitting user and must be able to switch to it) and the daemons on PATH.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol")
INSTALL = "make slurm-deps (as root: apt-get install -y slurm-wlm munge)"


def missing() -> str | None:
    """Why a real Slurm cannot run here (one line), or None."""
    absent = [d for d in DAEMONS if shutil.which(d) is None and not os.path.exists(f"/usr/sbin/{d}")]
    if absent:
        return f"Slurm is not installed ({', '.join(absent)} missing): {INSTALL}"
    if os.geteuid() != 0:
        return "a real Slurm needs root here (slurmd switches to the submitting user)"
    return None


def _which(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free now (held together so that none is handed out twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SlurmCluster:
    """``with SlurmCluster(root, nodes=3) as slurm: slurm.sbatch(...)``; ``slurm.env`` is the
    environment Slurm's clients need (``SLURM_CONF``)."""

    def __init__(self, root: str, nodes: int = 3, cpus: int = 2):
        self.root = root
        self.names = [f"n{i + 1}" for i in range(nodes)]
        self.cpus = cpus
        self.procs: list[subprocess.Popen] = []
        self.conf = os.path.join(root, "slurm.conf")
        self.env = {**os.environ, "SLURM_CONF": self.conf}

    # -- bring-up ---------------------------------------------------------------------------
    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        os.makedirs(self.root, exist_ok=True)
        os.chmod(self.root, 0o755)
        for sub in ("munge", "state", "spool", "log"):
            os.makedirs(os.path.join(self.root, sub), mode=0o755, exist_ok=True)
        for name in self.names:
            os.makedirs(os.path.join(self.root, "spool", name), mode=0o755, exist_ok=True)
        self._start_munge()
        self._write_conf()
        self._spawn([_which("slurmctld"), "-D", "-f", self.conf], "slurmctld")
        self._wait(lambda: self._scontrol("ping").returncode == 0, 60, "slurmctld to answer")
        for name in self.names:
            self._spawn([_which("slurmd"), "-D", "-N", name, "-f", self.conf], f"slurmd.{name}")
        self._wait(self._all_idle, 90, "every slurmd to register")

    def _start_munge(self) -> None:
        d = os.path.join(self.root, "munge")
        self.munge_socket = os.path.join(d, "munge.socket")
        key = os.path.join(d, "munge.key")
        subprocess.run([_which("mungekey"), "--create", f"--keyfile={key}", "--force"], check=True, capture_output=True)
        os.chmod(key, 0o400)
        self._spawn(
            [
                _which("munged"),
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={d}/munged.pid",
                f"--log-file={d}/munged.log",
                f"--seed-file={d}/munged.seed",
            ],
            "munged",
        )
        self._wait(lambda: os.path.exists(self.munge_socket), 30, "munged's socket")

    def _write_conf(self) -> None:
        host = socket.gethostname().split(".")[0]
        ports = _free_ports(1 + len(self.names))
        r = self.root
        lines = [
            "ClusterName=tmtest",
            f"SlurmctldHost={host}",
            f"SlurmctldPort={ports[0]}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "MpiDefault=none",
            "ReturnToService=2",
            "SwitchType=switch/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MinJobAge=3600",  # keep finished jobs for `scontrol show job`
            "KillWait=5",
            "InactiveLimit=0",
            "SlurmdTimeout=300",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd.%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd.%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
        ]
        for name, port in zip(self.names, ports[1:]):
            lines.append(f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=4000 Port={port}")
        lines.append(f"PartitionName=main Nodes={','.join(self.names)} Default=YES State=UP MaxTime=INFINITE")
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")

    def _spawn(self, cmd: list[str], name: str) -> None:
        log = open(os.path.join(self.root, "log", f"{name}.out"), "w")
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True))
        log.close()

    def _wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if predicate():
                return
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead[0]} exited while waiting for {what}:\n{self.logs_tail()}")
            time.sleep(0.3)
        raise TimeoutError(f"timed out waiting for {what}:\n{self.logs_tail()}")

    def _all_idle(self) -> bool:
        out = self._scontrol("show", "nodes", "--oneliner").stdout
        states = [part.split("=", 1)[1] for part in out.split() if part.startswith("State=")]
        return len(states) == len(self.names) and all(s.startswith("IDLE") for s in states)

    # -- use --------------------------------------------------------------------------------
    def _scontrol(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([_which("scontrol"), *args], capture_output=True, text=True, env=self.env, timeout=30)

    def sbatch(self, script: str, options: list[str], args: list[str], cwd: str, env: dict | None = None) -> str:
        """Submit ``script ARGS`` (its ``#SBATCH`` lines, then ``options``); the job id."""
        done = subprocess.run(
            [_which("sbatch"), "--parsable", *options, script, *args],
            capture_output=True,
            text=True,
            env={**self.env, **(env or {})},
            cwd=cwd,
            timeout=60,
        )
        if done.returncode != 0:
            raise RuntimeError(f"sbatch failed: {done.stderr}\n{self.logs_tail()}")
        return done.stdout.strip().split(";")[0]

    def jobs(self, job_id: str) -> list[dict[str, str]]:
        """``scontrol show job``'s fields (``JobState``, ``ExitCode``, ...): one dict per job, one
        per task of a job array."""
        out = self._scontrol("show", "job", job_id, "--oneliner").stdout
        return [dict(part.split("=", 1) for part in line.split() if "=" in part) for line in out.splitlines() if line.strip()]

    def wait_job(self, job_id: str, timeout: float) -> list[dict[str, str]]:
        """Wait until the job (every task of an array) left PENDING/RUNNING/COMPLETING; their final fields."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            fields = self.jobs(job_id)
            if fields and all(f.get("JobState") not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING") for f in fields):
                return fields
            time.sleep(1)
        raise TimeoutError(f"Slurm job {job_id} still {[f.get('JobState') for f in self.jobs(job_id)]} after {timeout}s")

    def logs_tail(self, lines: int = 15) -> str:
        out = []
        log_dir = os.path.join(self.root, "log")
        for name in sorted(os.listdir(log_dir)) if os.path.isdir(log_dir) else ():
            with open(os.path.join(log_dir, name), errors="replace") as f:
                tail = f.read().splitlines()[-lines:]
            out.append(f"--- {name}\n" + "\n".join(tail))
        return "\n".join(out)

    # -- teardown ---------------------------------------------------------------------------
    def stop(self) -> None:
        """Cancel what still runs, then end the daemons (slurmd first: its steps, then the rest)."""
        if os.path.exists(self.conf) and self.procs:
            subprocess.run(["scancel", "--full", "--user", "root"], env=self.env, capture_output=True, timeout=30)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait(timeout=10)
        self.procs = []
