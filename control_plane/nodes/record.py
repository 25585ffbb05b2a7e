"""Heartbeats' node health into the database: each node's state (upserted per
(cluster, node)) and each fault (stored once by `fault_id`: agents repeat a fault for a
while so that one lost heartbeat does not lose it).

The cluster is always the heartbeat's own, which the inbox checked against the
subject the agent's credentials may publish on: a cluster writes only its own rows. A
fault must name one of the nodes the same heartbeat reports, and its time must be
plausible (at most `FUTURE_SKEW_S` ahead of ours, at most `MAX_AGE_S` old); anything else
is refused with a log line, the rest of the heartbeat is kept."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime, timedelta, timezone

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.db.models import Cluster, Event, Node, NodeFaultRecord, ReplicaAssignment
from control_plane.db.once import insert_once
from fleet_base.node_health import NodeFault, NodeHealth, NodeState, is_node_fault
from fleet_base.protocol import Heartbeat

log = logging.getLogger(__name__)

FUTURE_SKEW_S = 60.0
MAX_AGE_S = 86_400.0
# States in which a node's capacity is withheld: it gets no new replicas.
WITHHELD = frozenset({NodeState.cordoned.value, NodeState.drained.value, NodeState.retired.value})


def at_utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, timezone.utc)


def fault_refusal(fault: NodeFault, nodes: set[str], now: datetime) -> str | None:
    """Why a reported fault is not stored (None: it is)."""
    if fault.node not in nodes:
        return f"its node {fault.node!r} is not one this heartbeat reports"
    at = at_utc(fault.at)
    if at > now + timedelta(seconds=FUTURE_SKEW_S):
        return f"its time {at.isoformat()} is in the future"
    if at < now - timedelta(seconds=MAX_AGE_S):
        return f"its time {at.isoformat()} is over {MAX_AGE_S:g}s old"
    return None


def record_nodes(session: Session, cluster: Cluster, hb: Heartbeat, now: datetime) -> bool:
    """Upsert the heartbeat's nodes and store its new faults, with `node_state` and
    `node_fault` events; True when a node's state changed (placement may change)."""
    rows = _rows(session, cluster.id, [n.node for n in hb.nodes])
    changed = False
    for health in hb.nodes:
        changed = _upsert(session, rows, cluster.id, health, now) or changed
    _store_faults(session, cluster, rows, hb.node_faults, now)
    return changed


def _rows(session: Session, cluster: str, names: list[str]) -> dict[str, Node]:
    if not names:
        return {}
    found = session.scalars(select(Node).where(Node.cluster == cluster, Node.node.in_(names))).all()
    return {r.node: r for r in found}


def _upsert(session: Session, rows: dict[str, Node], cluster: str, h: NodeHealth, now: datetime) -> bool:
    row = rows.get(h.node)
    was = None if row is None else row.state
    if row is None:
        row = Node(cluster=cluster, node=h.node, action_reason="", action_by="", pool="")
        session.add(row)
        rows[h.node] = row
    row.state = h.state.value
    row.reason = h.reason
    row.since = at_utc(h.since)
    row.gpus = h.gpus
    row.gpus_withheld = sorted(set(h.gpus_withheld))
    row.cordoned_by = h.cordoned_by
    row.faults = h.faults
    row.nvml = h.nvml
    row.updated_at = now
    if was == row.state or (was is None and row.state == NodeState.healthy.value):
        return False
    session.add(
        Event(
            kind="node_state",
            cluster=cluster,
            message=f"{h.node}: {was or 'new'} -> {row.state}" + (f" ({h.reason})" if h.reason else ""),
        )
    )
    return True


def _store_faults(
    session: Session, cluster: Cluster, rows: dict[str, Node], faults: Iterable[NodeFault], now: datetime
) -> None:
    faults = list(faults)
    if not faults:
        return
    pools = {
        r.replica_id: r.pool_name
        for r in session.scalars(
            select(ReplicaAssignment).where(
                ReplicaAssignment.cluster_id == cluster.id,
                ReplicaAssignment.replica_id.in_([f.replica_id for f in faults if f.replica_id]),
            )
        )
    }
    only_pool = cluster.pools[0].name if len(cluster.pools) == 1 else ""
    for f in faults:
        why = fault_refusal(f, set(rows), now)
        if why is not None:
            log.warning("%s: fault %s (%s) refused: %s", cluster.id, f.fault_id, f.kind.value, why)
            continue
        node = rows[f.node]
        pool = pools.get(f.replica_id or "", "") or node.pool or only_pool
        if pool and not node.pool:
            node.pool = pool
        values = {
            "fault_id": f.fault_id,
            "cluster": cluster.id,
            "node": f.node,
            "gpu": f.gpu,
            "kind": f.kind.value,
            "at": at_utc(f.at),
            "evidence": f.evidence,
            "replica_id": f.replica_id,
            "deployment": f.deployment,
            "pool": pool[:63],
            "provider": (cluster.provider or "")[:63],
            "node_fault": is_node_fault(f.kind, f.evidence),
        }
        if insert_once(session, NodeFaultRecord, values, "fault_id"):
            where = f"GPU {f.gpu}" if f.gpu is not None else "the node"
            session.add(
                Event(
                    kind="node_fault",
                    cluster=cluster.id,
                    deployment=(f.deployment or None) and f.deployment[:63],
                    replica_id=(f.replica_id or None) and f.replica_id[:63],
                    message=f"{f.node}: {f.kind.value} on {where}"
                    + (f": {f.evidence}" if f.evidence else ""),
                )
            )
