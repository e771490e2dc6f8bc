"""What one node's agent is told at start (built by ``tm_launch.cli`` from torchrun's options).

Its own module so that the agent's parts (session, supervisor, observers, plan executor) can
read it without importing the agent loop that composes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from health.config import HealthConfig
from rendezvous.planner import Limits

from .processes import OutputSpec


@dataclass
class AgentConfig:
    node_id: str
    addr: str
    nproc: int
    limits: Limits
    cmd: list[str]
    run_id: str
    role: str = "default"
    lease_ttl: float = 5.0
    monitor_interval: float = 0.1
    join_timeout: float = 600.0
    last_call: float = 1.0
    spares_wanted: int = 0
    live_enabled: bool = True
    collective_timeout: float = 120.0
    sandbox_steps: int = 2
    snapshot_every: int = 1  # live mode: snapshot what no replica holds every N steps (0: never)
    snapshot_memory_limit: int = 0  # bytes per node for snapshots (0: no limit)
    snapshot_send: str = "commit"  # protocol.SNAPSHOT_SENDS: when a snapshot must be on its holder
    snapshot_parity: int = 0  # live mode: parity over groups of K nodes instead of a copy (0: a copy)
    output: OutputSpec | None = None
    health: HealthConfig | None = None
    event_log: str | None = None
    metrics_port: int | None = None  # serve Prometheus metrics on addr:port (None: off)
