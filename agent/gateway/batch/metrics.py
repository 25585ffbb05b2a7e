"""`fleet_batch_*` metrics of a gateway's batch side, in the gateway's registry."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fleet_base.batch.models import BatchRecord, BatchStatus

STATUSES: tuple[str, ...] = BatchStatus.__args__  # type: ignore[attr-defined]


class _BatchesByStatus(Collector):
    """Batches in the store by status, as this gateway's driver last listed them (every
    gateway reads the same store: aggregate with max, not sum)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = dict.fromkeys(STATUSES, 0)

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily(
            "fleet_batch_batches",
            "Batches in the store by status (the driver's last listing).",
            labels=["status"],
        )
        for status, n in self.counts.items():
            family.add_metric([status], n)
        yield family


class BatchMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._batches = _BatchesByStatus()
        registry.register(self._batches)
        self.transitions = Counter(
            "fleet_batch_transitions",
            "Batch status changes this gateway's driver made, by the status entered.",
            ["status"],
            registry=registry,
        )
        for status in STATUSES:
            self.transitions.labels(status)

    def observe(self, records: Iterable[BatchRecord]) -> None:
        counts = Tally(r.status for r in records)
        self._batches.counts = {s: counts.get(s, 0) for s in STATUSES}
