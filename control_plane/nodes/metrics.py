"""Node health as Prometheus metrics, read from the database at scrape time (every
control-plane instance answers the same): nodes by state, the stored faults (a counter:
the record is kept, so it only grows) and each pool's reliability premium in the plan."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from control_plane.db.models import Node, NodeFaultRecord
from control_plane.nodes.views import priced_pools
from fleet_base.node_health import FaultKind, NodeState


def node_metrics(session: Session) -> Iterator[Metric]:
    states = GaugeMetricFamily(
        "fleet_nodes", "Nodes by cluster and health state.", labels=["cluster", "state"]
    )
    rows = session.execute(select(Node.cluster, Node.state, func.count()).group_by(Node.cluster, Node.state))
    counted = {(cluster, state): n for cluster, state, n in rows}
    for cluster in sorted({c for c, _ in counted}):
        for state in NodeState:  # every state, 0 included, so a panel's series never vanish
            states.add_metric([cluster, state.value], counted.get((cluster, state.value), 0))
    yield states

    faults = CounterMetricFamily(
        "fleet_node_faults",
        "Node and GPU faults stored, by cluster and kind (oom included).",
        labels=["cluster", "kind"],
    )
    rows = session.execute(
        select(NodeFaultRecord.cluster, NodeFaultRecord.kind, func.count()).group_by(
            NodeFaultRecord.cluster, NodeFaultRecord.kind
        )
    )
    stored = {(cluster, kind): n for cluster, kind, n in rows}
    clusters = {c for c, _ in counted} | {c for c, _ in stored}
    kinds = [k.value for k in FaultKind] + sorted({k for _, k in stored} - {k.value for k in FaultKind})
    for cluster in sorted(clusters):
        for kind in kinds:  # every kind, 0 included: a rate over the record has series before any fault
            faults.add_metric([cluster, kind], stored.get((cluster, kind), 0))
    yield faults

    premium = GaugeMetricFamily(
        "fleet_pool_reliability_premium_dollars",
        "Dollars per node-hour a pool's node faults (last 7 days, its provider's share included) add in the plan.",
        labels=["cluster", "pool"],
    )
    for p, _ in priced_pools(session):
        premium.add_metric([p.cluster, p.name], p.reliability_premium)
    yield premium
