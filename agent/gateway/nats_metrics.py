"""The gateway's NATS refusals on /metrics: publishes, requests and subscriptions its link
refused (outside the identity's subject table) or the server refused (permissions
violation), which would otherwise only be missing traffic."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from fleet_base.nats_io import NatsLink


class NatsRefusals(Collector):
    def __init__(self, link: NatsLink) -> None:
        self.link = link

    def collect(self) -> Iterable[Metric]:
        c = CounterMetricFamily(
            "fleet_gateway_nats_refused",
            "NATS operations refused by the subject table or the server's permissions, by op.",
            labels=["op"],
        )
        for op in ("publish", "subscribe"):
            c.add_metric([op], self.link.refused.get(op, 0))
        yield c
