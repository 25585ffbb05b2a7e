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
from fleet_base.node_health import FaultKind, NodeState, is_node_fault


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
        "Faults stored, by cluster, kind and whether they count against the node "
        "(node_fault=false: an out-of-memory or an application XID, recorded only).",
        labels=["cluster", "kind", "node_fault"],
    )
    rows = session.execute(
        select(
            NodeFaultRecord.cluster, NodeFaultRecord.kind, NodeFaultRecord.node_fault, func.count()
        ).group_by(NodeFaultRecord.cluster, NodeFaultRecord.kind, NodeFaultRecord.node_fault)
    )
    stored = {(cluster, kind, bool(node)): n for cluster, kind, node, n in rows}
    # every kind as it can count (0 included), so a rate over the record has series before any fault
    usual = {(k.value, is_node_fault(k)) for k in FaultKind} | {(FaultKind.xid.value, False)}
    clusters = {c for c, _ in counted} | {c for c, _, _ in stored}
    for cluster in sorted(clusters):
        for kind, node in sorted(usual | {(k, n) for c, k, n in stored if c == cluster}):
            faults.add_metric(
                [cluster, kind, "true" if node else "false"], stored.get((cluster, kind, node), 0)
            )
    yield faults

    premium = GaugeMetricFamily(
        "fleet_pool_reliability_premium_dollars",
        "Dollars per node-hour a pool's node faults (last 7 days, its provider's share included) add in the plan.",
        labels=["cluster", "pool"],
    )
    for p, _ in priced_pools(session):
        premium.add_metric([p.cluster, p.name], p.reliability_premium)
    yield premium
