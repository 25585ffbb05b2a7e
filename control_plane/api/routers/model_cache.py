"""Each cluster's node model cache (`fleetctl models ls|pull|rm`).

Listing reads what agents report in their heartbeats (`Heartbeat.models`, kept in the
cluster's `load`). Pull and remove are NATS requests to the cluster's agent
(`fleet.v1.models.<cluster>`, a `ModelCommand`), answered at once: a pull runs in the
background and its progress shows up in the listing. The URI is checked here first; the
agent uses its own store credentials.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field
from sqlalchemy import select

from control_plane.api.audit import audit
from control_plane.api.deps import PrincipalDep
from control_plane.api.errors import ApiError, invalid, not_found
from control_plane.api.model_refs import model_ref
from control_plane.api.schemas import ModelRef, Strict
from control_plane.db.models import Cluster
from fleet_base import domain, protocol
from fleet_base.domain import ClusterId
from fleet_base.models import is_remote

router = APIRouter(prefix="/v1/model-cache", tags=["models"])
REQUEST_TIMEOUT_S = 5.0


class CachedModelOut(protocol.CachedModel):
    """A cached model as its agent reported it, with its cluster and a readable time."""

    cluster: str
    last_used: datetime | None = None  # type: ignore[assignment]


class ModelCacheRequest(Strict):
    model: ModelRef
    clusters: list[ClusterId] | None = Field(None, max_length=64)  # None: every healthy cluster


class ClusterAnswer(BaseModel):
    cluster: str
    ok: bool
    message: str


def _rows(request: Request, cluster: str | None) -> list[Cluster]:
    with request.app.state.ctx.sessions() as session:
        query = select(Cluster).order_by(Cluster.id)
        if cluster is not None:
            query = query.where(Cluster.id == cluster)
        rows = list(session.scalars(query))
        session.expunge_all()
    if cluster is not None and not rows:
        raise not_found("cluster", cluster)
    return rows


@router.get("", response_model=list[CachedModelOut])
def list_cached(
    request: Request,
    who: PrincipalDep,
    cluster: str | None = Query(None, max_length=63),
    model: str | None = Query(None, max_length=512),
):
    out = []
    for row in _rows(request, cluster):
        for m in (row.load or {}).get("models", []):
            item = protocol.CachedModel.model_validate(m)
            if model is not None and model not in (item.uri, item.pinned_uri):
                continue
            used = datetime.fromtimestamp(item.last_used, UTC) if item.last_used else None
            out.append(
                CachedModelOut(cluster=row.id, **item.model_dump(exclude={"last_used"}), last_used=used)
            )
    return out


async def _ask(request: Request, clusters: list[str], command: protocol.ModelCommand) -> list[ClusterAnswer]:
    nats = request.app.state.ctx.nats
    if nats is None or not nats.is_connected:
        raise ApiError(503, "NATS is not connected; cannot reach the clusters' agents")

    async def one(cluster: str) -> ClusterAnswer:
        data = await nats.request(protocol.models_subject(cluster), command, timeout=REQUEST_TIMEOUT_S)
        if data is None:
            return ClusterAnswer(cluster=cluster, ok=False, message="the agent did not answer")
        reply = protocol.ModelCommandReply.from_bytes(data)
        return ClusterAnswer(cluster=cluster, ok=reply.ok, message=reply.message)

    return list(await asyncio.gather(*(one(c) for c in clusters)))


def _targets(request: Request, wanted: list[str] | None) -> list[str]:
    rows = _rows(request, None)
    known = {r.id: r for r in rows}
    if wanted:
        missing = sorted(set(wanted) - set(known))
        if missing:
            raise not_found("cluster", ", ".join(missing))
        return list(dict.fromkeys(wanted))
    return [r.id for r in rows if r.status != domain.ClusterStatus.unhealthy.value]


def _uri(model: str) -> str:
    if not is_remote(model):
        raise invalid("model", "only model URIs (s3://, hf://, oci://, https://) live in the node cache")
    return model_ref(model)


def _audit(request: Request, who, action: str, uri: str, answers: list[ClusterAnswer]) -> None:
    with request.app.state.ctx.sessions() as session:
        audit(session, who, action, "model", uri, None, [a.model_dump() for a in answers])
        session.commit()


@router.post("/pull", response_model=list[ClusterAnswer])
async def pull(body: ModelCacheRequest, request: Request, who: PrincipalDep):
    uri = await asyncio.to_thread(_uri, body.model)
    clusters = await asyncio.to_thread(_targets, request, body.clusters)
    answers = await _ask(request, clusters, protocol.ModelCommand(action="pull", uri=uri))
    await asyncio.to_thread(_audit, request, who, "model.pull", uri, answers)
    return answers


@router.delete("", response_model=list[ClusterAnswer])
async def remove(
    request: Request,
    who: PrincipalDep,
    model: str = Query(..., min_length=1, max_length=512),
    cluster: list[str] | None = Query(None),
):
    uri = await asyncio.to_thread(_uri, model)
    clusters = await asyncio.to_thread(_targets, request, cluster)
    answers = await _ask(request, clusters, protocol.ModelCommand(action="rm", uri=uri))
    await asyncio.to_thread(_audit, request, who, "model.rm", uri, answers)
    return answers
