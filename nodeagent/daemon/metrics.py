"""The agent's Prometheus metrics, in a private registry served on /metrics."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from nodeagent.daemon.config import split_host_port


class AgentMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.lease_held = Gauge("runwarden_agent_lease_held", "1 while the node lease is held", registry=r)
        self.heartbeat_age = Gauge(
            "runwarden_agent_last_heartbeat_age_seconds", "seconds since the last lease keepalive", registry=r
        )
        self.registrations = Counter(
            "runwarden_agent_registrations", "node registrations (incl. re-)", registry=r
        )
        self.self_fences = Counter(
            "runwarden_agent_self_fences",
            "times the agent stopped its workers because its lease ran out unrenewed",
            registry=r,
        )
        self.evidence = Counter("runwarden_agent_evidence", "evidence published", ["kind"], registry=r)
        self.progress_writes = Counter("runwarden_agent_progress_writes", "progress puts to etcd", registry=r)
        self.progress_interval = Gauge(
            "runwarden_agent_progress_interval_seconds",
            "the progress write interval in force (the run's policy, else the agent's config)",
            registry=r,
        )
        self.rpc_latency = Histogram(
            "runwarden_agent_rpc_seconds",
            "RPC latency",
            ["method", "code"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5, 30, 120),
            registry=r,
        )
        self._heartbeat_at: Callable[[], float | None] = lambda: None

    def track_heartbeat(self, last_heartbeat_at: Callable[[], float | None]) -> None:
        """Heartbeat age is computed at scrape time from the keeper's last keepalive."""
        self._heartbeat_at = last_heartbeat_at
        self.heartbeat_age.set_function(self._age)

    def _age(self) -> float:
        at = self._heartbeat_at()
        return float("nan") if at is None else max(0.0, time.monotonic() - at)

    def serve(self, listen: str) -> None:
        host, port = split_host_port(listen, "metrics_listen")
        start_http_server(port, addr=host, registry=self.registry)
