"""Fault injection for the example scripts: a real SIGKILL of this worker at one point of a step.

    --kill-rank R --kill-step S --kill-phase PHASE [--kill-trigger FILE] [--kill-marker FILE]

PHASE is a point of a step: ``forward``, ``backward`` (inside the backward pass, mid gradient
communication for DDP/FSDP), ``vote`` (inside tm-launch's commit vote: its vote counted, the
decision not read), ``last-vote-node`` (its vote completed the count and the whole node dies:
agent and workers, while the other ranks wait for the decision), ``snapshot`` / ``snapshot-node``
(the step's snapshot taken, not yet on its holder: the worker, or its whole node, dies while
the snapshot is on its way), ``optimizer`` (after the commit, before the update), ``between`` (a
script with two optimizer steps per step: between them, ``tests/scripts/two_optimizers.py``), ``logging`` (after the
update, before the loss all-reduce) or ``logged`` (after it); a script may add points of its own
(``tests/scripts/train.py``: ``allreduce`` inside DDP's gradient allreduce, ``checkpoint`` mid-write;
``tests/scripts/pipelining.py``: ``microbatch``, a pipeline stage's second forward microbatch). With ``--kill-trigger`` the kill
waits for that file (at the first step >= S); with ``--kill-marker`` it happens once per job,
whichever process holds rank R by then. ``--lag-rank R --lag-step S --lag-seconds T``: rank R
sleeps T seconds at the end of step S (after ``logged``), late to its step boundary.

``ChaosDir`` is the chaos soak's protocol (``bench/chaos.py``), the same in every script that
takes ``--chaos-dir DIR``: repeatable triggers, each fired once whichever process holds the rank.
"""

from __future__ import annotations

import os
import signal
import time

PHASES = [
    "forward",
    "backward",
    "allreduce",
    "microbatch",
    "vote",
    "last-vote-node",
    "snapshot",
    "snapshot-node",
    "optimizer",
    "between",
    "logging",
    "logged",
    "checkpoint",
]
# phase -> tm_launch.worker.failpoints point (inside the runtime: the commit vote, the snapshot's send)
RUNTIME_POINTS = {"vote": "vote", "last-vote-node": "last-vote/node", "snapshot": "snapshot", "snapshot-node": "snapshot/node"}


def keep_sockets_open(pid_file: str) -> None:
    """Fork a process that holds this one's descriptors (its sockets stay open after this process
    dies) in a session of its own (a kill of this worker's process group misses it), for 300 s."""
    child = os.fork()
    if child == 0:
        os.setsid()
        time.sleep(300)
        os._exit(0)
    with open(pid_file, "w") as f:
        f.write(str(child))


def stall_once(how: str, marker: str | None, rank: int, where: str) -> None:
    """Stop this process without ending it, once per job (``marker``): ``stop`` SIGSTOPs it (a
    wedged process: no thread runs, its heartbeat stops), ``busy`` spins in Python for good (its
    heartbeat thread keeps beating: only the collectives show it stuck)."""
    from tm_launch.worker.failpoints import _claim

    if marker and not _claim(marker):
        return
    print(f"[faults] rank {rank}: {'SIGSTOP myself' if how == 'stop' else 'busy loop'} at {where}", flush=True)
    if how == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    while True:
        pass


def kill_once(marker: str | None, rank: int, where: str) -> None:
    """SIGKILL this process; with ``marker`` once per job (``tm_launch.worker.failpoints.kill_once``)."""
    from tm_launch.worker.failpoints import kill_once as kill

    kill(marker, f"[faults] rank {rank}: SIGKILL myself at {where}")


class Faults:
    @staticmethod
    def add_arguments(p) -> None:
        p.add_argument("--kill-rank", type=int, default=-1)
        p.add_argument("--kill-step", type=int, default=-1)
        p.add_argument("--kill-phase", default="forward", choices=PHASES)
        p.add_argument("--kill-trigger", default=None, help="kill only once this file exists (at the first step >= --kill-step)")
        p.add_argument("--kill-marker", default=None, help="file that records the kill happened (kill once)")
        p.add_argument(
            "--kill-how",
            default="kill",
            choices=["kill", "stop", "busy"],
            help="at the kill point: SIGKILL, SIGSTOP (a hung process) or a Python busy loop (once with --kill-marker)",
        )
        p.add_argument(
            "--kill-keeps-sockets",
            default=None,
            metavar="FILE",
            help="before the kill, fork a process of its own session that keeps every socket of the killed worker open "
            "(as a child process that inherited them does) and sleeps; its pid goes to FILE",
        )
        p.add_argument(
            "--raise-step", type=int, default=-1, help="the script raises ValueError in the forward of this step (a bug: every attempt)"
        )
        p.add_argument("--raise-ranks", default="", help="... on these ranks (comma-separated) or 'all'")
        p.add_argument("--pause-step", type=int, default=-1, help="every rank waits at this step until --pause-file exists")
        p.add_argument("--pause-file", default=None)
        p.add_argument(
            "--lag-rank", type=int, default=-1, help="this rank sleeps --lag-seconds after step --lag-step (a rank late to its boundary)"
        )
        p.add_argument("--lag-step", type=int, default=-1)
        p.add_argument("--lag-seconds", type=float, default=0.0)

    def __init__(self, args, chaos: ChaosDir | None = None):
        """``chaos``: the chaos soak's triggers (``--chaos-dir``), fired at the same points."""
        self.args, self.chaos = args, chaos
        self.step: int | None = None
        point = RUNTIME_POINTS.get(args.kill_phase)
        if point and args.kill_rank >= 0:  # a point inside the runtime (tm_launch.worker.failpoints)
            os.environ["TM_FAILPOINT"] = f"{point}:{args.kill_rank}:{args.kill_step}:{args.kill_marker or ''}"

    def at(self, job, phase: str) -> None:
        """SIGKILL this worker if it holds the armed rank (or a chaos trigger of its rank) and reached the armed point; the pause
        (every rank holds at --pause-step until --pause-file exists) happens at ``forward``."""
        a, step = self.args, self.step
        if self.chaos:
            self.chaos.kill(job, step, phase)
        if job.in_sandbox or step is None:
            return
        if phase == "forward" and step == a.pause_step and a.pause_file:
            while not os.path.exists(a.pause_file):
                time.sleep(0.02)
        if phase == "forward" and step == a.raise_step and (a.raise_ranks == "all" or str(job.rank) in a.raise_ranks.split(",")):
            raise ValueError("bad batch")  # the same on every rank and every attempt: a bug
        if phase == "logged" and step == a.lag_step and job.rank == a.lag_rank:
            time.sleep(a.lag_seconds)  # its peers start the next step without it
        if job.rank != a.kill_rank or phase != a.kill_phase:
            return
        if a.kill_trigger:
            if step < a.kill_step or not os.path.exists(a.kill_trigger):
                return
        elif step != a.kill_step:
            return
        if a.kill_keeps_sockets and not (a.kill_marker and os.path.exists(a.kill_marker)):
            keep_sockets_open(a.kill_keeps_sockets)
        if a.kill_how != "kill":
            stall_once(a.kill_how, a.kill_marker, job.rank, f"step {step} ({phase})")
        kill_once(a.kill_marker, job.rank, f"step {step} ({phase})")

    def arm_backward(self, model, job) -> None:
        """The ``backward`` point: when the backward pass reaches the model's first layer, the
        later layers' gradient communication (DDP buckets, FSDP reduce-scatters) is under way."""
        first = next(m for m in model.modules() if any(True for _ in m.parameters(recurse=False)))
        first.register_full_backward_pre_hook(lambda module, grad_output: self.at(job, "backward"))

    @staticmethod
    def log_step(path: str, job, step: int) -> None:
        with open(path, "a") as f:
            f.write(f"{time.time():.6f} {job.rank} {step} {getattr(job, 'generation', 0)} {os.getpid()}\n")


class BetweenSteps:
    """What scripts do between steps, on one rank, after the step's commit (``--work-*``):

    * ``compute``: an evaluation, forward passes of a copy of the model on a validation batch for
      ``--work-seconds`` (its peers go on into the next step's collectives and wait there);
    * ``save``: ``torch.save`` of the model and 16 MB of buffers, over and over for
      ``--work-seconds``, then a ``dist.barrier()`` on every rank (a checkpoint on rank 0);
    * ``gpu``: a wait on its GPU (a ``torch.cuda.synchronize()`` on long kernels) for
      ``--work-seconds``: the CPU sleeps. The rank computes on its GPU from its first step on,
      as training does: its pid is in ``--work-dir``/gpu_pids, the fake NVML's
      ``compute_pids_file``, until the wait ends;
    * ``sleep`` / ``fifo`` / ``deadlock``: a hang with no progress of any kind (a sleep, a read
      of a FIFO nobody writes, two threads each holding the lock the other wants), once per job
      (``--work-marker``: the process that takes the rank over does not hang again).

    Nothing is marked (no ``job.checkpointing()``): an ordinary script's between-steps work.
    ``--work-dir`` holds its files, and ``started``: when the work began (time.time())."""

    HANGS = ("sleep", "fifo", "deadlock")

    @staticmethod
    def add_arguments(p) -> None:
        p.add_argument("--work-rank", type=int, default=-1)
        p.add_argument("--work-step", type=int, default=-1, help="the first step after which the rank works")
        p.add_argument("--work-every", type=int, default=0, help="... and every N steps after it (0: once)")
        p.add_argument("--work-seconds", type=float, default=0.0)
        p.add_argument("--work-how", default="compute", choices=["compute", "save", "gpu", *BetweenSteps.HANGS])
        p.add_argument("--work-dir", default=None)
        p.add_argument("--work-marker", default=None, help="a hang happens once per job (whichever process holds the rank)")

    def __init__(self, args):
        self.args = args

    def due(self, step: int) -> bool:
        a = self.args
        if a.work_rank < 0 or step < a.work_step:
            return False
        return step == a.work_step or (a.work_every > 0 and (step - a.work_step) % a.work_every == 0)

    def after_step(self, job, step: int, model) -> None:
        a = self.args
        if a.work_how == "gpu" and job.rank == a.work_rank and not job.in_sandbox and not hasattr(self, "gpu_pids"):
            self.gpu_pids = os.path.join(a.work_dir, "gpu_pids")
            os.makedirs(a.work_dir, exist_ok=True)
            with open(self.gpu_pids, "w") as f:
                f.write(f"{os.getpid()}\n")
        if job.in_sandbox or not self.due(step):
            return
        if job.rank == a.work_rank:
            self._work(job, step, model)
        if a.work_how == "save":
            import torch.distributed as dist

            dist.barrier(group=job.group)  # every rank: its peers wait here for the save

    def _work(self, job, step: int, model) -> None:
        import copy

        import torch

        a = self.args
        if a.work_how in self.HANGS:
            from tm_launch.worker.failpoints import _claim

            if a.work_marker and not _claim(a.work_marker):
                return
        os.makedirs(a.work_dir, exist_ok=True)
        with open(os.path.join(a.work_dir, "started"), "a") as f:
            f.write(f"{time.time():.6f} {job.rank} {step} {a.work_how}\n")
        print(f"[faults] rank {job.rank}: {a.work_how} after step {step} for {a.work_seconds:.0f}s", flush=True)
        end = time.monotonic() + a.work_seconds
        if a.work_how == "compute":
            inner = copy.deepcopy(getattr(model, "module", model)).eval()  # the trained model's state is not touched
            batch = torch.randn(512, next(inner.parameters()).shape[-1], generator=torch.Generator().manual_seed(7))
            with torch.no_grad():
                while time.monotonic() < end:
                    inner(batch)
        elif a.work_how == "save":
            ballast = torch.ones(4 * 2**20)
            path = os.path.join(a.work_dir, f"ckpt-{job.rank}.pt")
            while time.monotonic() < end:
                torch.save({"model": model.state_dict(), "ballast": ballast}, path)
        elif a.work_how == "gpu":
            try:
                time.sleep(a.work_seconds)
            finally:
                open(self.gpu_pids, "w").close()
        elif a.work_how == "sleep":
            time.sleep(3600)
        elif a.work_how == "fifo":
            fifo = os.path.join(a.work_dir, f"fifo-{os.getpid()}")
            os.mkfifo(fifo)
            with open(fifo) as f:  # nobody opens it for writing: blocks in open()
                f.read()
        else:
            import threading

            first, second = threading.Lock(), threading.Lock()

            def other():
                with second:
                    time.sleep(0.2)
                    with first:
                        pass

            threading.Thread(target=other, daemon=True).start()
            with first:
                time.sleep(0.2)
                with second:
                    pass


class ChaosDir:
    """Repeated fault injection for a long run (the chaos soak, ``bench/chaos.py``): ``--chaos-dir DIR``.

    * ``DIR/kill.<rank>`` holding "<phase> <step>" arms one SIGKILL of the rank's worker at that
      phase of the first step >= <step>. A phase of the script (``kill``, called at the script's
      points) is fired by the worker that gets there first: it renames the file to
      ``kill.<rank>.fired.<pid>`` (its mtime: when the fault happened) and SIGKILLs itself, so the
      kill fires once however many processes hold the rank. A runtime point (``RUNTIME_POINTS``:
      ``vote``, ``snapshot``...) is taken at the step's start (``start_step``): the worker renames
      the file to ``kill.<rank>.armed.<pid>`` and arms ``TM_FAILPOINT`` in its own environment,
      whose marker ``kill.<rank>.fired.<pid>`` the runtime creates as it fires.
    * ``DIR/slow.<node>``: that node's workers are slower (a straggler) while it exists.
    * ``DIR/hold``: training holds at the top of the next step while it exists.
    * ``DIR/fast``: the stand-in for compute (``--step-sleep``) is dropped.
    * ``DIR/end`` holding N: the run ends after N steps (the remaining steps do nothing).
    """

    def __init__(self, path: str | None, name: str = "faults"):
        self.path, self.name = path, name

    def __bool__(self) -> bool:
        return bool(self.path)

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _armed(self, rank: int) -> tuple[str, int] | None:
        try:
            with open(self._file(f"kill.{rank}")) as f:
                phase, step = f.read().split()
            return phase, int(step)
        except (OSError, ValueError):
            return None

    def kill(self, job, step: int | None, phase: str) -> None:
        """Fire an armed ``DIR/kill.<rank>`` of this script ``phase`` once: rename it, then SIGKILL."""
        if not self.path or job.in_sandbox or step is None:
            return
        armed = self._armed(job.rank)
        if armed is None or armed[0] != phase or step < armed[1]:
            return
        path = self._file(f"kill.{job.rank}")
        fired = f"{path}.fired.{os.getpid()}"
        try:
            # Its mtime (when the fault happened) before the rename, not after: the soak's driver
            # renames a fired trigger as soon as it sees it, and a utime after the rename then
            # failed and read as "another process fired it": the worker lived on (seen once).
            os.utime(path)
            os.rename(path, fired)
        except OSError:
            return  # another process of this rank fired it
        print(f"[{self.name}] rank {job.rank}: chaos SIGKILL at step {step} ({phase})", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def start_step(self, job, step: int) -> None:
        """At the top of a step: take an armed kill at a runtime point (``TM_FAILPOINT``) for
        this process; the runtime fires it at the first step >= the armed one."""
        if not self.path or job.in_sandbox:
            return
        armed = self._armed(job.rank)
        if armed is None or armed[0] not in RUNTIME_POINTS:
            return
        path = self._file(f"kill.{job.rank}")
        try:
            os.rename(path, f"{path}.armed.{os.getpid()}")
        except OSError:
            return  # another process of this rank took it
        os.environ["TM_FAILPOINT"] = f"{RUNTIME_POINTS[armed[0]]}:{job.rank}:{armed[1]}:{path}.fired.{os.getpid()}"
        print(f"[{self.name}] rank {job.rank}: chaos SIGKILL armed at {armed[0]} of step >= {armed[1]}", flush=True)

    def end(self, steps: int) -> int:
        """``DIR/end`` (written once, well ahead of every rank): the run ends after that many
        steps; ``steps`` while there is none."""
        if not self.path:
            return steps
        try:
            with open(self._file("end")) as f:
                return int(f.read())
        except (OSError, ValueError):
            return steps

    def over(self, step: int) -> bool:
        """The soak is over at ``step``: the script ends its loop there (``job.end_loop()``, then
        ``break``: the worker counts as finished, not as having left), so the state is that of a
        run of exactly ``end`` steps, however many the budget allowed."""
        return step >= self.end(step + 1)

    def hold(self, job) -> None:
        """Wait at the top of a step while ``DIR/hold`` exists."""
        while self.path and not job.in_sandbox and os.path.exists(self._file("hold")):
            time.sleep(0.02)

    def fast(self) -> bool:
        return bool(self.path) and os.path.exists(self._file("fast"))

    def slow(self) -> bool:
        """This node (``TM_NODE_ID``) is a straggler now."""
        return bool(self.path) and os.path.exists(self._file(f"slow.{os.environ.get('TM_NODE_ID')}"))
