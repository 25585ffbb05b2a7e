"""`fleet_batch_*` metrics of a gateway's batch side, in the gateway's registry."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
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


QUEUE_BUCKETS = (0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 12 * 3600, 24 * 3600)


class LineMetrics:
    """The worker's lines per deployment: the store's backlog, lines running here, their
    ends (a completed line answered 2xx; a failed one is an error line: a 4xx, a failure
    past its attempts, or expired), runs put back for a later try, and the time from
    enqueue to start."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["deployment"]
        self.queued = Gauge(
            "fleet_batch_lines_queued",
            "Batch lines and async requests queued in the store for the deployment (waiting or held "
            "by a worker; every gateway reads the same store: aggregate with max)",
            labels,
            registry=registry,
        )
        self.in_flight = Gauge(
            "fleet_batch_lines_in_flight", "Batch lines and async requests running from this gateway", labels,
            registry=registry,
        )  # fmt: skip
        self.completed = Counter(
            "fleet_batch_lines_completed", "Lines this gateway's worker stored a 2xx answer for", labels,
            registry=registry,
        )  # fmt: skip
        self.failed = Counter(
            "fleet_batch_lines_failed",
            "Lines this gateway's worker stored as errors (a 4xx, failed past their attempts, expired)",
            labels,
            registry=registry,
        )
        self.retried = Counter(
            "fleet_batch_lines_retried",
            "Line runs that failed (5xx or 429 after the gateway's own retries) and were put back for later",
            labels,
            registry=registry,
        )
        self.queue_s = Histogram(
            "fleet_batch_queue_seconds",
            "Seconds from a line's enqueue to its first run",
            labels,
            buckets=QUEUE_BUCKETS,
            registry=registry,
        )

    def know(self, deployment: str) -> None:
        for metric in (self.queued, self.in_flight, self.completed, self.failed, self.retried):
            metric.labels(deployment)
