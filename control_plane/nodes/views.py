"""Nodes as the API, the CLI and the console show them: the stored row, its failure
count (node faults only) and the operator's latest action."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from control_plane.api.deps import as_utc
from control_plane.api.schemas import NodeActionOut, NodeDetailOut, NodeFaultOut, NodeOut
from control_plane.db.models import CapacityPool, Cluster, Node, NodeFaultRecord, utcnow
from control_plane.fleet_model.snapshot import recent_faults
from control_plane.placement import PoolCapacity
from control_plane.placement.reliability import RELIABILITY_WINDOW_S, with_reliability
from fleet_base.domain import pool_shape


def failure_counts(
    session: Session, clusters: Sequence[str] | None = None
) -> dict[tuple[str, str], tuple[int, datetime | None]]:
    """(cluster, node) -> (node faults stored, the latest one's time)."""
    query = (
        select(NodeFaultRecord.cluster, NodeFaultRecord.node, func.count(), func.max(NodeFaultRecord.at))
        .where(NodeFaultRecord.node_fault.is_(True))
        .group_by(NodeFaultRecord.cluster, NodeFaultRecord.node)
    )
    if clusters is not None:
        query = query.where(NodeFaultRecord.cluster.in_(list(clusters)))
    return {(c, n): (count, as_utc(last)) for c, n, count, last in session.execute(query)}


def node_out(row: Node, counts: dict[tuple[str, str], tuple[int, datetime | None]]) -> NodeOut:
    failures, last = counts.get((row.cluster, row.node), (0, None))
    operator = None
    if row.action in ("cordon", "uncordon") and row.action_at is not None:
        operator = NodeActionOut(
            action=row.action,
            at=as_utc(row.action_at),
            reason=row.action_reason or "",
            by=row.action_by or "",
        )
    return NodeOut(
        cluster=row.cluster,
        node=row.node,
        state=row.state,
        reason=row.reason or "",
        failures=failures,
        since=as_utc(row.since),
        gpus=row.gpus,
        gpus_withheld=list(row.gpus_withheld or []),
        cordoned_by=row.cordoned_by or "",
        nvml=row.nvml or "",
        pool=row.pool or "",
        last_fault_at=last,
        updated_at=as_utc(row.updated_at),
        operator=operator,
    )


def nodes_out(session: Session, rows: Sequence[Node]) -> list[NodeOut]:
    counts = failure_counts(session, sorted({r.cluster for r in rows})) if rows else {}
    return [node_out(r, counts) for r in rows]


def fault_out(row: NodeFaultRecord) -> NodeFaultOut:
    return NodeFaultOut(
        fault_id=row.fault_id,
        at=as_utc(row.at),
        node=row.node,
        gpu=row.gpu,
        kind=row.kind,
        node_fault=row.node_fault,
        evidence=row.evidence or "",
        replica_id=row.replica_id,
        deployment=row.deployment,
        pool=row.pool or "",
        provider=row.provider or "",
    )


def node_detail(session: Session, row: Node, limit: int) -> NodeDetailOut:
    faults = session.scalars(
        select(NodeFaultRecord)
        .where(NodeFaultRecord.cluster == row.cluster, NodeFaultRecord.node == row.node)
        .order_by(NodeFaultRecord.at.desc(), NodeFaultRecord.id.desc())
        .limit(limit)
    ).all()
    base = nodes_out(session, [row])[0]
    return NodeDetailOut(**base.model_dump(), faults=[fault_out(f) for f in faults])


def priced_pools(session: Session) -> list[tuple[PoolCapacity, int]]:
    """Every pool (by cluster and name) with the reliability premium the placer gives it
    now, and its own node faults over the window (its provider's share is in the premium)."""
    pools = [
        PoolCapacity(cluster=p.cluster_id, name=p.name, provider=provider or "", **pool_shape(p))
        for p, provider in session.execute(
            select(CapacityPool, Cluster.provider)
            .join(Cluster, Cluster.id == CapacityPool.cluster_id)
            .order_by(CapacityPool.cluster_id, CapacityPool.name)
        )
    ]
    counts = recent_faults(session, utcnow() - timedelta(seconds=RELIABILITY_WINDOW_S))
    priced = with_reliability(pools, counts["pool_faults"], counts["provider_faults"])
    return [(p, counts["pool_faults"].get(p.key, 0)) for p in priced]
