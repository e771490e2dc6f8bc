"""The contract between a node's agent and its workers: everything that crosses that boundary.

The agent (``tm_launch.launcher``) and each training process (``tm_launch.worker``) talk through
two channels only: the environment the agent starts a worker with (``WorkerEnv``) and the
agent's own TCPStore, a local key-value store on the node (``WorkerKeys`` and the records
below). Both sides import this module and nothing of each other, so a field added to a record is
one edit here plus its readers, which a type checker finds.

Through the agent's store:

* agent -> worker: one ``Directive`` per generation (``directive_key``), the newest number in
  ``LATEST``, and that number pushed onto each worker's queue (``WorkerKeys.directives``), where
  the worker's watch thread blocks (no polling on either side);
* worker -> agent: its ``WorkerStatus`` (step, state, step times), a heartbeat, the mark that
  it uses the live API, what it measured entering a generation (``EnteredRecord``), its first
  step in one (``FirstStepRecord``), and why it ends when no live rank holds some state
  (``StateLostRecord``, with the exit code ``EXIT_STATE_LOST``).

torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ...) are torchrun's contract and
keep its meaning; ``WorkerEnv`` reads the ones the runtime needs beside tm-launch's own ``TM_*``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, make_dataclass
from enum import Enum

from . import settings
from .settings import Variable

# -- the environment --------------------------------------------------------------------------

EXIT_STATE_LOST = 3  # a worker's exit code when no live rank holds some rank's state (``StateLostRecord``)
EXIT_REFUSED = 4  # a worker's exit code when the job cannot run as configured (``RefusedRecord``): no restart helps
EXIT_SCRIPT_ERROR = 1  # a worker's exit code when the script raised (``ScriptErrorRecord``), as ``python SCRIPT`` exits


# TORCH_NCCL_ASYNC_ERROR_HANDLING modes (torch's ErrorHandlingMode).
NCCL_NO_HANDLING, NCCL_TEAR_DOWN, NCCL_CLEANUP_ONLY, NCCL_SKIP_CLEANUP = "0", "1", "2", "3"


def nccl_error_handling(live: bool, user_value: str | None) -> str:
    """The ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` a worker gets.

    Live mode: 2 (clean up only). When a collective fails or times out, NCCL's watchdog aborts
    that communicator and fails its pending works, so the survivor's wait raises and its
    stream is freed, and the process lives on to enter the next generation. The worker sets it
    itself when it starts live mode (``communicators.live_process_environment``), from what the
    agent gave it: every worker starts with torchrun's value, since a script that never calls
    ``tm_launch.init()`` runs in restart mode. 1 (tear down) and
    3 (tear down, skip clean-up) kill the survivor on the first NCCL error, which is what live
    substitution exists to avoid, so they are overridden; 0 (no handling) is honoured when the
    user asks for it (the runtime then has to call ``abort`` itself, or a timed-out kernel
    keeps its stream busy for ever).  Restart mode: every worker restarts anyway, so the
    user's value, else 1 (tear down, the fastest way out), as torchrun gives it.
    """
    if live:
        return user_value if user_value in (NCCL_NO_HANDLING, NCCL_CLEANUP_ONLY) else NCCL_CLEANUP_ONLY
    return user_value or NCCL_TEAR_DOWN


# tm-launch's options that reach the worker are declared in ``tm_launch.settings``; these are the
# variables the agent decides per node and per process (every TM_* one is tm-launch's).
_PER_PROCESS = (
    Variable("agent_store", "TM_AGENT_STORE", str, None),  # "host:port" of the agent's TCPStore
    Variable("wake", "TM_AGENT_WAKE", str, None),  # the agent's wake socket (``tm_launch.launcher.wakeup``)
    Variable("local_addr", "TM_LOCAL_ADDR", str, None),  # the address this node's communicators listen on
    Variable("generation", "TM_GENERATION", int, 0),  # the generation the worker was started in
    Variable("sandbox", "TM_SANDBOX", bool, True),  # start in the sandbox (a spare, or a process joining a running job)
    Variable("straggler_window", "TM_STRAGGLER_WINDOW", int, 20),  # health.straggler_window
    Variable("exit_notice", "TM_EXIT_NOTICE", int, -1),  # the inherited descriptor of its exit page (tm_launch.exit_page; -1: none)
    Variable("telemetry", "TM_TELEMETRY", str, ""),  # its collective-telemetry page (tm_launch.collective_page; "": none)
)
# torchrun's variables, as torchrun sets them
_TORCHRUN = (
    Variable("local_rank", "LOCAL_RANK", int, 0),
    Variable("rank", "RANK", int, 0),
    Variable("world_size", "WORLD_SIZE", int, 1),
    Variable("local_world_size", "LOCAL_WORLD_SIZE", int, 1),
    Variable("group_rank", "GROUP_RANK", int, 0),
)
WORKER_VARIABLES = _PER_PROCESS + settings.worker_variables() + _TORCHRUN


@dataclass(frozen=True)
class WorkerEnv(make_dataclass("WorkerEnvFields", [v.as_field() for v in WORKER_VARIABLES], frozen=True)):
    """What the agent tells a worker at its start, read once from the environment: one
    attribute per ``WORKER_VARIABLES`` entry (``no_live``, ``node_id``, ``sandbox_steps``,
    ``collective_timeout``, ``setup_timeout`` (``--join-timeout``), ``snapshot_*`` come from
    ``tm_launch.settings``).

    ``agent_store`` is None outside tm-launch's agent (plain torchrun): the worker then runs as
    under torchrun. ``no_live``: ``tm-launch --no-live`` (restart mode for every script)."""

    VARIABLES = {v.field: v.name for v in WORKER_VARIABLES}  # field -> variable (the TM_* ones are tm-launch's)
    OWN = tuple(v for v in VARIABLES.values() if v.startswith("TM_"))

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        env = os.environ if environ is None else environ
        values = {v.field: v.decode(env[v.name]) for v in WORKER_VARIABLES if env.get(v.name)}
        if "rank" not in values:
            values["rank"] = values.get("local_rank", 0)
        return cls(**values)

    def tm_variables(self) -> dict[str, str]:
        """tm-launch's own variables (``TM_*``) as the agent sets them for a worker; torchrun's
        are set beside them by the agent, as torchrun sets them."""
        out = {}
        for v in WORKER_VARIABLES:
            value = getattr(self, v.field)
            if v.name.startswith("TM_") and value is not None:
                out[v.name] = v.encode(value)
        if not self.no_live:
            out.pop("TM_NO_LIVE")  # unset: the worker may go live
        if self.exit_notice < 0:
            out.pop("TM_EXIT_NOTICE")  # set by the worker's start (processes.Worker), where it has a page
        if not self.telemetry:
            out.pop("TM_TELEMETRY")
        return out

    @property
    def under_agent(self) -> bool:
        """Started by a tm-launch agent (it reports to it), live or not."""
        return bool(self.agent_store)

    @property
    def live(self) -> bool:
        """``tm_launch.init()`` gives a live job: under an agent and not ``--no-live``."""
        return self.under_agent and not self.no_live

    @property
    def starts_as_spare(self) -> bool:
        """A spare in its sandbox: no group rank yet (torchrun's ``GROUP_RANK`` is -1 for it)."""
        return self.sandbox and self.group_rank == -1


# -- the agent's store ------------------------------------------------------------------------

LATEST = "node/latest"  # the newest generation handed over (a counter: ``store.add(LATEST, 0)`` reads it)
CLOSE = "close"  # ``close <pid>`` on a worker's queue ends that process's watch thread


def directive_key(generation: int) -> str:
    return f"node/plan/{generation}"


@dataclass(frozen=True)
class WorkerKeys:
    """The keys of one local worker in its agent's store."""

    local_rank: int

    def _key(self, what: str) -> str:
        return f"worker/{self.local_rank}/{what}"

    @property
    def directives(self) -> str:
        """The queue the agent pushes every newer generation's number onto."""
        return self._key("directives")

    @property
    def status(self) -> str:
        return self._key("status")

    @property
    def beat(self) -> str:
        return self._key("beat")

    @property
    def live(self) -> str:
        return self._key("live")

    @property
    def state_lost(self) -> str:
        return self._key("state_lost")

    @property
    def refused(self) -> str:
        return self._key("refused")

    @property
    def script_error(self) -> str:
        return self._key("script_error")

    def entered(self, generation: int) -> str:
        return self._key(f"entered/{generation}")

    def first_step(self, generation: int) -> str:
        return self._key(f"first_step/{generation}")

    def restarted(self) -> tuple[str, ...]:
        """What a new process of this local rank must not inherit from the one before it (the
        hang watchdog would read the old heartbeat as the new process's)."""
        return self.status, self.beat, self.state_lost, self.refused, self.script_error


# -- records ----------------------------------------------------------------------------------


class _Record:
    """JSON form of a dataclass record: unknown keys are ignored, missing ones take defaults."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes):
        data = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class StoreAddress:
    """Where a generation's bootstrap store lives (an agent's TCPStore on some node)."""

    addr: str
    port: int
    node: str = ""

    @classmethod
    def from_plan(cls, entry: Mapping | None) -> StoreAddress | None:
        if not entry or not entry.get("addr") or not entry.get("port"):
            return None
        return cls(str(entry["addr"]), int(entry["port"]), str(entry.get("node", "")))


@dataclass(frozen=True)
class Directive:
    """What generation ``generation`` asks of this node's workers."""

    generation: int
    active: bool  # this node holds ranks in it (else: a spare, or it left)
    ranks: tuple[int, ...] = ()  # global rank of each local rank (active nodes)
    group_rank: int | None = None
    world_size: int = 0
    store: StoreAddress | None = None  # the generation's bootstrap store
    standby: StoreAddress | None = None  # where it moves if the store's node is lost
    joiner_ranks: tuple[int, ...] = ()  # ranks served by a new process in this generation
    all_fresh: bool = False  # every process of this generation is new
    planned: bool = False  # a drain or migration: switch at an agreed step
    live: bool = True
    stop: bool = False  # the job is over
    # Why the generation was made (its plan's cause: a lost node, a script error and its
    # signature): a worker that raises the error named there again prints one line, not the
    # traceback printed when the error was first raised.
    cause: str = ""

    def rank_of(self, local_rank: int) -> int:
        """The global rank of ``local_rank`` in this generation; -1 when this node holds none."""
        return self.ranks[local_rank] if self.active else -1

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str | bytes) -> Directive:
        data = json.loads(text)
        data["ranks"] = tuple(data.get("ranks") or ())
        data["joiner_ranks"] = tuple(data.get("joiner_ranks") or ())
        for where in ("store", "standby"):
            entry = data.get(where)
            data[where] = StoreAddress(**entry) if entry else None
        return cls(**data)


class WorkerState(str, Enum):
    """Where a worker is in its life, as its status says (``WorkerStatus.state``)."""

    STARTED = "started"  # restart mode, before its first step report
    SANDBOX = "sandbox"  # built its job, warms up without peers
    WARMUP = "warmup"  # running its warm-up steps
    PARKED = "parked"  # a warmed-up spare waiting to be named
    ENTERING = "entering"  # entered before its framework's loop runs (``enter_before_loop``)
    RUNNING = "running"  # training (a live worker in ``job.steps()``, or a restart-mode worker that reports steps)
    RECOVERING = "recovering"  # a collective failed: waiting for the next generation
    LEFT = "left"  # left the job (drained, replaced, or its loop was left early)
    FINISHED = "finished"  # its steps ran out
    EXITING = "exiting"  # restart mode: the interpreter is exiting

    @property
    def watched(self) -> bool:
        """Does the agent's hang watchdog watch a worker in this state? From its first step
        (live) or its first step report (restart mode) on: a worker that never reports a step
        is never watched (its script may simply not report, and nothing says how long it may
        stay silent: compiling, loading data)."""
        return self in (WorkerState.RUNNING, WorkerState.RECOVERING)

    @property
    def trained(self) -> bool:
        """A state whose step counts on the job's step series (``ctl timeline``)."""
        return self in (WorkerState.RUNNING, WorkerState.RECOVERING, WorkerState.FINISHED, WorkerState.LEFT)


@dataclass(frozen=True)
class WorkerStatus(_Record):
    """A worker's report of itself (written at most every ``STATUS_INTERVAL`` s, and at once on a
    change of state): read by the hang watchdog, the straggler statistic and ``ctl status``."""

    state: WorkerState = WorkerState.STARTED
    step: int | None = None  # completed steps (the global step count)
    generation: int = 0
    rank: int = -1
    time: float = 0.0
    pid: int = 0
    mode: str = "live"  # "restart": a loop of its own reports its steps
    waiting_for_peers: bool = False  # its commit vote has waited long for a peer
    why: str = ""  # what it waits for a new generation for (state recovering)
    step_time: float = 0.0  # median of the recent steps
    step_times: list = field(default_factory=list)
    steps_run: int = 0
    compute: list = field(default_factory=list)
    windows: dict = field(default_factory=dict)  # completed straggler windows: {index: summed compute seconds}
    snapshot_bytes: int = 0  # host memory its snapshots take (its own and what it holds for another rank)
    snapshot_sent: int = 0  # bytes of snapshots it sent to its holder so far
    snapshot_held: int = 0  # of snapshot_bytes, what it keeps for other ranks (a copy, or stripes of a parity)
    # Restart mode: the timeout its default group's collectives run under (the script's
    # ``init_process_group(timeout=...)``, else the backend's), seconds; 0: not known. The agent
    # waits that long for a busy worker. A live worker's is on its collective page.
    collective_timeout: float = 0.0

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerStatus:
        status = super().from_json(text)
        return dataclasses.replace(status, state=WorkerState(status.state))


STATUS_INTERVAL = 0.25  # seconds between two status writes of one worker


@dataclass(frozen=True)
class EnteredRecord(_Record):
    """What a worker measured entering a live generation (``tm_launch.joblog`` reads it)."""

    communicator: float  # seconds to build its communicators (picking the directive up included)
    state: float  # seconds to agree on the step and transfer the state
    received: bool  # it received its state from a peer
    step: int | None = None  # the step it holds after entering
    began: float = 0.0  # wall clock when it began entering
    last_step_at: float | None = None  # wall clock of its last clean step before the change
    store_connects: int = 0  # store connections it had to open on the way (none were ready)
    tcp_opened: int | None = None  # TCP connections it opened while entering (tm_launch.worker.comms.connections)
    groups_rebuilt: int = 0  # communicators it built: the world and each subgroup whose membership changed


@dataclass(frozen=True)
class FirstStepRecord(_Record):
    """A worker completed its first step in a generation."""

    time: float
    step: int | None


@dataclass(frozen=True)
class StateLostRecord(_Record):
    """Why a worker ends with ``EXIT_STATE_LOST``: no live rank holds the state of ``ranks``."""

    step: int
    ranks: list
    why: str


@dataclass(frozen=True)
class RefusedRecord(_Record):
    """Why a worker ends with ``EXIT_REFUSED``: the job cannot run as configured (snapshots that
    would not fit in ``--snapshot-memory-limit``); the agent fails the job with this line."""

    why: str


@dataclass(frozen=True)
class ScriptErrorRecord(_Record):
    """Why a worker ends with ``EXIT_SCRIPT_ERROR``: the script raised out of its top level (its
    traceback went to the worker's stderr). The agent reports it as a script error; the planner
    fails the job when the same error comes back (``rendezvous.script_errors``)."""

    type: str  # the exception's class name ("ValueError")
    message: str  # its message, first line, at most 300 characters
    step: int | None  # the step the job was at (``None``: before job.steps())
    rank: int

    def signature(self) -> str:
        """What must be equal for two raises to count as the same error (the rank is not part of it)."""
        where = "before the first step" if self.step is None else f"at step {self.step}"
        return f"{self.type}: {self.message} {where}"
