"""Bulk import of capacity pools from a provider catalog (`fleetctl pools import`).

Each pool belongs to a cluster record per (provider, region), id `<provider>-<region>`,
created on first import with the region's coordinates (control_plane.geo). Such a
cluster is a capacity record: the placer may place onto it; an agent that later runs
with that cluster id takes it over, and from then on its heartbeats own the pool
inventory (pools it does not report are dropped, as for any agent)."""

from __future__ import annotations

from collections import defaultdict
from typing import Annotated, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, StringConstraints, field_validator
from sqlalchemy import select
from sqlalchemy.orm import selectinload

from control_plane.api.audit import audit, event
from control_plane.api.deps import PrincipalDep, SessionDep, kick
from control_plane.api.errors import conflict
from control_plane.api.schemas import PoolIn, Strict
from control_plane.catalog.parse import cluster_id as catalog_cluster_id
from control_plane.db.models import Cluster, ReplicaAssignment
from control_plane.geo.regions import REGION_COORDS
from fleet_base.residency import Jurisdiction

router = APIRouter(tags=["clusters"])

MAX_IMPORT = 10_000
Region = Annotated[str, StringConstraints(min_length=1, max_length=50, pattern=r"^[a-z0-9][a-z0-9-]*$")]


class ImportedPool(PoolIn):
    region: Region
    # the region's jurisdiction from the catalog ("" leaves the cluster's as it is)
    jurisdiction: Jurisdiction | Literal[""] = ""


class PoolImport(Strict):
    provider: Annotated[str, StringConstraints(min_length=1, max_length=12, pattern=r"^[a-z0-9]+$")]
    pools: list[ImportedPool] = Field(min_length=1, max_length=MAX_IMPORT)
    # Also drop the imported clusters' pools that this import does not name (unless in use).
    replace: bool = False

    @field_validator("pools")
    @classmethod
    def _unique(cls, pools: list[ImportedPool]) -> list[ImportedPool]:
        seen: set[tuple[str, str]] = set()
        labels: dict[str, str] = {}
        for p in pools:
            if (p.region, p.name) in seen:
                raise ValueError(f"pool {p.name!r} repeats in region {p.region!r}")
            seen.add((p.region, p.name))
            if p.jurisdiction and labels.setdefault(p.region, p.jurisdiction) != p.jurisdiction:
                raise ValueError(f"region {p.region!r} is given two jurisdictions")
        return pools


class PoolImportOut(BaseModel):
    provider: str
    clusters: list[str]
    clusters_created: int
    pools_created: int
    pools_updated: int
    pools_unchanged: int
    pools_removed: int
    kept_in_use: list[str] = Field(default_factory=list)  # replace: pools not removed, replicas run there


@router.post("/v1/pools/import", response_model=PoolImportOut)
def import_pools(body: PoolImport, request: Request, session: SessionDep, who: PrincipalDep):
    by_cluster: dict[str, list[ImportedPool]] = defaultdict(list)
    regions: dict[str, str] = {}
    jurisdictions: dict[str, str] = {}
    for p in body.pools:
        cid = catalog_cluster_id(body.provider, p.region)
        by_cluster[cid].append(p)
        regions[cid] = p.region
        if p.jurisdiction:
            jurisdictions[cid] = p.jurisdiction
    existing = {
        c.id: c
        for c in session.scalars(
            select(Cluster).where(Cluster.id.in_(list(by_cluster))).options(selectinload(Cluster.pools))
        )
    }
    out = PoolImportOut(
        provider=body.provider,
        clusters=sorted(by_cluster),
        clusters_created=0,
        pools_created=0,
        pools_updated=0,
        pools_unchanged=0,
        pools_removed=0,
    )
    for cid, pools in sorted(by_cluster.items()):
        cluster = existing.get(cid)
        if cluster is None:
            lat, lon = REGION_COORDS.get(f"{body.provider}:{regions[cid]}", (0.0, 0.0))
            cluster = Cluster(
                id=cid,
                provider=body.provider,
                region=regions[cid],
                lat=lat,
                lon=lon,
                status="healthy",
                load={},
                jurisdiction=jurisdictions.get(cid, ""),
            )
            session.add(cluster)
            out.clusters_created += 1
            event(
                session,
                "cluster_registered",
                f"{cid} registered by catalog import ({who.actor})",
                cluster=cid,
            )
        elif cluster.provider != body.provider or cluster.region != regions[cid]:
            raise conflict(
                f"cluster {cid!r} exists with provider {cluster.provider!r} and region {cluster.region!r}",
                "pools",
            )
        elif cid in jurisdictions and cluster.jurisdiction != jurisdictions[cid]:
            if cluster.jurisdiction:  # a policy boundary moves only by `fleetctl clusters set`
                raise conflict(
                    f"cluster {cid!r} is in jurisdiction {cluster.jurisdiction!r}, the catalog says "
                    f"{jurisdictions[cid]!r}; change it with `fleetctl clusters set {cid} --jurisdiction`",
                    "pools",
                )
            cluster.jurisdiction = jurisdictions[cid]
        have = {p.name: p for p in cluster.pools}
        for p in pools:
            done = cluster.set_pool(have, p.name, p.model_dump(exclude={"region", "name", "jurisdiction"}))
            setattr(out, f"pools_{done}", getattr(out, f"pools_{done}") + 1)
        if body.replace and have:
            busy = set(
                session.scalars(
                    select(ReplicaAssignment.pool_name).where(
                        ReplicaAssignment.cluster_id == cid, ReplicaAssignment.pool_name.in_(list(have))
                    )
                )
            )
            for name, row in have.items():
                if name in busy:
                    out.kept_in_use.append(f"{cid}/{name}")
                else:
                    cluster.pools.remove(row)
                    out.pools_removed += 1
    session.flush()
    audit(session, who, "pool.import", "pool", f"{body.provider}:{len(body.pools)}", None, out.model_dump())
    session.commit()
    kick(request)
    return out
