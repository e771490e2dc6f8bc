"""tm-launch's own settings, each declared once: ``SETTINGS``.

Why a table: a setting used to be spelled by hand in six places (the parser, its validation,
``cli.py`` building ``AgentConfig``, ``AgentConfig``'s field, the supervisor writing the worker's
variable, ``WorkerEnv`` reading it), and a new one that missed a place failed silently. A
``Setting`` says everything about one: its option, help and metavar, its type and default, the
values it refuses, and whether it reaches the workers (the ``TM_*`` variable and the
``WorkerEnv`` attribute). Derived from it:

* the ``tm-launch`` group of the parser (``tm_launch.launcher.options``), and so the YAML keys
  (a setting's name) and their type checks (the command line's);
* their validation (``Setting.problem``, the one-line ``UsageError`` text);
* ``AgentConfig``'s setting fields (``agent_fields``), filled by ``cli.py`` from ``values``;
* the worker's environment (``worker_variables``): the agent writes it (``to_worker``,
  ``protocol.WorkerEnv.tm_variables``), the worker reads it (``protocol.WorkerEnv``).

torchrun's options stay torchrun's (``torch.distributed.run.get_args_parser()``, with their
``PET_*`` variables); the ``health:`` keys are ``health.config.HealthConfig``'s fields. Stdlib
only: every training process imports this through ``tm_launch.protocol``.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# When a rank's snapshot must be on its holder (``--snapshot-send``): before the snapshot's step
# commits ("commit": a fault runs at most one step before the interrupted one again), or while
# the next step runs ("overlap": cheaper where the send outlasts a step's compute; a fault while
# it is on its way returns the job one step further).
SNAPSHOT_SENDS = ("commit", "overlap")

# torch's default collective timeouts (``torch.distributed.constants``: ``default_pg_timeout``,
# ``default_pg_nccl_timeout``): what ``--collective-timeout 0`` (the default) gives each backend.
BACKEND_TIMEOUTS = {"gloo": 1800.0, "nccl": 600.0}
# The agent's bound on a stall it waits out when no --collective-timeout was given: fencing (a
# node cut off from etcd whose workers made no step for this long stops them) and the waits for
# leaving workers (``plan_executor``). 120 s was --collective-timeout's default before it
# followed the backend; a cut-off node's collectives block for the backend's 30 minutes now, and
# fencing must not wait that long.
STALL_BOUND = 120.0


def chosen_timeout(given: float, script: float) -> float:
    """The seconds a job's collectives were told to wait (0: nobody said): ``given`` when set
    (``--collective-timeout``, the YAML), else ``script``, the ``timeout=`` the script handed
    ``tm_launch.init`` or ``init_process_group`` (torch honours that one under torchrun)."""
    return given if given > 0 else script if script > 0 else 0.0


def collective_timeout(given: float, backend: str, script: float = 0.0) -> float:
    """The timeout of a group's ``backend`` ("gloo" or "nccl"): the chosen one (``chosen_timeout``),
    else torch's default for that backend."""
    return chosen_timeout(given, script) or BACKEND_TIMEOUTS[backend]


def stall_bound(given: float) -> float:
    """The agent's bound on a stalled collective (``STALL_BOUND`` unless --collective-timeout says)."""
    return given if given > 0 else STALL_BOUND


@dataclass(frozen=True)
class Variable:
    """One variable of a worker's environment and the ``WorkerEnv`` attribute it is read into.

    Encoded as the agent writes it: a bool as "1"/"0", anything else as ``str``; an empty or
    missing variable leaves the attribute at ``default``."""

    field: str
    name: str
    kind: type  # bool, int, float or str
    default: Any

    def decode(self, raw: str) -> Any:
        if self.kind is bool:
            return raw == "1"
        return self.kind(raw)

    @staticmethod
    def encode(value: Any) -> str:
        return ("1" if value else "0") if isinstance(value, bool) else str(value)

    def as_field(self) -> tuple:
        """``(name, type, field)`` for ``dataclasses.make_dataclass``."""
        return _field(self.field, self.kind, self.default)


@dataclass(frozen=True)
class ToWorker:
    """A setting that reaches each worker: under ``variable``, read into ``WorkerEnv.<field>``
    (the setting's own name when empty)."""

    variable: str
    field: str = ""


_SAME = object()  # Setting.resolved: the agent and the worker hold ``default`` when nothing decided otherwise


@dataclass(frozen=True)
class Setting:
    """One tm-launch option: the command line, the YAML key, ``AgentConfig`` and the worker."""

    name: str  # the option's destination: its YAML key and its AgentConfig field
    kind: type  # bool (a flag), int, float or str: its value's type
    default: Any  # the command line's default
    help: str
    flags: tuple[str, ...] = ()  # its spellings; () is --name-with-dashes
    metavar: str | None = None
    choices: tuple | None = None
    parse: Callable[[str], Any] | None = None  # the command line's conversion, when not ``kind`` (a size)
    check: Callable[[Any], str | None] | None = None  # what is wrong with a value ("must be ..."); None: fine
    pet: bool = False  # torchrun's convention: its PET_<NAME> variable sets it too (and beats YAML)
    resolved: Any = _SAME  # what AgentConfig and WorkerEnv hold when the agent decided nothing (default: ``default``)
    worker: ToWorker | None = None  # how it reaches the workers (None: the agent's alone)

    @property
    def option(self) -> str:
        """The spelling error messages use."""
        return self.flags[0] if self.flags else "--" + self.name.replace("_", "-")

    @property
    def unset(self) -> Any:
        return self.default if self.resolved is _SAME else self.resolved

    def problem(self, value: Any) -> str | None:
        """The one-line usage error for ``value`` (``--spares -1: must be 0 or more``); None when
        it is fine. No value (None) is always fine: the agent decides it."""
        if value is None or self.check is None:
            return None
        why = self.check(value)
        return None if why is None else f"{self.option} {value}: {why}"

    def argparse_kwargs(self) -> dict:
        """``add_argument``'s keywords, but ``action`` for a ``pet`` setting (torch's ``env``
        action, which the agent side adds: this module does not import torch)."""
        if self.kind is bool:
            return {"dest": self.name, "action": "store_true", "help": self.help}
        kwargs: dict = {"dest": self.name, "default": self.default, "help": self.help}
        conversion = self.parse or (None if self.kind is str else self.kind)
        if conversion is not None:
            kwargs["type"] = conversion
        if self.metavar:
            kwargs["metavar"] = self.metavar
        if self.choices:
            kwargs["choices"] = self.choices
        return kwargs

    @property
    def variable(self) -> Variable | None:
        """The worker's variable for it, None when it does not reach the workers."""
        if self.worker is None:
            return None
        return Variable(self.worker.field or self.name, self.worker.variable, self.kind, self.unset)


# -- values -----------------------------------------------------------------------------------


def parse_size(text) -> int:
    """``16GiB``, ``500MB``, ``1.5G``, ``1000000``: bytes (the command line's type, and YAML's)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    s = str(text).strip().lower().replace(" ", "")
    number = s.rstrip("kmgtib")
    unit = s[len(number) :]
    try:
        value = float(number) * _UNITS[unit]
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"'{text}' is no size: write bytes or a number with KiB, MiB, GiB, KB, MB or GB") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"'{text}': a size cannot be negative")
    return int(value)


_UNITS = {
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "b": 1,
    "": 1,
}


def at_least(low: float, why: str) -> Callable[[Any], str | None]:
    """A check: values below ``low`` are refused with ``why``."""
    return lambda value: None if value >= low else why


def above(low: float, why: str) -> Callable[[Any], str | None]:
    """A check: values at or below ``low`` are refused with ``why``."""
    return lambda value: None if value > low else why


def _parity_group(k: int) -> str | None:
    """0 is a whole copy; a parity needs a group of at least 2 nodes (1 would be a copy with extra steps)."""
    return None if k == 0 or k >= 2 else "must be 0 (a whole copy) or a group of 2 nodes or more"


def _tcp_port(port: int) -> str | None:
    return None if 0 <= port <= 65535 else "must be a TCP port number (0-65535; 0 picks a free one)"


def _three_ports(port: int) -> str | None:
    return None if 1 <= port <= 65533 else "must be a TCP port with two more after it (1-65533)"


# -- the table --------------------------------------------------------------------------------

SETTINGS: tuple[Setting, ...] = (
    Setting(
        "spares",
        int,
        0,
        "Spare nodes the job wants to keep warm; a warning is printed when it has fewer. Nodes that join beyond --nnodes MAX are spares.",
        check=at_least(0, "must be 0 or more"),
    ),
    Setting(
        "lease_ttl",
        float,
        5.0,
        "Seconds before a node that stopped refreshing its etcd lease counts as lost (default 5).",
        check=above(0, "must be positive seconds"),
    ),
    Setting(
        "node_id",
        str,
        None,
        "Name of this node in the job (default: HOSTNAME-PID). `tm-launch ctl drain NODE` uses it.",
        resolved="",  # cli.py names the node when the option does not
        worker=ToWorker("TM_NODE_ID"),
    ),
    Setting(
        "join_timeout",
        float,
        600.0,
        "Seconds to wait for the first generation to form before giving up (default 600).",
        worker=ToWorker("TM_SETUP_TIMEOUT", "setup_timeout"),  # joiners may start cold: they wait as long
    ),
    Setting("last_call", float, 1.0, "With --nnodes MIN:MAX, seconds to wait for more nodes once MIN are present (default 1)."),
    Setting(
        "collective_timeout",
        float,
        0.0,
        "Live mode: seconds a collective may block before a rank gives up on its peers (default 0: the script's own "
        "timeout= to tm_launch.init, else the backend's, as under torchrun: gloo 30 min, NCCL 10 min). A dead, stopped or stuck peer is found from its progress long "
        "before this; a busy one (an evaluation on one rank) is waited for until then.",
        check=at_least(0, "must be 0 (the backend's default) or positive seconds"),
        worker=ToWorker("TM_COLLECTIVE_TIMEOUT"),
    ),
    Setting(
        "sandbox_steps",
        int,
        2,
        "Live mode: steps a spare runs in its communication-free sandbox before it parks (default 2; "
        "one promoted to other ranks runs the script again with one step, two for a static-graph DDP, and DDP's bucket rebuild).",
        check=at_least(1, "must be at least 1"),
        worker=ToWorker("TM_SANDBOX_STEPS"),
    ),
    Setting(
        "snapshot_every",
        int,
        1,
        "Live mode: every N committed steps, each rank copies the state no other live rank replicates (FSDP/ZeRO/TP shards, "
        "pipeline stages without data-parallel peers) to host memory and to a rank on the next node, so that such layouts "
        "recover live too (default 1; 0: never, a lost shard then restarts the job from its checkpoint).",
        metavar="N",
        check=at_least(0, "must be 0 (never) or more"),
        worker=ToWorker("TM_SNAPSHOT_EVERY"),
    ),
    Setting(
        "audit_every",
        int,
        0,
        "Live mode: also every N steps (not only at the two step boundaries after each live recovery), the ranks "
        "compare an exact digest of every registered tensor with the ranks that should hold the same copy, and end "
        "live mode loudly on a difference (default 0: only after a recovery; it costs a pass over the state's bytes).",
        metavar="N",
        check=at_least(0, "must be 0 (only after a recovery) or more"),
        worker=ToWorker("TM_AUDIT_EVERY"),
    ),
    Setting(
        "snapshot_send",
        str,
        "commit",
        "Live mode: when a snapshot must be on its holder. commit (default): before its step commits, so a fault runs "
        "only the interrupted step again; overlap: while the next step runs (cheaper where the send outlasts a step's "
        "compute: a slow link, short steps), so a fault during a send also runs the step before again, and each rank and "
        "its holder keep three images instead of two.",
        choices=SNAPSHOT_SENDS,
        worker=ToWorker("TM_SNAPSHOT_SEND"),
    ),
    Setting(
        "snapshot_parity",
        int,
        0,
        "Live mode: keep, instead of a whole copy of each rank's snapshot on the next node, the XOR parity of the "
        "snapshots of K neighbouring nodes, cut in stripes kept on the nodes after them: each node keeps about 1/K of a "
        "snapshot for others instead of one; a lost rank's snapshot is rebuilt from the parity and the other K-1 ranks' own "
        "(K times the bytes to the joiner). Needs at least K+1 nodes (fewer: K shrinks to the nodes minus one). Default 0: a copy.",
        metavar="K",
        check=_parity_group,
        worker=ToWorker("TM_SNAPSHOT_PARITY"),
    ),
    Setting(
        "snapshot_memory_limit",
        int,
        None,
        "Live mode: host memory per node the snapshots may take (e.g. 16GiB, 500MB); snapshots that would need more "
        "are refused when training starts, with one line saying how much they need (default: half the node's memory).",
        metavar="SIZE",
        parse=parse_size,
        resolved=0,  # no limit; cli.py decides half the node's memory when the option is not given
        worker=ToWorker("TM_SNAPSHOT_MEMORY_LIMIT"),
    ),
    Setting(
        "no_live",
        bool,
        False,
        "Never substitute ranks in place: every generation restarts all workers (restart mode), even for scripts that use tm_launch.init().",
        worker=ToWorker("TM_NO_LIVE"),
    ),
    Setting(
        "etcd_nodes",
        str,
        None,
        "Embedded etcd (--rdzv-backend embedded-etcd, or no --rdzv-endpoint under Slurm): the job's nodes, in one order "
        "on every node, as a comma list or Slurm's form (gpu[01-08]); members run on the first three (default under "
        "srun: SLURM_JOB_NODELIST).",
        metavar="NODES",
    ),
    Setting(
        "etcd_port",
        int,
        2379,
        "Embedded etcd: a member's client port on its node; its peer port is the next one, its metrics port the one after (default 2379).",
        metavar="PORT",
        check=_three_ports,
    ),
    Setting(
        "etcd_loopback",
        bool,
        False,
        "Embedded etcd, several nodes on one machine (tests, rehearsals): every member listens on 127.0.0.1, the "
        "i-th node of --etcd-nodes on --etcd-port + 3i and the two ports after it.",
    ),
    Setting("event_log", str, None, "Append this agent's events as JSON lines to FILE.", metavar="FILE"),
    Setting(
        "metrics_port",
        int,
        None,
        "Serve this agent's Prometheus metrics on --local-addr:PORT (0: any free port; default off). "
        "Agents sharing a machine need one port each: set PET_METRICS_PORT per agent.",
        flags=("--metrics-port", "--metrics_port"),
        metavar="PORT",
        check=_tcp_port,
        pet=True,
    ),
)

BY_NAME: Mapping[str, Setting] = {s.name: s for s in SETTINGS}


# -- derived ----------------------------------------------------------------------------------


def _field(name: str, kind: type, default: Any) -> tuple:
    return name, (kind if default is not None else kind | None), dataclasses.field(default=default)


def agent_fields() -> list[tuple]:
    """``AgentConfig``'s setting fields (``make_dataclass`` form): each setting by its name."""
    return [_field(s.name, s.kind, s.unset) for s in SETTINGS]


def values(namespace: Any) -> dict[str, Any]:
    """Every setting's value from parsed options (an ``argparse.Namespace``), by name."""
    return {s.name: getattr(namespace, s.name) for s in SETTINGS}


def problems(namespace: Any) -> list[str]:
    """The usage errors of parsed options, in table order (empty: all fine)."""
    return [p for s in SETTINGS if (p := s.problem(getattr(namespace, s.name))) is not None]


def worker_variables() -> tuple[Variable, ...]:
    """The worker's variables that come from settings."""
    return tuple(s.variable for s in SETTINGS if s.variable is not None)


def to_worker(config: Any) -> dict[str, Any]:
    """``WorkerEnv``'s setting attributes from the agent's config (``AgentConfig``): what the
    supervisor hands every worker it starts."""
    return {s.variable.field: getattr(config, s.name) for s in SETTINGS if s.variable is not None}
