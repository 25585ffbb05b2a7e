"""What agents report, into the database: heartbeats (cluster registration, pools,
replica states, load), agent events, and the failover rule that marks a silent cluster
unhealthy. Synchronous (run in a thread); each function returns whether placement or
routes may have changed, so the caller knows to wake the reconcile loop."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta, timezone

from sqlalchemy import select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, selectinload

from control_plane.counters import Rejections
from control_plane.db.models import Cluster, ReplicaAssignment
from control_plane.db.models import Event as EventRow
from control_plane.db.once import insert_once
from control_plane.db.session import begin_write
from control_plane.loops.durable import Received, Verdicts
from control_plane.loops.preemption import apply_preemptions
from control_plane.loops.store import store_batch
from control_plane.nodes.record import record_nodes
from control_plane.placement.hold import UNREACHABLE
from fleet_base.domain import ClusterStatus
from fleet_base.protocol import (
    EVENTS_WILDCARD,
    HEARTBEAT_WILDCARD,
    Event,
    Heartbeat,
    ReplicaState,
    ReplicaStatus,
    heartbeat_subject,
)
from fleet_base.wire import decode_event


def load_summary(hb: Heartbeat) -> dict:
    states: dict[str, int] = {}
    for r in hb.replicas:
        states[r.state.value] = states.get(r.state.value, 0) + 1
    return {
        "queue_depth": hb.queue_depth,
        "tokens_per_s": hb.tokens_per_s,
        "replicas": len(hb.replicas),
        "states": states,
        "desired_generation": hb.desired_generation,
        # state files the agent cannot write (a full disk): `fleetctl status` shows them
        "state_writes_failing": dict(hb.state_writes_failing),
        "state_write_failures": hb.state_write_failures,
        "sent_at": hb.sent_at,
        # the node model cache and each replica's cold start in parts (fleetctl models ls, status)
        "models": [m.model_dump(mode="json") for m in hb.models],
        "startup": {
            r.replica_id: startup_parts(r)
            for r in hb.replicas
            if r.cold_start_s is not None or r.pull_s is not None
        },
    }


def startup_parts(r: ReplicaStatus) -> dict[str, float | None]:
    return {
        "cold_start": r.cold_start_s,
        "pull": r.pull_s,
        "load": r.load_s,
        "warmup": r.warmup_s,
        "first_token": r.first_token_s,
    }


def apply_heartbeat(session: Session, hb: Heartbeat, now: datetime) -> bool:
    """Upsert the cluster and its pools, record replica states; True when something the
    placement or routes depend on changed (not just the timestamp and load)."""
    changed = False
    cluster = session.scalar(
        select(Cluster).where(Cluster.id == hb.cluster).options(selectinload(Cluster.pools))
    )
    if cluster is None:
        cluster = Cluster(id=hb.cluster, status=ClusterStatus.healthy.value, load={})
        session.add(cluster)
        session.add(
            EventRow(
                kind="cluster_registered", cluster=hb.cluster, message=f"{hb.cluster} registered by heartbeat"
            )
        )
        changed = True
    # Never `hb.gateway_url`: where peers forward users' keys and prompts comes from the
    # cluster's enrolment (POST /v1/clusters), not from what a heartbeat claims.
    identity = {
        "provider": hb.provider,
        "region": hb.region,
        "lat": hb.coordinates.lat,
        "lon": hb.coordinates.lon,
    }
    for field, value in identity.items():
        if getattr(cluster, field) != value:
            setattr(cluster, field, value)
            changed = True
    cordoned = bool((cluster.load or {}).get("cordoned"))
    if cluster.status == ClusterStatus.unhealthy.value:
        # An operator's cordon outlives the outage: a draining cluster comes back draining.
        back = ClusterStatus.draining if cordoned else ClusterStatus.healthy
        cluster.status = back.value
        session.add(
            EventRow(
                kind="cluster_healthy",
                cluster=hb.cluster,
                message=f"{hb.cluster} heart-beats again: {back.value}",
            )
        )
        changed = True
    cluster.last_heartbeat_at = now
    cluster.load = {**load_summary(hb), **({"cordoned": True} if cordoned else {})}

    if hb.pools:  # an agent that reports pools owns its inventory
        existing = {p.name: p for p in cluster.pools}
        for inv in hb.pools:
            shape = inv.model_dump(mode="json", exclude={"name"})
            changed = cluster.set_pool(existing, inv.name, shape) != "unchanged" or changed
        for row in existing.values():
            cluster.pools.remove(row)
            changed = True

    changed = apply_preemptions(session, hb) or changed  # spot nodes lost: re-place at once
    changed = record_nodes(session, cluster, hb, now) or changed  # node health and faults
    if hb.replicas:
        reported = {r.replica_id: r for r in hb.replicas}
        rows = session.scalars(
            select(ReplicaAssignment).where(ReplicaAssignment.replica_id.in_(list(reported)))
        ).all()
        for row in rows:
            status = reported[row.replica_id]
            if row.cluster_id != hb.cluster:
                continue
            if row.state != status.state.value or row.url != status.url:
                row.state = status.state.value
                row.url = status.url
                changed = True
    return changed


def apply_heartbeats(
    session: Session,
    heartbeats: Iterable[Heartbeat],
    now: datetime,
    rejections: Rejections | None = None,
) -> bool:
    """Each heartbeat in its own savepoint: one that the database refuses is rolled back
    alone (counted and skipped), the others are kept."""
    changed = False
    for hb in heartbeats:
        try:
            with session.begin_nested():
                changed = apply_heartbeat(session, hb, now) or changed
        except SQLAlchemyError as err:
            if rejections is None:
                raise
            rejections.reject(HEARTBEAT_WILDCARD, "database", heartbeat_subject(hb.cluster), err)
    return changed


def write_heartbeats(
    sessions, heartbeats: Iterable[Heartbeat], now: datetime, rejections: Rejections
) -> bool:
    """`apply_heartbeats` in one writer's transaction (`begin_write`: a heartbeat reads its
    cluster before it updates it, which SQLite refuses under concurrent writers otherwise)."""
    with sessions() as session:
        begin_write(session)
        changed = apply_heartbeats(session, heartbeats, now, rejections)
        session.commit()
        return changed


def _event_values(e: Event, seq: int | None = None) -> dict:
    return {
        "at": datetime.fromtimestamp(e.at, timezone.utc),
        "cluster": e.cluster[:63],
        "kind": e.kind,
        "deployment": e.deployment[:63] if e.deployment else None,
        "replica_id": e.replica_id[:63] if e.replica_id else None,
        "message": e.message,
        "event_id": e.event_id or (f"js-{seq}" if seq else None),
    }


def record_events(session: Session, events: Iterable[Event]) -> int:
    """Store events, each once (by `event_id`); the number newly stored."""
    n = 0
    for e in events:
        values = _event_values(e)
        if values["event_id"] is None:
            session.add(EventRow(**values))
            n += 1
        else:
            n += insert_once(session, EventRow, values, "event_id")
    return n


def store_event_batch(sessions, batch: list[Received], rejections: Rejections) -> Verdicts:
    """A batch from the events stream (`store_batch`), stored once by event id."""
    return store_batch(
        sessions,
        batch,
        rejections,
        pattern=EVENTS_WILDCARD,
        decode=decode_event,
        table=EventRow,
        key="event_id",
        values=_event_values,
        refused=(SQLAlchemyError,),
    )


def is_silent(
    last_heartbeat_at: datetime | None, listening_since: datetime, now: datetime, limit_s: float
) -> bool:
    """A cluster is silent when no heartbeat came for `limit_s`, counted from when this
    control plane could have heard one (so a restart or a NATS outage on our side does
    not fail the fleet over). Clusters that never heart-beat are left to the operator."""
    if last_heartbeat_at is None:
        return False
    return now - max(last_heartbeat_at, listening_since) > timedelta(seconds=limit_s)


def deaf_for(slept_s: float, asked_s: float, heartbeat_interval_s: float) -> bool:
    """Whether this control plane's own loop stood still for longer than a heartbeat
    interval (a long GC pause, CPU starvation, a stopped process): a sleep of `asked_s`
    that took `slept_s`. Heartbeats sent meanwhile wait unread in the socket, so the
    silence was ours and the clusters' clocks restart from now. A control plane that
    stalls on every tick fails no one over; its judgement would be no better."""
    return slept_s - asked_s > heartbeat_interval_s


def mark_silent_unhealthy(
    session: Session,
    listening_since: datetime,
    now: datetime,
    limit_s: float,
    heard: Mapping[str, datetime] | None = None,
) -> list[str]:
    """Healthy or draining clusters that stopped heart-beating become unhealthy (their
    replicas are then re-placed and their routes dropped) and their ready replicas
    unreachable (held until ready elsewhere: `placement.hold`). Returns their ids.

    `heard`: when this control plane last received each cluster's heartbeat. Liveness is
    judged from the later of that and the stored stamp, so a heartbeat that arrived but
    still waits for its database write (a busy SQLite writer, a slow PostgreSQL) does not
    fail a healthy cluster over."""
    heard = heard or {}
    rows = session.scalars(
        select(Cluster).where(
            Cluster.status.in_([ClusterStatus.healthy.value, ClusterStatus.draining.value]),
            Cluster.last_heartbeat_at.is_not(None),
        )
    ).all()
    marked = []
    for row in rows:
        last = row.last_heartbeat_at
        arrived = heard.get(row.id)
        if arrived is not None and (last is None or arrived > last):
            last = arrived
        if not is_silent(last, listening_since, now, limit_s):
            continue
        was = row.status
        row.status = ClusterStatus.unhealthy.value
        if was == ClusterStatus.draining.value:
            row.load = {**(row.load or {}), "cordoned": True}
        session.execute(
            update(ReplicaAssignment)
            .where(
                ReplicaAssignment.cluster_id == row.id,
                ReplicaAssignment.state == ReplicaState.ready.value,
            )
            .values(state=UNREACHABLE)
        )
        session.add(
            EventRow(
                kind="cluster_unhealthy",
                cluster=row.id,
                message=f"{row.id}: no heartbeat for over {limit_s:g}s (was {was}); re-placing its replicas, "
                "its ready ones kept there until their replacements are ready",
            )
        )
        marked.append(row.id)
    return marked
