"""Pipelines: deployments that serve one request together, placed in the same clusters.
A write kicks the reconcile loop, which places the steps together (or reports why not)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request
from pydantic import BaseModel, ValidationError
from sqlalchemy import select

from control_plane.api.audit import audit, event
from control_plane.api.deps import PagingDep, PrincipalDep, SessionDep, insert, kick
from control_plane.api.errors import conflict, invalid, not_found
from control_plane.api.routers.usage import parse_since
from control_plane.api.schemas import Page, PipelineCreate, PipelineStatus, PipelineSummary
from control_plane.api.views import pipeline_summaries, pipeline_summary
from control_plane.db.models import Pipeline, UsageRecord
from control_plane.pipelines import load_pipeline, missing_deployments, row_of
from fleet_base.domain import DEPLOYMENT_NAME_PATTERN

router = APIRouter(prefix="/v1/pipelines", tags=["pipelines"])
# A name no pipeline can have is a 422 before any query (a NUL is one PostgreSQL refuses).
NameParam = Annotated[str, Path(pattern=DEPLOYMENT_NAME_PATTERN, max_length=63)]


def _load(session, name: str) -> Pipeline:
    row = load_pipeline(session, name)
    if row is None:
        raise not_found("pipeline", name)
    return row


@router.post("", status_code=201, response_model=PipelineStatus)
def create_pipeline(body: PipelineCreate, request: Request, session: SessionDep, who: PrincipalDep):
    """Every step must name an existing deployment (422 naming the missing ones); their rows
    are locked until commit so a concurrent delete cannot slip between check and insert."""
    try:
        spec = body.spec()
    except ValidationError as exc:
        raise invalid(
            "steps", "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
        ) from None
    if load_pipeline(session, spec.name) is not None:
        raise conflict(f"pipeline {spec.name!r} already exists (delete it first to change it)", "name")
    if missing := missing_deployments(session, spec, lock=True):
        steps = [f"{s.name} -> {s.deployment}" for s in spec.steps if s.deployment in missing]
        raise invalid("steps", f"deployment(s) not found: {', '.join(steps)} (create them first)")
    row = row_of(spec)
    insert(session, row, conflict(f"pipeline {spec.name!r} already exists", "name"))
    status = pipeline_summaries(session, [row])[0]
    audit(session, who, "pipeline.create", "pipeline", row.name, None, status)
    event(
        session,
        "pipeline_created",
        f"{row.name}: steps {', '.join(f'{s.name}={s.deployment}' for s in spec.steps)}",
    )
    session.commit()
    kick(request)
    return status


@router.get("", response_model=Page[PipelineSummary])
def list_pipelines(session: SessionDep, who: PrincipalDep, page: PagingDep):
    rows, total = page.apply(session, select(Pipeline).order_by(Pipeline.name))
    items = [pipeline_summary(s) for s in pipeline_summaries(session, rows)]
    return Page(items=items, total=total, limit=page.limit, offset=page.offset)


@router.get("/{name}", response_model=PipelineStatus)
def get_pipeline(name: NameParam, session: SessionDep, who: PrincipalDep):
    return pipeline_summaries(session, [_load(session, name)])[0]


@router.delete("/{name}", response_model=PipelineStatus)
def delete_pipeline(name: NameParam, request: Request, session: SessionDep, who: PrincipalDep):
    """The deployments stay (and become deletable); their replicas may spread again."""
    row = _load(session, name)
    before = pipeline_summaries(session, [row])[0]
    session.delete(row)
    audit(session, who, "pipeline.delete", "pipeline", name, before, None)
    event(session, "pipeline_deleted", f"{name}: deleted (its deployments stay)")
    session.commit()
    kick(request)
    return before


class PipelineHop(BaseModel):
    at: datetime
    step: str | None
    deployment: str
    cluster: str
    region: str
    status: int
    latency_s: float


class PipelineRequestHops(BaseModel):
    request: str
    clusters: list[str]  # where its served hops ran; more than one: the request was split
    split: bool
    refused_hops: int  # hops refused or failed (status >= 400): recorded, not where it ran
    hops: list[PipelineHop]


class PipelineRequests(BaseModel):
    """Where each pipeline request's hops ran, from the stored usage records."""

    pipeline: str
    since: datetime
    requests: int
    split: int  # requests whose hops ran in more than one cluster
    by_cluster: dict[str, int]  # requests served whole in each cluster
    items: list[PipelineRequestHops]


@router.get("/{name}/requests", response_model=PipelineRequests)
def pipeline_requests(
    name: NameParam,
    session: SessionDep,
    who: PrincipalDep,
    since: Annotated[str, Query(max_length=64)] = "1h",
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
):
    """The newest `limit` hop records (not requests) since `since`, grouped by request. Where
    a request ran (`clusters`, `split`) counts only hops that were served (status < 400): a
    gateway that refused a hop, or whose forward failed, records it too, elsewhere."""
    _load(session, name)
    now = datetime.now(timezone.utc)
    start = parse_since(since, now)
    rows = session.scalars(
        select(UsageRecord)
        .where(UsageRecord.pipeline == name, UsageRecord.at >= start, UsageRecord.shadow.is_(False))
        .order_by(UsageRecord.at.desc(), UsageRecord.id.desc())
        .limit(limit)
    ).all()
    grouped: dict[str, list[UsageRecord]] = {}
    for r in reversed(rows):
        grouped.setdefault(r.pipeline_request or f"record-{r.id}", []).append(r)
    items = []
    by_cluster: dict[str, int] = {}
    for request_id, hops in grouped.items():
        clusters = sorted({h.cluster for h in hops if h.status < 400})
        if len(clusters) == 1:
            by_cluster[clusters[0]] = by_cluster.get(clusters[0], 0) + 1
        items.append(
            PipelineRequestHops(
                request=request_id,
                clusters=clusters,
                split=len(clusters) > 1,
                refused_hops=sum(1 for h in hops if h.status >= 400),
                hops=[
                    PipelineHop(
                        at=h.at,
                        step=h.pipeline_step,
                        deployment=h.deployment,
                        cluster=h.cluster,
                        region=h.region,
                        status=h.status,
                        latency_s=h.latency_s,
                    )
                    for h in hops
                ],
            )
        )
    return PipelineRequests(
        pipeline=name,
        since=start,
        requests=len(items),
        split=sum(1 for i in items if i.split),
        by_cluster=by_cluster,
        items=items,
    )
