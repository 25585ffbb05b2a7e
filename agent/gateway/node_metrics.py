"""`fleet_agent_node_state{node,state}` (1 for each node's current state, 0 for the
others) and `fleet_agent_gpu_errors_total{node,gpu,kind}` (faults the agent saw since it
started; gpu "" for a node-wide one), from the agent's nodes.json (agent.health.snapshot);
served on the gateway's /metrics beside the other fleet_agent_* series."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from agent.health.snapshot import NodeSnapshot
from fleet_base.node_health import NodeState

STATE = "fleet_agent_node_state"
STATE_HELP = (
    "1 for each node's current health state (healthy, suspect, cordoned, drained, remediated, retired)."
)
ERRORS = "fleet_agent_gpu_errors_total"
ERRORS_HELP = "GPU and node faults the agent observed, by node, GPU and kind (xid, ecc_uncorrectable, ...)."


class NodeHealthCollector:
    def __init__(self, snapshot: Callable[[], NodeSnapshot | None]) -> None:
        self.snapshot = snapshot

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(STATE, STATE_HELP, labels=["node", "state"])
        yield CounterMetricFamily(ERRORS, ERRORS_HELP, labels=["node", "gpu", "kind"])

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot() or NodeSnapshot()
        state = GaugeMetricFamily(STATE, STATE_HELP, labels=["node", "state"])
        for node in snap.nodes:
            for s in NodeState:
                state.add_metric([node.node, s.value], 1.0 if node.state == s else 0.0)
        yield state
        errors = CounterMetricFamily(ERRORS, ERRORS_HELP, labels=["node", "gpu", "kind"])
        for e in snap.errors:
            errors.add_metric([e.node, "" if e.gpu is None else str(e.gpu), e.kind.value], float(e.count))
        yield errors
