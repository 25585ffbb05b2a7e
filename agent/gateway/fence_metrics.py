"""`fleet_agent_fenced_writes_total{bucket}`: KV values the agent refused because a newer
control-plane leader had written the bucket (agent.fencing), from the agent's fence.json;
served on the gateway's /metrics, 0 for each bucket until one is refused. Non-zero means a
deposed leader woke up and wrote; the control plane's own fencing then stopped it."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, Metric

from fleet_base import protocol
from fleet_base.local_state import FenceState

NAME = "fleet_agent_fenced_writes"
HELP = "KV values refused because they carry an older control-plane epoch than the bucket's highest."


class FencedWritesCollector:
    def __init__(self, state: Callable[[], FenceState]) -> None:
        self.state = state

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(NAME, HELP, labels=["bucket"])

    def collect(self) -> Iterator[Metric]:
        buckets = self.state().buckets
        family = CounterMetricFamily(NAME, HELP, labels=["bucket"])
        for bucket in sorted(set(protocol.BUCKETS) | set(buckets)):
            fence = buckets.get(bucket)
            family.add_metric([bucket], float(fence.refused if fence else 0))
        yield family
