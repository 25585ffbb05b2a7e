"""`fleet_agent_unschedulable_replicas`: replicas the cluster cannot schedule (runtime
`kubernetes`: pods the scheduler left Pending as Unschedulable), per deployment and pool,
from the agent's replicas.json; served on the gateway's /metrics, 0 for every deployment
and pool with replicas here. Non-zero means a pool claims capacity the cluster lacks; the
control plane re-places those replicas."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import GaugeMetricFamily, Metric

from fleet_base.protocol import ReplicaStatus

NAME = "fleet_agent_unschedulable_replicas"
HELP = "Replicas the cluster cannot schedule (capacity the pool claims is missing)."


class UnschedulableCollector:
    def __init__(self, replicas: Callable[[], Sequence[ReplicaStatus]]) -> None:
        self.replicas = replicas

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(NAME, HELP, labels=["deployment", "pool"])

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(NAME, HELP, labels=["deployment", "pool"])
        counts: Counter[tuple[str, str]] = Counter()
        for r in self.replicas():  # 0 for every deployment and pool with replicas here
            counts[(r.deployment, r.pool)] += int(r.unschedulable)
        for (deployment, pool), n in sorted(counts.items()):
            g.add_metric([deployment, pool], n)
        yield g
