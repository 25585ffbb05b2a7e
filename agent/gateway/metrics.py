"""Prometheus metrics of one gateway (`fleet_gateway_*`, see docs/metrics.md).

A registry of its own (no process collectors), so names are exactly those documented.
Label values are bounded: `deployment` is a deployment known to the cluster (anything
else is counted as "_unknown"), `replica` a replica id the agent reported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from fleet_base.listener import RefusalCollector

UNKNOWN = "_unknown"

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    320.0,
)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _LoadCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, tuple[str, int, int]]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        tokens = GaugeMetricFamily(
            "fleet_gateway_replica_outstanding_tokens",
            "Estimated prompt + max tokens of this gateway's requests in flight at a replica.",
            labels=["deployment", "replica"],
        )
        requests = GaugeMetricFamily(
            "fleet_gateway_replica_in_flight",
            "This gateway's requests in flight at a replica.",
            labels=["deployment", "replica"],
        )
        for replica, (deployment, tok, req) in sorted(self.snapshot().items()):
            tokens.add_metric([deployment, replica], tok)
            requests.add_metric([deployment, replica], req)
        yield tokens
        yield requests


class GatewayMetrics:
    def __init__(self, load: Callable[[], dict[str, tuple[str, int, int]]] | None = None) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "fleet_gateway_requests", "Finished requests by deployment and HTTP status.", ["deployment", "status"],
            registry=r,
        )  # fmt: skip
        self.duration = Histogram(
            "fleet_gateway_request_duration_seconds",
            "Arrival at the gateway to the last byte sent to the client.",
            ["deployment"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "fleet_gateway_time_to_first_token_seconds",
            "Arrival at the gateway to the first streamed chunk carrying a token (streams only).",
            ["deployment"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.tokens = Counter(
            "fleet_gateway_tokens", "Tokens by deployment and kind (prompt, completion), from replica usage.",
            ["deployment", "kind"], registry=r,
        )  # fmt: skip
        self.in_flight = Gauge(
            "fleet_gateway_in_flight", "Requests being handled (queued, proxied or forwarded).", ["deployment"],
            registry=r,
        )  # fmt: skip
        self.queue_depth = Gauge(
            "fleet_gateway_queue_depth", "Requests waiting for a ready replica.", registry=r
        )
        self.queue_wait = Histogram(
            "fleet_gateway_queue_wait_seconds", "Time requests waited for a ready replica (admitted or not).",
            ["deployment"], buckets=QUEUE_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_rejected = Counter(
            "fleet_gateway_queue_rejected", "Requests answered 503 by the queue (reason: full, timeout).",
            ["deployment", "reason"], registry=r,
        )  # fmt: skip
        self.retries = Counter(
            "fleet_gateway_retries", "Requests retried on another target after a failure before the first byte.",
            ["deployment"], registry=r,
        )  # fmt: skip
        self.upstream_errors = Counter(
            "fleet_gateway_upstream_errors",
            "Failed attempts at a replica or peer (reason: connect, status_5xx, read, midstream).",
            ["deployment", "reason"], registry=r,
        )  # fmt: skip
        self.forwarded = Counter(
            "fleet_gateway_forwarded", "Requests forwarded to a peer cluster's gateway.", ["deployment", "peer"],
            registry=r,
        )  # fmt: skip
        self.replica_choice = Counter(
            "fleet_gateway_replica_choice", "Attempts sent to each replica by the routing policy.",
            ["deployment", "replica", "version"], registry=r,
        )  # fmt: skip
        self.usage_records = Counter(
            "fleet_gateway_usage_records", "Usage records by outcome (published, dropped).", ["result"], registry=r
        )  # fmt: skip
        self.state_reloads = Counter(
            "fleet_gateway_state_reloads", "Reloads of the agent's state files.", ["file"], registry=r
        )  # fmt: skip
        # priority queueing and quotas (docs/quotas.md)
        self.queue_class_depth = Gauge(
            "fleet_gateway_queue_class_depth", "Requests queued at this gateway by priority class.", ["class"],
            registry=r,
        )  # fmt: skip
        self.queue_time = Histogram(
            "fleet_gateway_queue_time_seconds",
            "Time from arrival to a replica slot by priority class (0 when admitted at once).",
            ["class"], buckets=QUEUE_BUCKETS, registry=r,
        )  # fmt: skip
        self.rate_limited = Counter(
            "fleet_gateway_rate_limited", "Requests answered 429 by a key's quota or team budget, by deployment and limit.",
            ["deployment", "limit"], registry=r,
        )  # fmt: skip
        self.prompt_tokens_counted = Counter(
            "fleet_gateway_prompt_tokens_counted",
            "Prompt tokens counted at admission, by deployment and counter (tokenizer, estimate).",
            ["deployment", "counter"], registry=r,
        )  # fmt: skip
        self.abandoned_tokens = Counter(
            "fleet_gateway_abandoned_tokens_charged",
            "Prompt tokens charged for attempts given up after being sent here (timeout, client_gone).",
            ["deployment", "reason"], registry=r,
        )  # fmt: skip
        self.streams_aborted = Counter(
            "fleet_gateway_streams_aborted",
            "Streams ended here (upstream closed, slot released) by reason: slow_reader (client_write_timeout_s).",
            ["deployment", "reason"], registry=r,
        )  # fmt: skip
        for result in ("published", "dropped"):
            self.usage_records.labels(result)
        for name in ("replicas", "keys", "routes"):
            self.state_reloads.labels(name)
        r.register(RefusalCollector())
        if load is not None:
            r.register(_LoadCollector(load))

    def know(self, deployment: str, peers: Iterable[str] = ()) -> None:
        """Create a deployment's series at zero, so they exist before the first event."""
        for child in (self.duration, self.ttft, self.in_flight, self.queue_wait, self.retries):
            child.labels(deployment)
        for kind in ("prompt", "completion"):
            self.tokens.labels(deployment, kind)
        for reason in ("full", "timeout"):
            self.queue_rejected.labels(deployment, reason)
        for reason in ("connect", "status_5xx", "read", "midstream"):
            self.upstream_errors.labels(deployment, reason)
        self.streams_aborted.labels(deployment, "slow_reader")
        for peer in peers:
            self.forwarded.labels(deployment, peer)

    def keep_replicas(self, live: set[str]) -> None:
        """Drop the per-replica series of replicas the cluster no longer runs."""
        drop_departed(self.replica_choice, "replica", live)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def drop_departed(metric: MetricWrapperBase, label: str, live: set[str]) -> int:
    """Remove `metric`'s series whose `label` is not in `live`, and say how many: a gateway
    outlives many replicas (every rollout and scale-up starts new ones), and a series per
    replica it ever saw would grow its memory and the scrape without bound."""
    names: tuple[str, ...] = metric._labelnames  # the order `remove` takes (prometheus_client has no getter)
    gone: set[tuple[str, ...]] = set()
    for family in metric.collect():
        for sample in family.samples:
            if label in names and all(n in sample.labels for n in names) and sample.labels[label] not in live:
                gone.add(tuple(sample.labels[n] for n in names))
    for values in gone:
        metric.remove(*values)
    return len(gone)
