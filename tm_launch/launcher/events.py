"""What the agent says, and where each line goes.

Every part of the agent reports through one ``say``: people read stderr, programs read
``--event-log`` (every line, every kind), operators read etcd's ``log/events`` through
``tm-launch ctl events`` (every kind but "info"), and ``--metrics-port`` counts the kinds.

etcd gets its copy from a thread of its own, in the order said: an event is said on the way to
what it announces (a worker's failure before its report, a promotion before the spare's
workers are told, a plan before its planner follows it), and an etcd write there (4-20 ms on
a loaded 2-core machine) delayed every recovery by as much (measured: a promoted spare's
workers heard of their plan 10-19 ms after its survivors did). A record etcd does not take is
retried (``etcd_retry.retry_delay``) until it goes, so that an outage loses no event. ``close``
lets the agent's last events reach etcd before it exits, within a bound.
"""

from __future__ import annotations

import json
import queue
import random
import threading
import time

from rendezvous.kv import KVError
from rendezvous.membership import Membership

from ..logs import logger
from .etcd_retry import MAX_S, retry_delay

log = logger(__name__)


class EventLog:
    FLUSH_S = 5.0  # at most this long for the last events to reach etcd when the agent exits

    def __init__(self, node_id: str, path: str | None, members: Membership, metrics):
        self.node_id = node_id
        self.path = path
        self.members = members
        self.metrics = metrics  # observers.MetricsFeed: counts events by kind when serving
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # records for etcd, in order; None ends
        self._closing = False  # set once close() waited its bound: a record etcd refuses is dropped
        self._publisher = threading.Thread(target=self._publish, daemon=True, name="tm-events")
        self._publisher.start()

    def say(self, message: str, kind: str = "info", publish: bool = True, **fields) -> None:
        """stderr for people, ``--event-log`` for programs (every line, every kind), and etcd's
        log/events for ``ctl events`` (kinds other than "info"; not with ``publish=False``, for
        messages said while etcd is unreachable: they must not wait on it)."""
        now = time.time()
        log.info("%s", message, extra={"node": self.node_id, "at": now})  # [tm-launch NODE HH:MM:SS.mmm] message
        record = {"time": now, "node": self.node_id, "kind": kind, "message": message, **fields}
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")
        self.metrics.on_event(kind, fields)
        if kind != "info" and publish:
            self._outbox.put(record)

    def _publish(self) -> None:
        while True:
            record = self._outbox.get()
            if record is None:
                return
            fields = {k: v for k, v in record.items() if k not in ("time", "node", "kind")}
            failed = 0
            while True:  # etcd away: retried under the agent's retry policy, in order, until it goes
                try:
                    self.members.operator_log.event(self.node_id, record["kind"], at=record["time"], **fields)
                    break
                except KVError:
                    failed += 1
                    if self._closing:
                        break  # the agent exits: the line is on stderr and in --event-log
                    time.sleep(retry_delay(failed, ttl=3 * MAX_S, jitter=random.random()))

    def close(self) -> bool:
        """Publish what is still queued (at most ``FLUSH_S``); True when all of it went."""
        self._outbox.put(None)
        self._publisher.join(self.FLUSH_S)
        self._closing = True
        return not self._publisher.is_alive()
