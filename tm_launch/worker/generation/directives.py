"""The agent's directives as a worker reads them: every question about "is there a newer
generation, and what does it say" asked through one object.

The agent hands a worker one ``Directive`` per generation (``tm_launch.protocol``) through its
store, and its client (``agent_client.AgentClient``) hears each new number on a watch thread.
The live job, the step guard, the spare and the generation protocol all ask the same few
questions of them; asking them here keeps one answer per question (which read is a round trip
to the agent's store and which is the watch thread's free answer, what "a peer is gone" means).
"""

from __future__ import annotations

from ...protocol import Directive
from ..agent_client import AgentClient


class Directives:
    def __init__(self, agent: AgentClient):
        self._agent = agent

    def newest_generation(self) -> int:
        """The newest generation the agent handed over (a round trip to its store)."""
        return self._agent.latest()

    def newer_than(self, generation: int) -> bool:
        """The per-step check: what the watch thread heard, no round trip."""
        return self._agent.newer_than(generation)

    def newest_after(self, generation: int) -> Directive | None:
        """The newest directive, if it is newer than ``generation``."""
        latest = self._agent.latest()
        return self._agent.directive(latest) if latest > generation else None

    def newest(self) -> Directive | None:
        """The newest directive handed over, if any."""
        latest = self._agent.latest()
        return self._agent.directive(latest) if self._agent.has_directive(latest) else None

    def peer_gone_after(self, generation: int) -> bool:
        """A newer generation exists because a peer is gone (not a planned switch)."""
        d = self.newest_after(generation)
        return d is not None and not d.planned

    def wait_after(self, generation: int, repeat: bool = True) -> Directive:
        """Block until the agent hands over a generation newer than ``generation``."""
        return self._agent.wait_directive(generation, repeat=repeat)
