"""`fleet_agent_cold_start_seconds` and its parts, per replica: the whole cold start
(agent start of the replica to its first ready /health), the wait for its model in the
node cache (`..._model_pull_seconds`, 0 when it was cached), the engine's own load and
warm-up, and the first request's time to first token; as the agent measured them and
wrote them to replicas.json, served on the gateway's /metrics (the cluster's one scrape
target)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import GaugeMetricFamily, Metric

from fleet_base.protocol import ReplicaStatus

NAME = "fleet_agent_cold_start_seconds"
PARTS: dict[str, tuple[str, str]] = {
    NAME: ("cold_start_s", "Seconds from the agent starting a replica to its first ready /health."),
    "fleet_agent_model_pull_seconds": ("pull_s", "Seconds a replica waited for its model in the node cache."),
    "fleet_agent_model_load_seconds": (
        "load_s",
        "Seconds the replica took to load its model (weights and KV cache).",
    ),
    "fleet_agent_model_warmup_seconds": (
        "warmup_s",
        "Seconds of the replica's warm-up generation before ready.",
    ),
    "fleet_agent_model_first_token_seconds": (
        "first_token_s",
        "Time to first token of the replica's first request.",
    ),
}


class ColdStartCollector:
    def __init__(self, replicas: Callable[[], Sequence[ReplicaStatus]]) -> None:
        self.replicas = replicas

    def describe(self) -> Iterator[Metric]:
        for name, (_, doc) in PARTS.items():
            yield GaugeMetricFamily(name, doc, labels=["deployment", "replica"])

    def collect(self) -> Iterator[Metric]:
        replicas = list(self.replicas())
        for name, (field, doc) in PARTS.items():
            g = GaugeMetricFamily(name, doc, labels=["deployment", "replica"])
            for r in replicas:
                value = getattr(r, field)
                if value is not None:
                    g.add_metric([r.deployment, r.replica_id], value)
            yield g
