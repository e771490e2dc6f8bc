"""Worker processes of one node: start, watch, stop; output handled like torchrun's.

torch's ``PContext`` starts and stops a worker group as one unit; live substitution needs a
spare's parked workers to outlive generations and a node's workers to be stopped while its
neighbours keep theirs, so tm-launch keeps this small manager. Two things it adds:

* every worker gets ``PR_SET_PDEATHSIG=SIGKILL``: when an agent dies, its workers die with it,
  so a lost node never leaves processes that still own ranks;
* each worker runs in its own session, so a signal to the agent's terminal is not a signal to
  the workers (the agent decides what they get, like torchrun).

Output follows torchrun's ``--redirects``/``--tee``/``--log-dir``/``--local-ranks-filter``:
files under ``LOG_DIR/<run id>_<random>/attempt_<restart count>/<local rank>/{stdout,stderr}.log``
(torchrun's layout: one ``<run id>_<random>`` directory per agent, ``attempt_N`` for the N-th
restart of this agent's workers, ``error.json`` beside the logs), and console lines prefixed
``[<role><local rank>]:`` when teed. A failed worker is reported with torchrun's root-cause block
(``ChildFailedError.format_msg``: the traceback and file:line from its ``@record`` error file).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import exit_page
from ..protocol import WorkerEnv
from .exit_notice import ExitNotice
from .wakeup import watch_exit

PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def _child_setup() -> None:
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    os.setsid()


@dataclass
class OutputSpec:
    log_dir: str | None = None
    redirects: dict[int, int] = field(default_factory=dict)  # local rank -> Std bits (1 out, 2 err)
    tee: dict[int, int] = field(default_factory=dict)
    shown: set[int] | None = None  # --local-ranks-filter; None shows all
    role: str = "default"


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class Worker:
    def __init__(
        self,
        local_rank: int,
        cmd: list[str],
        env: dict[str, str],
        out: OutputSpec,
        attempt_dir: str | None,
        on_exit: Callable[[], None] | None = None,
        exit_notice: bool = False,
    ):
        self.local_rank = local_rank
        self.started = time.time()
        self.killed = False  # the agent killed it (a hang): it is on its way out
        self._threads: list[threading.Thread] = []
        self._files = []
        self.stderr_log: tuple[str, int] | None = None  # (stderr.log, its size before this worker wrote to it)
        streams, pipes = {}, {}
        for bit, name in ((1, "stdout"), (2, "stderr")):
            teed = out.tee.get(local_rank, 0) & bit
            redirected = out.redirects.get(local_rank, 0) & bit
            hidden = out.shown is not None and local_rank not in out.shown
            path = os.path.join(attempt_dir, str(local_rank), f"{name}.log") if attempt_dir and (teed or redirected) else None
            if path:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                if name == "stderr":  # an attempt directory may be reused: this worker's part starts here
                    self.stderr_log = (path, os.path.getsize(path) if os.path.exists(path) else 0)
            if teed:
                streams[name] = subprocess.PIPE
                pipes[name] = (path, None if hidden else getattr(sys, name), f"[{out.role}{local_rank}]:".encode())
            elif path:
                fh = open(path, "ab")
                self._files.append(fh)
                streams[name] = fh
            else:
                streams[name] = subprocess.DEVNULL if hidden else None
        # A live worker's exit is known as it begins, before the kernel frees its memory (exit_page).
        self.notice = ExitNotice(on_exit or (lambda: None)) if exit_notice and exit_page.supported() else None
        fds = []
        if self.notice is not None:
            env = {**env, WorkerEnv.VARIABLES["exit_notice"]: str(self.notice.fd)}
            fds.append(self.notice.fd)
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=streams["stdout"], stderr=streams["stderr"], preexec_fn=_child_setup, pass_fds=fds
        )
        if self.notice is not None:
            self.notice.watch()
        if on_exit is not None:
            watch_exit(self.proc.pid, on_exit)  # the agent hears of the exit at once, not at its next tick
        for name, spec in pipes.items():
            t = threading.Thread(target=_pump, args=(getattr(self.proc, name), *spec), daemon=True)
            t.start()
            self._threads.append(t)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def flush_output(self) -> None:
        """Wait (briefly) until teed output of an exited worker has reached its files."""
        for t in self._threads:
            t.join(timeout=1)

    def began_to_exit(self) -> bool:
        """Its exit began (the notice came) and it has not been reaped yet."""
        return self.notice is not None and self.notice.began_at is not None and self.poll() is None

    def close(self) -> None:
        self.flush_output()
        for fh in self._files:
            fh.close()
        if self.notice is not None:
            self.notice.close()


def runs_live_wrapper(cmd: list[str]) -> bool:
    """``cmd`` runs a Python worker through live mode's wrapper (``python -u -m tm_launch.worker
    SCRIPT``, see cli), which arms the worker's exit notice."""
    return cmd[2:4] == ["-m", "tm_launch.worker"]


def _error_file_ok(path: str) -> bool:
    """Whether torch's ProcessFailure can read ``path`` (it raises, with a logged traceback, on a
    malformed one: a worker's file is input, so a bad one is reported as absent)."""
    try:
        with open(path) as f:
            message = json.load(f)["message"]
        if not isinstance(message, str):
            int(message["extraInfo"]["timestamp"])
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _summary(message) -> str:
    """One line for a root cause: the exception line plus the innermost ``file:line``."""
    if isinstance(message, dict):
        stack = str(message.get("extraInfo", {}).get("py_callstack", ""))
        frames = re.findall(r'File "([^"]+)", line (\d+)', stack)
        text = str(message.get("message", "")).strip()
        where = f" (at {frames[-1][0]}:{frames[-1][1]})" if frames else ""
    else:
        text, where = str(message or "").strip(), ""
    first = text.splitlines()[0][:300] if text else ""
    return first + where if first else ""


def _stderr_summary(path: str, start: int) -> str:
    """The root cause of a worker that wrote no error file (no ``@record``), from its stderr log
    (from offset ``start``: its own part): the last traceback's exception line and innermost
    ``file:line``; empty if there is none."""
    try:
        with open(path, "rb") as f:
            f.seek(max(start, os.path.getsize(path) - 65536))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    last = text.rfind("Traceback (most recent call last):")
    lines = text[last:].splitlines()[1:] if last >= 0 else []
    exception = next((line for line in lines if line.strip() and not line.startswith(" ")), "")
    return _summary({"message": exception, "extraInfo": {"py_callstack": "\n".join(lines)}}) if exception else ""


def _pump(pipe, path: str | None, console, prefix: bytes) -> None:
    fh = open(path, "ab") if path else None
    try:
        for line in iter(pipe.readline, b""):
            if fh:
                fh.write(line)
                fh.flush()
            if console is not None:
                console.buffer.write(prefix + line)
                console.flush()
    finally:
        if fh:
            fh.close()


class WorkerSet:
    """The workers this agent runs right now (a generation's, or a spare's parked ones).

    ``restarts`` is torchrun's ``TORCHELASTIC_RESTART_COUNT`` for this agent: how many times its
    own workers failed and were started again (the agent counts them); it names the attempt
    directory. Workers restarted because of another node's failure keep the count, as under
    torchrun, and append to the same attempt's logs."""

    def __init__(self, cmd: list[str], out: OutputSpec, run_id: str, scratch: str, on_exit: Callable[[], None] | None = None):
        self.cmd = cmd
        self.on_exit = on_exit
        self.out = out
        self.run_id = run_id
        self.log_root = out.log_dir or scratch  # error files go somewhere even without --log-dir
        self._run_dir: str | None = None
        self.workers: dict[int, Worker] = {}
        self.generation = -1
        self.restarts = 0
        self.kind = ""  # "fresh" | "sandbox"

    def attempt_dir(self) -> str:
        """``<log root>/<run id>_<random>/attempt_<restarts>`` (torchrun's DefaultLogsSpecs)."""
        if self._run_dir is None:
            os.makedirs(self.log_root, exist_ok=True)
            self._run_dir = tempfile.mkdtemp(prefix=f"{self.run_id}_", dir=self.log_root)
        return os.path.join(self._run_dir, f"attempt_{self.restarts}")

    def error_file(self, local_rank: int) -> str:
        """``TORCHELASTIC_ERROR_FILE``: where a worker decorated with torch's @record writes its exception."""
        path = os.path.join(self.attempt_dir(), str(local_rank), "error.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return path

    def start(self, envs: dict[int, dict[str, str]], generation: int, kind: str) -> None:
        from torch.distributed.elastic.utils import macros

        attempt_dir = self.attempt_dir() if self.out.log_dir else None
        for local_rank, env in sorted(envs.items()):
            try:  # a previous worker's error must never be read as this one's
                os.unlink(self.error_file(local_rank))
            except FileNotFoundError:
                pass
            cmd = macros.substitute(list(self.cmd), str(local_rank))
            self.workers[local_rank] = Worker(local_rank, cmd, env, self.out, attempt_dir, self.on_exit, runs_live_wrapper(self.cmd))
        self.generation = generation
        self.kind = kind

    def failure_report(self, ranks: list[int]) -> tuple[str, str]:
        """torchrun's report of this set's failed workers (``ChildFailedError.format_msg``: the
        root cause's traceback, from its error file) and a one-line summary of the root cause
        (``ValueError: boom (at train.py:42)``, from the error file, else from a stderr log;
        empty without either). ``ranks``: global rank per local rank."""
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
        from torch.distributed.launcher.api import _get_entrypoint_name

        failures = {}
        for lr, code in sorted(self.poll().items()):
            if code not in (None, 0):
                path = self.error_file(lr)
                readable = _error_file_ok(path)
                failures[ranks[lr] if lr < len(ranks) else lr] = ProcessFailure(
                    local_rank=lr, pid=self.workers[lr].pid, exitcode=code, error_file=path if readable else os.devnull
                )
        if not failures:
            return "", ""
        args = list(self.cmd[1:])
        if runs_live_wrapper(self.cmd):  # name the script, as torchrun
            del args[1:3]
        error = ChildFailedError(name=_get_entrypoint_name(self.cmd[0], args), failures=failures)
        _, root = error.get_first_failure()
        if os.path.isfile(root.error_file):
            return error.format_msg(), _summary(root.message)
        worker = self.workers[root.local_rank]
        if root.exitcode > 0 and worker.stderr_log:  # an uncaught exception's traceback is the last one
            worker.flush_output()
            return error.format_msg(), _stderr_summary(*worker.stderr_log)
        return error.format_msg(), ""

    def __bool__(self) -> bool:
        return bool(self.workers)

    def pids(self) -> dict[int, int]:
        return {lr: w.pid for lr, w in self.workers.items()}

    def poll(self) -> dict[int, int | None]:
        return {lr: w.poll() for lr, w in self.workers.items()}

    def failed(self) -> tuple[int, int] | None:
        """(local rank, exit code) of the first worker that exited non-zero, if any."""
        for lr, code in sorted(self.poll().items()):
            if code not in (None, 0):
                return lr, code
        return None

    def forget(self, local_rank: int) -> None:
        """Count an exited worker as succeeded (it finished its work before it died)."""
        worker = self.workers.get(local_rank)
        if worker is not None and worker.poll() is not None:
            worker.proc.returncode = 0

    def all_succeeded(self) -> bool:
        codes = self.poll()
        return bool(codes) and all(c == 0 for c in codes.values())

    def kill(self, local_rank: int, sig: int = signal.SIGKILL) -> None:
        if local_rank in self.workers:
            self.workers[local_rank].killed = True
            self.workers[local_rank].signal(sig)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds (torchrun's order)."""
        alive = [w for w in self.workers.values() if w.poll() is None]
        for w in alive:
            w.signal(signal.SIGTERM)
        deadline = time.time() + grace
        while time.time() < deadline and any(w.poll() is None for w in alive):
            time.sleep(0.02)
        for w in alive:
            if w.poll() is None:
                w.signal(signal.SIGKILL)
        for w in self.workers.values():
            try:
                w.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            w.close()
        self.workers = {}
        self.kind = ""
