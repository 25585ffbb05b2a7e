"""`fleet_agent_engine_kv_events_total{engine,outcome}`: the KV events of this cluster's vLLM
and SGLang replicas by what became of them (agent.engine_kv_snapshot lists the outcomes),
from the agent's engine_kv_events.json; served on the gateway's /metrics beside the other
fleet_agent_* series. `unknown_parent` or `stale` climbing means prefix routing on those
replicas sees less than they hold; `rate`/`oversize` mean the bounds refused a stream."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, Metric

from agent.engine_kv_snapshot import EngineKvSnapshot

NAME = "fleet_agent_engine_kv_events"
HELP = "KV events of vLLM/SGLang replicas read over ZMQ, by engine and outcome (blocks or batches)."


class EngineKvEventsCollector:
    def __init__(self, snapshot: Callable[[], EngineKvSnapshot | None]) -> None:
        self.snapshot = snapshot

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(NAME, HELP, labels=["engine", "outcome"])

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(NAME, HELP, labels=["engine", "outcome"])
        for c in (self.snapshot() or EngineKvSnapshot()).counts:
            family.add_metric([c.engine, c.outcome], float(c.count))
        yield family
