"""`fleet_agent_cold_start_seconds`: each replica's cold start (agent start of the
replica to its first ready /health), as the agent measured it and wrote it to
replicas.json; served on the gateway's /metrics, the cluster's one scrape target."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import GaugeMetricFamily, Metric

from agent.protocol import ReplicaStatus

NAME = "fleet_agent_cold_start_seconds"


class ColdStartCollector:
    def __init__(self, replicas: Callable[[], Sequence[ReplicaStatus]]) -> None:
        self.replicas = replicas

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(NAME, "Seconds from the agent starting a replica to its first ready /health.",
                                labels=["deployment", "replica"])  # fmt: skip

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(NAME, "Seconds from the agent starting a replica to its first ready /health.",
                              labels=["deployment", "replica"])  # fmt: skip
        for r in self.replicas():
            if r.cold_start_s is not None:
                g.add_metric([r.deployment, r.replica_id], r.cold_start_s)
        yield g
