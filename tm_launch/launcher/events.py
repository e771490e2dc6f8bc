"""What the agent says, and where each line goes.

Every part of the agent reports through one ``say``: people read stderr, programs read
``--event-log`` (every line, every kind), operators read etcd's ``log/events`` through
``tm-launch ctl events`` (every kind but "info"), and ``--metrics-port`` counts the kinds.
"""

from __future__ import annotations

import json
import sys
import time

from rendezvous.kv import KVError
from rendezvous.membership import Membership


class EventLog:
    def __init__(self, node_id: str, path: str | None, members: Membership, metrics):
        self.node_id = node_id
        self.path = path
        self.members = members
        self.metrics = metrics  # observers.MetricsFeed: counts events by kind when serving

    def say(self, message: str, kind: str = "info", publish: bool = True, **fields) -> None:
        """stderr for people, ``--event-log`` for programs (every line, every kind), and etcd's
        log/events for ``ctl events`` (kinds other than "info"; not with ``publish=False``, for
        messages said while etcd is unreachable: they must not wait on it)."""
        stamp = time.strftime("%H:%M:%S", time.localtime()) + f".{int(time.time() * 1000) % 1000:03d}"
        print(f"[tm-launch {self.node_id} {stamp}] {message}", file=sys.stderr, flush=True)
        record = {"time": time.time(), "node": self.node_id, "kind": kind, "message": message, **fields}
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")
        self.metrics.on_event(kind, fields)
        if kind != "info" and publish:
            try:
                self.members.event(self.node_id, kind, message=message, **fields)
            except KVError:
                pass
