"""Clusters and their capacity pools. Agents register clusters with their first
heartbeat; operators may register one by hand, cordon it (`draining`: keeps serving,
gets nothing new), and delete it once no replica is assigned to it."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query, Request
from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from control_plane.api.audit import audit, event
from control_plane.api.deps import PagingDep, PrincipalDep, SessionDep, insert, kick, where_equal
from control_plane.api.errors import conflict, not_found
from control_plane.api.schemas import ClusterCreate, ClusterOut, ClusterUpdate, Page, PoolIn, PoolOut
from control_plane.api.views import clusters_out, pool_out, used_gpus
from control_plane.db.models import CapacityPool, Cluster, ReplicaAssignment

router = APIRouter(tags=["clusters"])


def _load(session: Session, cluster_id: str) -> Cluster:
    row = session.scalar(select(Cluster).where(Cluster.id == cluster_id).options(selectinload(Cluster.pools)))
    if row is None:
        raise not_found("cluster", cluster_id)
    return row


def _view(session: Session, row: Cluster) -> ClusterOut:
    return clusters_out(session, [row])[0]


@router.get("/v1/clusters", response_model=Page[ClusterOut])
def list_clusters(
    session: SessionDep,
    who: PrincipalDep,
    page: PagingDep,
    status: Literal["healthy", "unhealthy", "draining"] | None = Query(None),
    region: str | None = Query(None, max_length=63),
    provider: str | None = Query(None, max_length=63),
):
    query = select(Cluster).options(selectinload(Cluster.pools)).order_by(Cluster.id)
    query = where_equal(
        query, (Cluster.status, status), (Cluster.region, region), (Cluster.provider, provider)
    )
    rows, total = page.apply(session, query)
    return Page(items=clusters_out(session, rows), total=total, limit=page.limit, offset=page.offset)


@router.get("/v1/clusters/{cluster_id}", response_model=ClusterOut)
def get_cluster(cluster_id: str, session: SessionDep, who: PrincipalDep):
    return _view(session, _load(session, cluster_id))


@router.post("/v1/clusters", status_code=201, response_model=ClusterOut)
def create_cluster(body: ClusterCreate, request: Request, session: SessionDep, who: PrincipalDep):
    if session.get(Cluster, body.id) is not None:
        raise conflict(f"cluster {body.id!r} already exists", "id")
    row = Cluster(
        id=body.id,
        provider=body.provider,
        region=body.region,
        lat=body.lat,
        lon=body.lon,
        gateway_url=body.gateway_url,
        status=body.status,
        jurisdiction=body.jurisdiction,
        load={},
    )
    row.pools = [CapacityPool(**pool.model_dump()) for pool in body.pools]
    insert(session, row, conflict(f"cluster {body.id!r} already exists", "id"))
    after = _view(session, row)
    audit(session, who, "cluster.create", "cluster", row.id, None, after)
    event(session, "cluster_registered", f"{row.id} registered by {who.actor}", cluster=row.id)
    session.commit()
    kick(request)
    return after


@router.patch("/v1/clusters/{cluster_id}", response_model=ClusterOut)
def update_cluster(
    cluster_id: str, body: ClusterUpdate, request: Request, session: SessionDep, who: PrincipalDep
):
    row = _load(session, cluster_id)
    before = _view(session, row)
    changes = {k: v for k, v in body.model_dump(exclude_unset=True).items() if v is not None}
    changes = {k: v for k, v in changes.items() if getattr(row, k) != v}
    if not changes:
        return before
    if changes.get("status") == "healthy" and row.status == "unhealthy":
        raise conflict(
            f"cluster {cluster_id!r} is unhealthy (missed heartbeats); it turns healthy with its next heartbeat",
            "status",
        )
    for key, value in changes.items():
        setattr(row, key, value)
    if changes.get("status") == "healthy" and (row.load or {}).get("cordoned"):
        row.load = {k: v for k, v in row.load.items() if k != "cordoned"}  # uncordon outlives outages too
    session.flush()
    after = _view(session, row)
    action = {"draining": "cluster.cordon", "healthy": "cluster.uncordon"}.get(
        changes.get("status"), "cluster.update"
    )
    audit(session, who, action, "cluster", row.id, before, after)
    if "jurisdiction" in changes:
        event(
            session,
            "cluster_jurisdiction",
            f"{row.id}: jurisdiction {before.jurisdiction or '(none)'} -> {row.jurisdiction or '(none)'} "
            f"by {who.actor}",
            cluster=row.id,
        )
    if "status" in changes:
        event(
            session,
            "cluster_" + changes["status"],
            f"{row.id}: status {before.status} -> {row.status} by {who.actor}",
            cluster=row.id,
        )
    session.commit()
    kick(request)
    return after


@router.delete("/v1/clusters/{cluster_id}", response_model=ClusterOut)
def delete_cluster(cluster_id: str, request: Request, session: SessionDep, who: PrincipalDep):
    row = _load(session, cluster_id)
    before = _view(session, row)
    if before.replicas:
        raise conflict(
            f"cluster {cluster_id!r} has {before.replicas} replica(s) assigned; stop its agent (its replicas "
            "are re-placed once it is unhealthy, and given up once ready elsewhere or "
            "FLEET_UNREACHABLE_HOLD_S after its last heartbeat) or delete those deployments first"
        )
    session.delete(row)
    audit(session, who, "cluster.delete", "cluster", cluster_id, before, None)
    event(session, "cluster_deleted", f"{cluster_id} deleted by {who.actor}", cluster=cluster_id)
    session.commit()
    kick(request)
    return before


# --------------------------------------------------------------------- pools


@router.get("/v1/pools", response_model=Page[PoolOut])
def list_pools(
    session: SessionDep,
    who: PrincipalDep,
    page: PagingDep,
    cluster: str | None = Query(None, max_length=63),
    gpu_model: str | None = Query(None, max_length=63),
    tier: Literal["reserved", "on-demand", "spot"] | None = Query(None),
    region: str | None = Query(None, max_length=63),
):
    query = (
        select(CapacityPool)
        .join(Cluster, Cluster.id == CapacityPool.cluster_id)
        .options(selectinload(CapacityPool.cluster))
        .order_by(CapacityPool.cluster_id, CapacityPool.name)
    )
    query = where_equal(
        query,
        (CapacityPool.cluster_id, cluster),
        (CapacityPool.gpu_model, gpu_model),
        (CapacityPool.tier, tier),
        (Cluster.region, region),
    )
    rows, total = page.apply(session, query)
    used = used_gpus(session, sorted({p.cluster_id for p in rows}))
    items = [pool_out(p, p.cluster.region, used) for p in rows]
    return Page(items=items, total=total, limit=page.limit, offset=page.offset)


@router.post("/v1/clusters/{cluster_id}/pools", status_code=201, response_model=PoolOut)
def create_pool(cluster_id: str, body: PoolIn, request: Request, session: SessionDep, who: PrincipalDep):
    cluster = _load(session, cluster_id)
    if any(p.name == body.name for p in cluster.pools):
        raise conflict(f"cluster {cluster_id!r} already has a pool {body.name!r}", "name")
    pool = CapacityPool(cluster_id=cluster_id, **body.model_dump())
    insert(session, pool, conflict(f"cluster {cluster_id!r} already has a pool {body.name!r}", "name"))
    after = pool_out(pool, cluster.region, used_gpus(session, [cluster_id]))
    audit(session, who, "pool.create", "pool", f"{cluster_id}/{body.name}", None, after)
    session.commit()
    kick(request)
    return after


@router.delete("/v1/clusters/{cluster_id}/pools/{name}", response_model=PoolOut)
def delete_pool(cluster_id: str, name: str, request: Request, session: SessionDep, who: PrincipalDep):
    cluster = _load(session, cluster_id)
    pool = next((p for p in cluster.pools if p.name == name), None)
    if pool is None:
        raise not_found(f"pool of cluster {cluster_id}", name)
    before = pool_out(pool, cluster.region, used_gpus(session, [cluster_id]))
    in_use = session.scalar(
        select(ReplicaAssignment.replica_id).where(
            ReplicaAssignment.cluster_id == cluster_id, ReplicaAssignment.pool_name == name
        )
    )
    if in_use is not None:
        raise conflict(f"pool {cluster_id}/{name} still runs replicas (e.g. {in_use})")
    cluster.pools.remove(pool)
    audit(session, who, "pool.delete", "pool", f"{cluster_id}/{name}", before, None)
    session.commit()
    kick(request)
    return before


# Bulk pool import from provider catalogs (POST /v1/pools/import) lives in its own module.
from control_plane.api.routers.catalog import router as _catalog_router  # noqa: E402

router.include_router(_catalog_router)
