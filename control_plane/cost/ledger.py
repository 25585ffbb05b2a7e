"""The replica ledger: one `replica_intervals` row per replica lifetime on a pool, opened
when the reconcile pass assigns the replica and closed when its assignment goes (removed,
preempted, spot node reclaimed, failed, ...). The pool's tier and price are copied at the
start, so a later price edit, or deleting the replica, its deployment or the pool, never
rewrites what was paid. `sync` is the safety net each reconcile pass runs: it closes the
intervals of replicas whose assignment went another way (a deleted deployment or cluster)
and opens one for an assignment that has none (replicas placed before the ledger existed).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Protocol

from sqlalchemy import select, tuple_, update
from sqlalchemy.orm import Session

from control_plane.db.models import CapacityPool, ReplicaInterval, utcnow

# Why an interval ended (ReplicaInterval.end_reason).
REMOVED = "removed"  # the placer no longer wanted it (scaled in, rolled, moved)
PREEMPTED = "preempted"  # made room for a higher-priority deployment
SPOT_INTERRUPTED = "spot_interrupted"  # the provider reclaimed its spot node
UNSCHEDULABLE = "unschedulable"  # its cluster could not schedule it; placed elsewhere
FAILED = "failed"  # removed while in the failed state
GONE = "gone"  # its assignment went with its deployment or cluster (found by `sync`)


class Placed(Protocol):
    """A replica as the placer and the fleet snapshot describe it."""

    @property
    def replica_id(self) -> str: ...
    @property
    def deployment(self) -> str: ...
    @property
    def version(self) -> int: ...
    @property
    def cluster(self) -> str: ...
    @property
    def pool(self) -> str: ...
    @property
    def gpus(self) -> int: ...


def start(session: Session, replicas: Iterable[Placed], at: datetime | None = None) -> int:
    """Open an interval per replica, at its pool's current tier and price per GPU-hour."""
    replicas = list(replicas)
    if not replicas:
        return 0
    at = at or utcnow()
    keys = {(r.cluster, r.pool) for r in replicas}
    pools = {
        (p.cluster_id, p.name): p
        for p in session.scalars(
            select(CapacityPool).where(tuple_(CapacityPool.cluster_id, CapacityPool.name).in_(sorted(keys)))
        ).all()
    }
    for r in replicas:
        pool = pools.get((r.cluster, r.pool))
        session.add(
            ReplicaInterval(
                replica_id=r.replica_id,
                deployment=r.deployment,
                version=r.version,
                cluster=r.cluster,
                pool=r.pool,
                tier=pool.tier if pool else "on-demand",
                gpus=r.gpus,
                hourly_price=(pool.hourly_price or 0.0) / max(1, pool.gpus_per_node or 1) if pool else 0.0,
                started_at=at,
            )
        )
    return len(replicas)


def end(session: Session, replica_ids: Iterable[str], reason: str, at: datetime | None = None) -> int:
    """Close the open intervals of `replica_ids` with `reason`; how many closed."""
    ids = sorted(set(replica_ids))
    if not ids:
        return 0
    result = session.execute(
        update(ReplicaInterval)
        .where(ReplicaInterval.replica_id.in_(ids), ReplicaInterval.ended_at.is_(None))
        .values(ended_at=at or utcnow(), end_reason=reason)
        .execution_options(synchronize_session=False)
    )
    return result.rowcount or 0


def sync(session: Session, assigned: Iterable[Placed], at: datetime | None = None) -> bool:
    """Make the open intervals match `assigned` (the replicas assigned now); True when
    anything changed. Replica ids are never reused, so a replica with a closed interval
    is never reopened."""
    assigned = {r.replica_id: r for r in assigned}
    open_ids = set(
        session.scalars(select(ReplicaInterval.replica_id).where(ReplicaInterval.ended_at.is_(None)))
    )
    closed = end(session, open_ids - set(assigned), GONE, at)
    missing = set(assigned) - open_ids
    if missing:
        missing -= set(
            session.scalars(
                select(ReplicaInterval.replica_id).where(ReplicaInterval.replica_id.in_(sorted(missing)))
            )
        )
    opened = start(session, (assigned[rid] for rid in sorted(missing)), at)
    return bool(closed or opened)
