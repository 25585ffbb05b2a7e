"""Spot preemption, as SkyServe handles it: when an agent reports that the provider
reclaimed spot nodes (`Heartbeat.preempted`: the replicas that ran on them), their
assignments go at once, so the very next reconcile pass re-places them. Where they land
follows the cluster's inventory: its spot pool reports fewer nodes, so the placer falls
back to on-demand (or other spot capacity) elsewhere."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.cost import ledger
from control_plane.db.models import Event, ReplicaAssignment
from fleet_base.protocol import Heartbeat

MAX_PER_HEARTBEAT = 1000


def apply_preemptions(session: Session, hb: Heartbeat) -> bool:
    """Drop the preempted and the unschedulable replicas' assignments (this cluster's
    only); True when any went. An unschedulable replica's pool is reported smaller
    meanwhile (agent/capacity.py), so it is placed elsewhere, not straight back; its
    event is the agent's own `replica_unschedulable` (with the scheduler's message)."""
    changed = _drop(session, hb, hb.preempted, "spot node reclaimed", record=True)
    return _drop(session, hb, hb.unschedulable, "the cluster cannot schedule it", record=False) or changed


def _drop(session: Session, hb: Heartbeat, reported: list[str], why: str, *, record: bool) -> bool:
    ids = [r for r in reported[:MAX_PER_HEARTBEAT] if isinstance(r, str) and 0 < len(r) <= 63]
    if not ids:
        return False
    rows = session.scalars(
        select(ReplicaAssignment).where(
            ReplicaAssignment.replica_id.in_(ids), ReplicaAssignment.cluster_id == hb.cluster
        )
    ).all()
    ledger.end(
        session, [r.replica_id for r in rows], ledger.SPOT_INTERRUPTED if record else ledger.UNSCHEDULABLE
    )
    for row in rows:
        if not record:
            session.delete(row)
            continue
        session.add(
            Event(
                kind="replica_preempted",
                cluster=hb.cluster,
                deployment=row.deployment.name if row.deployment else None,
                replica_id=row.replica_id,
                message=f"{row.replica_id}: {why} on {hb.cluster}/{row.pool_name}; re-placing",
            )
        )
        session.delete(row)
    return bool(rows)
