"""Database rows -> API bodies. The deployment status view joins what is wanted (the
current version, desired replicas) with what runs (assignments and their states)."""

from __future__ import annotations

from collections import Counter

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from control_plane.api.schemas import (
    AuditOut,
    ClusterOut,
    DeploymentStatus,
    DeploymentSummary,
    EventOut,
    KeyOut,
    PipelineClusterReadiness,
    PipelineStatus,
    PipelineStepOut,
    PipelineSummary,
    Placement,
    PoolOut,
    VersionOut,
)
from control_plane.db.models import (
    ApiKey,
    AuditRecord,
    CapacityPool,
    Cluster,
    Deployment,
    DeploymentVersion,
    Event,
    Pipeline,
    ReplicaAssignment,
)
from fleet_base.domain import pool_shape

READY = "ready"


def version_out(row: DeploymentVersion, current: int, counts: Counter | None = None) -> VersionOut:
    return VersionOut(
        version=row.version,
        model=row.model,
        engine=row.engine or "fleet",
        engine_args=dict(row.engine_args or {}),
        gpu_models=list(row.gpu_models or []),
        gpu_count=row.gpu_count,
        gpu_memory_gb=row.gpu_memory_gb,
        min_replicas=row.min_replicas,
        max_replicas=row.max_replicas,
        autoscale_window_s=row.autoscale_window_s,
        scale_down_delay_s=row.scale_down_delay_s,
        target_concurrency=row.target_concurrency,
        scale_to_zero=row.scale_to_zero,
        slo_ttft_s=row.slo_ttft_s,
        slo_itl_s=row.slo_itl_s,
        regions=list(row.regions or []),
        min_regions=row.min_regions,
        standby_regions=list(row.standby_regions or []),
        created_at=row.created_at,
        replicas=(counts or Counter())[row.version],
        current=row.version == current,
    )


def _ready_counts(session: Session, deployment_ids: list[int]) -> dict[int, int]:
    if not deployment_ids:
        return {}
    rows = session.execute(
        select(ReplicaAssignment.deployment_id, func.count())
        .where(ReplicaAssignment.deployment_id.in_(deployment_ids), ReplicaAssignment.state == READY)
        .group_by(ReplicaAssignment.deployment_id)
    )
    return {dep_id: count for dep_id, count in rows}


def deployment_summaries(session: Session, rows: list[Deployment]) -> list[DeploymentSummary]:
    ready = _ready_counts(session, [d.id for d in rows])
    out = []
    for dep in rows:
        current = dep.version_row()
        out.append(
            DeploymentSummary(
                name=dep.name,
                model=current.model if current else "",
                engine=(current.engine if current else None) or "fleet",
                current_version=dep.current_version,
                desired_replicas=dep.replicas,
                ready_replicas=ready.get(dep.id, 0),
                min_replicas=current.min_replicas if current else 0,
                max_replicas=current.max_replicas if current else 0,
                priority=dep.priority,
                max_surge=dep.max_surge,
                max_unavailable=dep.max_unavailable,
                adapters=list(dep.adapters or []),
                max_adapters=dep.max_adapters or 0,
                residency=None if dep.residency is None else list(dep.residency),
                created_at=dep.created_at,
                updated_at=dep.updated_at,
            )
        )
    return out


def deployment_status(session: Session, dep: Deployment) -> DeploymentStatus:
    assignments = list(
        session.scalars(
            select(ReplicaAssignment)
            .where(ReplicaAssignment.deployment_id == dep.id)
            .order_by(ReplicaAssignment.created_at, ReplicaAssignment.replica_id)
        )
    )
    clusters = session.execute(
        select(Cluster.id, Cluster.region, Cluster.load).where(
            Cluster.id.in_({a.cluster_id for a in assignments})
        )
    ).all()
    regions = {c.id: c.region for c in clusters}
    startup = {c.id: (c.load or {}).get("startup", {}) for c in clusters}
    counts = Counter(a.version for a in assignments)
    versions = [version_out(v, dep.current_version, counts) for v in dep.versions]
    current = next(v for v in versions if v.current)
    summary = deployment_summaries(session, [dep])[0]
    return DeploymentStatus(
        **summary.model_dump(),
        spec=current,
        versions=versions,
        placements=[
            Placement(
                replica_id=a.replica_id,
                cluster=a.cluster_id,
                region=regions.get(a.cluster_id, ""),
                pool=a.pool_name,
                version=a.version,
                state=a.state,
                url=a.url,
                gpus=a.gpus,
                startup=startup.get(a.cluster_id, {}).get(a.replica_id, {}),
            )
            for a in assignments
        ],
    )


def _ready_by_cluster(session: Session, deployments: set[str]) -> dict[tuple[str, str], int]:
    """(deployment name, cluster) -> ready replicas, any version."""
    if not deployments:
        return {}
    rows = session.execute(
        select(Deployment.name, ReplicaAssignment.cluster_id, func.count())
        .join(Deployment, Deployment.id == ReplicaAssignment.deployment_id)
        .where(Deployment.name.in_(deployments), ReplicaAssignment.state == READY)
        .group_by(Deployment.name, ReplicaAssignment.cluster_id)
    )
    return {(name, cluster): count for name, cluster, count in rows}


def _readiness(row: Pipeline, clusters: list[tuple[str, str]], ready: dict[tuple[str, str], int]):
    out = []
    for cluster, region in clusters:
        steps = {s["name"]: ready.get((s["deployment"], cluster), 0) for s in row.steps}
        out.append(
            PipelineClusterReadiness(
                cluster=cluster, region=region, ready=bool(steps) and all(steps.values()), steps=steps
            )
        )
    return out


def pipeline_summaries(session: Session, rows: list[Pipeline]) -> list[PipelineStatus]:
    """Each pipeline with its readiness on every registered cluster (one query for all)."""
    ready = _ready_by_cluster(session, {s["deployment"] for row in rows for s in row.steps})
    clusters = [
        (c.id, c.region) for c in session.execute(select(Cluster.id, Cluster.region).order_by(Cluster.id))
    ]
    out = []
    for row in rows:
        readiness = _readiness(row, clusters, ready)
        out.append(
            PipelineStatus(
                name=row.name,
                steps=[PipelineStepOut(**s) for s in row.steps],
                slo_e2e_s=row.slo_e2e_s,
                ready_clusters=[c.cluster for c in readiness if c.ready],
                clusters=readiness,
                created_at=row.created_at,
                updated_at=row.updated_at,
            )
        )
    return out


def pipeline_summary(status: PipelineStatus) -> PipelineSummary:
    return PipelineSummary(**status.model_dump(exclude={"clusters"}))


def used_gpus(session: Session, cluster_ids: list[str] | None = None) -> dict[tuple[str, str], int]:
    query = select(
        ReplicaAssignment.cluster_id, ReplicaAssignment.pool_name, func.sum(ReplicaAssignment.gpus)
    )
    if cluster_ids is not None:
        query = query.where(ReplicaAssignment.cluster_id.in_(cluster_ids))
    rows = session.execute(query.group_by(ReplicaAssignment.cluster_id, ReplicaAssignment.pool_name))
    return {(c, p): int(n or 0) for c, p, n in rows}


def pool_out(pool: CapacityPool, region: str, used: dict[tuple[str, str], int]) -> PoolOut:
    total = pool.nodes * pool.gpus_per_node
    in_use = used.get((pool.cluster_id, pool.name), 0)
    return PoolOut(
        cluster=pool.cluster_id,
        region=region,
        jurisdiction=pool.cluster.jurisdiction or "",
        name=pool.name,
        **pool_shape(pool),
        total_gpus=total,
        used_gpus=in_use,
        free_gpus=max(0, total - in_use),
    )


# What a cluster's API view copies from its row as it is.
_CLUSTER_COLUMNS = (
    "id",
    "provider",
    "region",
    "lat",
    "lon",
    "status",
    "gateway_url",
    "jurisdiction",
    "last_heartbeat_at",
    "created_at",
)


def clusters_out(session: Session, rows: list[Cluster]) -> list[ClusterOut]:
    ids = [c.id for c in rows]
    used = used_gpus(session, ids)
    replicas = dict(
        session.execute(
            select(ReplicaAssignment.cluster_id, func.count())
            .where(ReplicaAssignment.cluster_id.in_(ids))
            .group_by(ReplicaAssignment.cluster_id)
        ).all()
    )
    return [
        ClusterOut(
            **{column: getattr(c, column) for column in _CLUSTER_COLUMNS},
            load=dict(c.load or {}),
            replicas=replicas.get(c.id, 0),
            pools=[pool_out(p, c.region, used) for p in c.pools],
        )
        for c in rows
    ]


def key_out(row: ApiKey) -> KeyOut:
    return KeyOut(
        key_id=row.key_id,
        name=row.name,
        scopes=list(row.scopes or []),
        deployments=None if row.deployments is None else list(row.deployments),
        quotas=dict(row.quotas or {}),
        residency=None if row.residency is None else list(row.residency),
        team=row.team,
        created_at=row.created_at,
        revoked_at=row.revoked_at,
        revoked=row.revoked_at is not None,
    )


def event_out(row: Event) -> EventOut:
    return EventOut.model_validate(row, from_attributes=True)


def audit_out(row: AuditRecord) -> AuditOut:
    return AuditOut.model_validate(row, from_attributes=True)
