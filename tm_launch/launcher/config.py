"""What one node's agent is told at start (built by ``tm_launch.cli`` from torchrun's options).

Its own module so that the agent's parts (session, supervisor, observers, plan executor) can
read it without importing the agent loop that composes them.
"""

from __future__ import annotations

from dataclasses import dataclass, make_dataclass

from health.config import HealthConfig
from rendezvous.planner import Limits

from .. import settings
from .processes import OutputSpec

# One field per tm-launch setting, by its name, declared in tm_launch.settings (lease_ttl,
# join_timeout, spares, no_live, snapshot_every, ...): a setting is never declared twice.
_Settings = make_dataclass("AgentSettings", settings.agent_fields(), kw_only=True)


@dataclass(kw_only=True)
class AgentConfig(_Settings):
    """tm-launch's settings (``_Settings``, as decided: ``node_id`` named, ``join_timeout`` and
    ``last_call`` from ``--rdzv-conf`` where it sets them, ``snapshot_memory_limit`` in bytes,
    0 for none) and what torchrun's options say about this node."""

    addr: str
    nproc: int
    limits: Limits
    cmd: list[str]
    run_id: str
    role: str = "default"
    monitor_interval: float = 0.1
    output: OutputSpec | None = None
    health: HealthConfig | None = None
