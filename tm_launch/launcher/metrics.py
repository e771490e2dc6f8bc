"""Prometheus metrics of one agent (``--metrics-port PORT``; off by default).

Why per agent: every node already knows what its own workers do (their statuses in the agent's
store), which generation it follows and which alarms it raised; Prometheus scrapes each node and
aggregates. The agent calls the small ``on_*`` methods below from the places that already log the
same facts, so the metrics never disagree with the event log.

A private registry (not prometheus_client's global one) keeps the exposition to these metrics
and lets tests run several agents' metrics in one process.
"""

from __future__ import annotations

import errno

ROLES = ("active", "spare", "draining", "failed")
# Seconds: a live substitution is ~0.1-5 s, a restart ~10-60 s, a slow join minutes.
DOWNTIME_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, float("inf"))
# Event log kinds that mean "a failure the job had to recover from".
FAILURE_KINDS = ("worker_failed", "node_lost", "hang", "spare_failed")


class MetricsError(Exception):
    """The metrics server cannot start (port in use, bad address): one line for the user."""


class AgentMetrics:
    def __init__(self, node: str):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.node = node
        self.generation = Gauge("tm_launch_generation", "Generation this node's agent follows.", registry=r)
        self.downtime = Histogram(
            "tm_launch_downtime_seconds",
            "Fault (or plan) to this node's workers running in the new generation, per generation change.",
            ["cause"],
            buckets=DOWNTIME_BUCKETS,
            registry=r,
        )
        self.last_downtime = Gauge(
            "tm_launch_last_downtime_seconds", "Downtime of the last generation change this node took part in.", ["cause"], registry=r
        )
        self.alarms = Counter("tm_launch_alarms", "Health alarms raised on or about this node.", ["signal", "severity"], registry=r)
        self.steps_per_second = Gauge(
            "tm_launch_steps_per_second", "Training steps per second of this node's running workers (mean over its workers).", registry=r
        )
        self.step = Gauge("tm_launch_step", "Highest step completed by this node's workers.", registry=r)
        self.snapshot_bytes = Gauge(
            "tm_launch_snapshot_bytes",
            "Host memory this node's workers' snapshots take (their own and what they hold for ranks of another node).",
            registry=r,
        )
        self.snapshot_sent = Gauge(
            "tm_launch_snapshot_sent_bytes", "Bytes of snapshots this node's workers sent to their holders so far.", registry=r
        )
        self.snapshot_held = Gauge(
            "tm_launch_snapshot_held_bytes",
            "Of tm_launch_snapshot_bytes, what this node's workers keep for ranks of other nodes (copies, or parity stripes).",
            registry=r,
        )
        self.spares = Gauge(
            "tm_launch_spares_available", "Spare nodes alive and ready to take over ranks, as this agent last read them.", registry=r
        )
        self.failures = Counter(
            "tm_launch_worker_failures", "Failures this agent saw and reported (worker exits, lost peers, hangs).", ["kind"], registry=r
        )
        self.changes = Counter("tm_launch_generation_changes", "Generation changes this agent followed, by cause.", ["cause"], registry=r)
        self.role = Gauge("tm_launch_role", "This node's role: 1 for the current one, 0 for the others.", ["role"], registry=r)
        self.server = None
        for role in ROLES:
            self.role.labels(role=role).set(0)

    def serve(self, addr: str, port: int) -> int:
        """Start the HTTP endpoint on ``addr:port``; returns the port (0 picks a free one)."""
        from prometheus_client import start_http_server

        try:
            self.server, _ = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise MetricsError(
                    f"--metrics-port {port}: {addr}:{port} is already in use; pick a free port "
                    "(every agent on one machine needs its own, e.g. PET_METRICS_PORT per agent)"
                ) from None
            raise MetricsError(f"--metrics-port {port}: cannot listen on {addr}:{port}: {e.strerror or e}") from None
        return self.server.server_address[1]

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    # -- updates from the agent ------------------------------------------------------------------
    def on_state(self, generation: int, role: str, spares: int) -> None:
        self.generation.set(generation)
        self.spares.set(spares)
        for r in ROLES:
            self.role.labels(role=r).set(1 if r == role else 0)

    def on_statuses(self, statuses: dict) -> None:
        rates = [1.0 / s.step_time for s in statuses.values() if s.state == "running" and s.step_time]
        self.steps_per_second.set(sum(rates) / len(rates) if rates else 0.0)
        steps = [s.step for s in statuses.values() if isinstance(s.step, int)]
        if steps:
            self.step.set(max(steps))
        self.snapshot_bytes.set(sum(s.snapshot_bytes for s in statuses.values()))
        self.snapshot_sent.set(sum(s.snapshot_sent for s in statuses.values()))
        self.snapshot_held.set(sum(s.snapshot_held for s in statuses.values()))

    def on_event(self, kind: str, fields: dict) -> None:
        """Count what the agent logs: alarms and failures (see ``Agent.say``)."""
        if kind == "alarm":
            alarm = fields.get("alarm") or {}
            self.alarms.labels(signal=str(alarm.get("signal", "unknown")), severity=str(alarm.get("severity", "unknown"))).inc()
        elif kind in FAILURE_KINDS:
            self.failures.labels(kind=kind).inc()

    def on_generation(self, cause: str) -> None:
        self.changes.labels(cause=cause).inc()

    def on_downtime(self, cause: str, seconds: float) -> None:
        self.downtime.labels(cause=cause).observe(seconds)
        self.last_downtime.labels(cause=cause).set(seconds)
