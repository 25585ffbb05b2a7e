"""The fleet as the control loops see it: plain, immutable rows read from the database
in one go, so every decision after the read is a pure function of this snapshot."""

from __future__ import annotations

import time
from collections.abc import Collection
from datetime import datetime, timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import func, select
from sqlalchemy.orm import Session, selectinload

from control_plane.cost.budget_store import exhausted_teams
from control_plane.db.models import (
    ApiKey,
    Cluster,
    Deployment,
    Node,
    NodeFaultRecord,
    ReplicaAssignment,
    utcnow,
)
from control_plane.placement.base import PRIORITY_RANK, PriorityClass
from control_plane.placement.reliability import RELIABILITY_WINDOW_S
from control_plane.rollouts.store import RolloutPlan, plans
from control_plane.rollouts.surge import DEFAULT_MAX_SURGE, DEFAULT_MAX_UNAVAILABLE
from fleet_base.api_keys import ApiKeyRecord, Quotas
from fleet_base.domain import ClusterStatus, Coordinates, PoolShape, Tier, pool_shape
from fleet_base.engines import ENGINE_KINDS, EngineKind


class _Row(BaseModel):
    model_config = ConfigDict(frozen=True)


class VersionSpec(_Row):
    deployment: str
    version: int
    model: str
    engine: EngineKind = "fleet"
    engine_args: dict[str, Any] = Field(default_factory=dict)
    gpu_models: tuple[str, ...] = ()
    gpu_count: int = 1
    gpu_memory_gb: float = 0.0
    regions: tuple[str, ...] = ()
    min_regions: int = 1
    standby_regions: tuple[str, ...] = ()  # active-passive (control_plane.fleet_model.standby)
    min_replicas: int = 1  # 0: the deployment may scale to zero (its route stays)


class DeploymentRow(_Row):
    name: str
    replicas: int  # desired
    current_version: int
    variant_mix: dict[str, int] = Field(default_factory=dict)  # autoscaler's GPU mix; empty: any
    priority: PriorityClass = "standard"
    max_surge: str = DEFAULT_MAX_SURGE
    max_unavailable: str = DEFAULT_MAX_UNAVAILABLE
    adapters: tuple[tuple[str, str], ...] = ()  # LoRA (name, uri), unversioned
    max_adapters: int = 0
    # the jurisdictions its replicas may run and its requests be processed in; None: any
    residency: tuple[str, ...] | None = None


class PoolRow(PoolShape, _Row):
    name: str


class ClusterRow(_Row):
    id: str
    provider: str = "local"
    region: str = ""
    coordinates: Coordinates = Field(default_factory=Coordinates)
    status: ClusterStatus = ClusterStatus.healthy
    gateway_url: str = ""
    last_heartbeat_at: datetime | None = None
    jurisdiction: str = ""  # "" is outside every residency policy
    pools: tuple[PoolRow, ...] = ()


class AssignmentRow(_Row):
    replica_id: str
    deployment: str
    version: int
    cluster: str
    pool: str
    gpus: int = 1
    state: str = "pending"
    url: str = ""


class NodeRow(_Row):
    """A node as the agent last reported it, with the operator's latest action."""

    cluster: str
    node: str
    state: str = "healthy"
    pool: str = ""
    gpus: int = 0
    action: str | None = None  # cordon | uncordon
    action_at: float | None = None  # Unix seconds
    action_reason: str = ""


class FleetSnapshot(_Row):
    deployments: tuple[DeploymentRow, ...] = ()
    specs: dict[tuple[str, int], VersionSpec] = Field(default_factory=dict)
    clusters: tuple[ClusterRow, ...] = ()
    assignments: tuple[AssignmentRow, ...] = ()
    keys: tuple[ApiKeyRecord, ...] = ()  # not revoked
    rollouts: dict[str, RolloutPlan] = Field(default_factory=dict)  # active canary rollouts by deployment
    nodes: tuple[NodeRow, ...] = ()
    # node faults in the reliability window (control_plane.placement.reliability) by
    # (cluster, pool) and by provider
    pool_faults: dict[tuple[str, str], int] = Field(default_factory=dict)
    provider_faults: dict[str, int] = Field(default_factory=dict)


def _status(value: str) -> ClusterStatus:
    try:
        return ClusterStatus(value)
    except ValueError:
        return ClusterStatus.unhealthy  # an unknown status never gets replicas


def _tier(value: str) -> Tier:
    try:
        return Tier(value)
    except ValueError:
        return Tier.spot  # unknown: least preferred


def read_snapshot(session: Session) -> FleetSnapshot:
    deployments = session.scalars(
        select(Deployment).options(selectinload(Deployment.versions)).order_by(Deployment.name)
    ).all()
    clusters = session.scalars(
        select(Cluster).options(selectinload(Cluster.pools)).order_by(Cluster.id)
    ).all()
    names = {d.id: d.name for d in deployments}
    assignments = session.scalars(select(ReplicaAssignment).order_by(ReplicaAssignment.replica_id)).all()
    keys = session.scalars(select(ApiKey).where(ApiKey.revoked_at.is_(None)).order_by(ApiKey.key_id)).all()
    return FleetSnapshot(
        rollouts=plans(session),
        deployments=tuple(
            DeploymentRow(
                name=d.name,
                replicas=d.replicas,
                current_version=d.current_version,
                variant_mix={str(k): int(v) for k, v in (d.variant_mix or {}).items()},
                priority=d.priority if d.priority in PRIORITY_RANK else "standard",
                max_surge=d.max_surge,
                max_unavailable=d.max_unavailable,
                adapters=tuple((a["name"], a["uri"]) for a in d.adapters or []),
                max_adapters=d.max_adapters or 0,
                residency=None if d.residency is None else tuple(d.residency),
            )
            for d in deployments
        ),
        specs={
            (d.name, v.version): VersionSpec(
                deployment=d.name,
                version=v.version,
                model=v.model,
                engine=v.engine or "fleet",
                engine_args=dict(v.engine_args or {}),
                gpu_models=tuple(v.gpu_models or ()),
                gpu_count=v.gpu_count,
                gpu_memory_gb=v.gpu_memory_gb,
                regions=tuple(v.regions or ()),
                min_regions=v.min_regions,
                standby_regions=tuple(v.standby_regions or ()),
                min_replicas=v.min_replicas,
            )
            for d in deployments
            for v in d.versions
            # an engine this control plane does not know (a newer one's row) is never placed
            # as another: the version is left out, as if absent
            if (v.engine or "fleet") in ENGINE_KINDS
        },
        clusters=tuple(
            ClusterRow(
                id=c.id,
                provider=c.provider,
                region=c.region,
                coordinates=Coordinates(lat=c.lat, lon=c.lon),
                status=_status(c.status),
                gateway_url=c.gateway_url,
                last_heartbeat_at=c.last_heartbeat_at,
                jurisdiction=c.jurisdiction or "",
                pools=tuple(
                    PoolRow(name=p.name, **{**pool_shape(p), "tier": _tier(p.tier)}) for p in c.pools
                ),
            )
            for c in clusters
        ),
        assignments=tuple(
            AssignmentRow(
                replica_id=a.replica_id,
                deployment=names[a.deployment_id],
                version=a.version,
                cluster=a.cluster_id,
                pool=a.pool_name,
                gpus=a.gpus,
                state=a.state,
                url=a.url,
            )
            for a in assignments
            if a.deployment_id in names
        ),
        keys=tuple(key_record(k) for k in keys),
        nodes=tuple(
            NodeRow(
                cluster=n.cluster,
                node=n.node,
                state=n.state,
                pool=n.pool or "",
                gpus=n.gpus,
                action=n.action,
                action_at=None if n.action_at is None else n.action_at.timestamp(),
                action_reason=n.action_reason or "",
            )
            for n in session.scalars(select(Node).order_by(Node.cluster, Node.node))
        ),
        **recent_faults(session, utcnow() - timedelta(seconds=RELIABILITY_WINDOW_S)),
    )


def recent_faults(session: Session, since: datetime) -> dict[str, dict]:
    """Node faults (not an out-of-memory nor an application XID) since `since`, counted by (cluster, pool)
    and by provider: what the placer's reliability price reads."""
    counted = session.execute(
        select(NodeFaultRecord.cluster, NodeFaultRecord.pool, NodeFaultRecord.provider, func.count())
        .where(NodeFaultRecord.at >= since, NodeFaultRecord.node_fault.is_(True))
        .group_by(NodeFaultRecord.cluster, NodeFaultRecord.pool, NodeFaultRecord.provider)
    ).all()
    pools: dict[tuple[str, str], int] = {}
    providers: dict[str, int] = {}
    for cluster, pool, provider, n in counted:
        pools[(cluster, pool)] = pools.get((cluster, pool), 0) + n
        providers[provider] = providers.get(provider, 0) + n
    return {"pool_faults": pools, "provider_faults": providers}


def key_record(k: ApiKey, exhausted_teams: Collection[str] = ()) -> ApiKeyRecord:
    """A key row as gateways see it (salt and hash, never a secret); a key of a team in
    `exhausted_teams` (a hard monthly budget, spent) is marked for refusal."""
    return ApiKeyRecord(
        key_id=k.key_id,
        name=k.name,
        salt=k.salt,
        hash=k.hash,
        scopes=list(k.scopes or []),
        deployments=None if k.deployments is None else list(k.deployments),
        quotas=Quotas.model_validate(k.quotas or {}),
        shares=dict(k.shares or {}),
        created_at=k.created_at.timestamp(),
        residency=None if k.residency is None else list(k.residency),
        team=k.team,
        budget_exhausted=k.team is not None and k.team in exhausted_teams,
        webhook_secret_version=k.webhook_secret_version or 0,
    )


def live_keys(session: Session) -> list[ApiKeyRecord]:
    """Every key not revoked, by id, each marked when its team's hard budget is spent."""
    rows = session.scalars(select(ApiKey).where(ApiKey.revoked_at.is_(None)).order_by(ApiKey.key_id)).all()
    exhausted = exhausted_teams(session, time.time())
    return [key_record(k, exhausted) for k in rows]
