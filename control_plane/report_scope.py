"""What a cluster's reports may speak for: its own replicas, the deployments the control
plane placed on it, keys that exist, and a plausible time window.

NATS permissions and `fleet_base.wire` already bind each message to its sender's cluster;
this is the next question, whether the sender has any say in what the message is about.
A compromised cluster could otherwise bill any key, report ready replicas of any
deployment to the autoscaler, or feed a canary's guards with errors it never served. The
answer comes from the control plane's own records (`ReplicaAssignment`, the `placed`
events it wrote, `ApiKey`), never from what clusters report. The checks are pure; the
readers take a session.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.db.models import ApiKey, Deployment, ReplicaAssignment
from control_plane.db.models import Event as EventRow
from fleet_base.protocol import Heartbeat, UsageRecord

# replica id -> (cluster, deployment, version), as placed by the control plane
Placed = Mapping[str, tuple[str, str, int]]


@dataclass(frozen=True)
class UsageScope:
    """What usage records may name: keys that exist, deployments that exist, and per
    cluster the deployments placed on it now or within the window (a cluster that served
    through a partition while its replicas were re-placed still bills what it served)."""

    keys: frozenset[str] = frozenset()
    deployments: frozenset[str] = frozenset()
    served: frozenset[tuple[str, str]] = frozenset()  # (cluster, deployment)


@dataclass(frozen=True)
class TimeWindow:
    """Dates a report may carry: no further ahead than `skew_s`, no older than `max_age_s`."""

    skew_s: float
    max_age_s: float

    def problem(self, at: float, now: float) -> str | None:
        if at > now + self.skew_s:
            return "future"
        if at < now - self.max_age_s:
            return "expired"
        return None


@dataclass
class Verdict:
    """Why a report is refused: a reason (a `REFUSALS` label) and a detail for the log."""

    reason: str
    detail: str = field(default="")


def placed_replicas(session: Session) -> dict[str, tuple[str, str, int]]:
    rows = session.execute(
        select(
            ReplicaAssignment.replica_id,
            ReplicaAssignment.cluster_id,
            Deployment.name,
            ReplicaAssignment.version,
        ).join(Deployment, Deployment.id == ReplicaAssignment.deployment_id)
    ).all()
    return {rid: (cluster, name, version) for rid, cluster, name, version in rows}


def hosting(placed: Placed) -> frozenset[tuple[str, str, int]]:
    """(cluster, deployment, version) of every placed replica."""
    return frozenset(placed.values())


def usage_scope(session: Session, since: datetime) -> UsageScope:
    """Keys (revoked ones too: their last records are in flight), deployments, and what
    was placed where now or by a `placed` event since `since`. Only events the control
    plane wrote count: those have no `event_id`, which every stored agent event has."""
    now = {(cluster, name) for cluster, name, _ in placed_replicas(session).values()}
    history = session.execute(
        select(EventRow.cluster, EventRow.deployment)
        .where(
            EventRow.kind == "placed",
            EventRow.event_id.is_(None),
            EventRow.at >= since,
            EventRow.cluster.is_not(None),
            EventRow.deployment.is_not(None),
        )
        .distinct()
    ).all()
    return UsageScope(
        keys=frozenset(session.scalars(select(ApiKey.key_id)).all()),
        deployments=frozenset(session.scalars(select(Deployment.name)).all()),
        served=frozenset(now | {(c, d) for c, d in history}),
    )


def usage_refusal(record: UsageRecord, scope: UsageScope, window: TimeWindow, now: float) -> Verdict | None:
    """Why `record` may not be counted, or None. A record that carries tokens or a version
    says its cluster served the request: the deployment must be placed there. A refusal
    or failure before any replica (no tokens, no version) may come from any gateway."""
    when = window.problem(record.at, now)
    if when is not None:
        return Verdict(when, f"dated {record.at:.0f}, now {now:.0f}")
    if record.key_id not in scope.keys:
        return Verdict("unknown_key", f"key {record.key_id[:32]!r}")
    if record.deployment not in scope.deployments:
        return Verdict("not_served", f"no deployment {record.deployment[:63]!r}")
    served = record.prompt_tokens or record.completion_tokens or record.version is not None
    if served and (record.cluster, record.deployment) not in scope.served:
        return Verdict("not_served", f"{record.deployment[:63]!r} is not placed on {record.cluster}")
    return None


def scope_heartbeat(hb: Heartbeat, placed: Placed) -> tuple[Heartbeat, int]:
    """`hb` with only the replicas the control plane placed on its cluster (same id,
    deployment and version), and how many it dropped."""
    kept = [r for r in hb.replicas if placed.get(r.replica_id) == (hb.cluster, r.deployment, r.version)]
    dropped = len(hb.replicas) - len(kept)
    return (hb.model_copy(update={"replicas": kept}) if dropped else hb), dropped
