"""GET /v1/usage: tokens per key and deployment from the stored usage records, with an
estimated cost.

The cost is an allocation, not a bill: a deployment's replicas cost their pools' GPU
price (`hourly_price / gpus_per_node * gpus`, as placed now) over the period asked, and
that cost is split between keys in proportion to the tokens each used on it.

Each row also says where its requests were processed: requests per region and per
jurisdiction, as the gateways reported them ("" for records that did not say).

Shadow copies (a rollout's shadow phase) are no key's usage: they are left out of every
row and cost, and listed apart under `shadow`, per deployment and version.

Batch lines and async requests are the key's usage like any request (in its rows and
cost); `batch` lists that part apart, per key and deployment.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel
from sqlalchemy import case, func, select

from control_plane.api.deps import PrincipalDep, SessionDep, as_utc
from control_plane.api.errors import invalid
from control_plane.db.models import CapacityPool, Deployment, ReplicaAssignment, UsageRecord

router = APIRouter(prefix="/v1/usage", tags=["usage"])

DURATION = re.compile(r"^(\d+(?:\.\d+)?)(s|m|h|d)$")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class UsageRow(BaseModel):
    key_id: str
    deployment: str
    adapter: str | None = None  # a LoRA adapter's own row (None: the base model)
    requests: int
    errors: int  # status >= 400
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    estimated_cost: float  # in the pools' price currency
    # where the requests were processed: region -> requests, jurisdiction -> requests
    regions: dict[str, int] = {}
    jurisdictions: dict[str, int] = {}


class ShadowUsageRow(BaseModel):
    """Copies a deployment's shadow version ran (charged to no key)."""

    deployment: str
    version: int | None
    requests: int
    errors: int  # status >= 400
    prompt_tokens: int
    completion_tokens: int


class BatchUsageRow(BaseModel):
    """The part of a key's usage on a deployment that batch lines and async requests made
    (already counted in its `items` row)."""

    key_id: str
    deployment: str
    requests: int
    errors: int  # status >= 400
    prompt_tokens: int
    completion_tokens: int


class UsageReport(BaseModel):
    since: datetime
    until: datetime
    items: list[UsageRow]
    total_tokens: int
    estimated_cost: float
    shadow: list[ShadowUsageRow] = []
    batch: list[BatchUsageRow] = []


def parse_since(text: str, now: datetime) -> datetime:
    """ "90s", "30m", "1h", "7d", or an ISO 8601 time."""
    m = DURATION.match(text.strip())
    if m:
        try:
            return now - timedelta(seconds=float(m.group(1)) * UNITS[m.group(2)])
        except (OverflowError, ValueError):  # "999999999999d" reaches before year 1
            raise invalid("since", f"{text.strip()!r} reaches back further than a datetime can") from None
    try:
        value = datetime.fromisoformat(text.strip())
    except ValueError:
        raise invalid("since", "must be a duration like 90s, 30m, 1h, 7d or an ISO 8601 time") from None
    return as_utc(value)  # type: ignore[return-value]


def hourly_cost(session, deployments: set[str]) -> dict[str, float]:
    """deployment -> what its placed replicas cost per hour now."""
    if not deployments:
        return {}
    rows = session.execute(
        select(Deployment.name, ReplicaAssignment.gpus, CapacityPool.hourly_price, CapacityPool.gpus_per_node)
        .join(ReplicaAssignment, ReplicaAssignment.deployment_id == Deployment.id)
        .join(
            CapacityPool,
            (CapacityPool.cluster_id == ReplicaAssignment.cluster_id)
            & (CapacityPool.name == ReplicaAssignment.pool_name),
        )
        .where(Deployment.name.in_(sorted(deployments)))
    ).all()
    out: dict[str, float] = {}
    for name, gpus, price, per_node in rows:
        out[name] = out.get(name, 0.0) + (price or 0.0) / max(1, per_node or 1) * (gpus or 1)
    return out


def _where_processed(session, filters: list) -> dict[tuple[str, str], dict[str, dict[str, int]]]:
    """(key, deployment) -> {"regions": {region: requests}, "jurisdictions": {...}}."""
    rows = session.execute(
        select(
            UsageRecord.key_id,
            UsageRecord.deployment,
            UsageRecord.region,
            UsageRecord.jurisdiction,
            func.count(),
        )
        .where(*filters)
        .group_by(UsageRecord.key_id, UsageRecord.deployment, UsageRecord.region, UsageRecord.jurisdiction)
    ).all()
    out: dict[tuple[str, str], dict[str, dict[str, int]]] = {}
    for key_id, dep, region, jurisdiction, count in rows:
        row = out.setdefault((key_id, dep), {"regions": {}, "jurisdictions": {}})
        row["regions"][region or ""] = row["regions"].get(region or "", 0) + int(count)
        row["jurisdictions"][jurisdiction or ""] = row["jurisdictions"].get(jurisdiction or "", 0) + int(
            count
        )
    return out


@router.get("", response_model=UsageReport)
def get_usage(
    session: SessionDep,
    who: PrincipalDep,
    key: str | None = Query(None, max_length=32),
    deployment: str | None = Query(None, max_length=63),
    since: str = Query("1h", max_length=64),
    # Annotated defaults: the console calls this function directly and leaves these out
    region: Annotated[
        str | None, Query(max_length=64, description="only requests processed in this region")
    ] = None,
    jurisdiction: Annotated[
        str | None, Query(max_length=64, description="only requests processed in this jurisdiction")
    ] = None,
):
    now = datetime.now(timezone.utc)
    start = parse_since(since, now)
    if start > now:
        raise invalid("since", "is in the future")
    total = UsageRecord.prompt_tokens + UsageRecord.completion_tokens
    query = (
        select(
            UsageRecord.key_id,
            UsageRecord.deployment,
            func.count(),
            func.sum(case((UsageRecord.status >= 400, 1), else_=0)),
            func.sum(UsageRecord.prompt_tokens),
            func.sum(UsageRecord.completion_tokens),
        )
        .group_by(UsageRecord.key_id, UsageRecord.deployment)
        .order_by(func.sum(total).desc(), UsageRecord.key_id, UsageRecord.deployment)
    )
    scope = [UsageRecord.at >= start]
    if key:
        scope.append(UsageRecord.key_id == key)
    if deployment:
        scope.append(UsageRecord.deployment == deployment)
    if region is not None:
        scope.append(UsageRecord.region == region)
    if jurisdiction is not None:
        scope.append(UsageRecord.jurisdiction == jurisdiction)
    filters = [*scope, UsageRecord.shadow.is_(False)]
    rows = session.execute(query.where(*filters)).all()
    where = _where_processed(session, filters)
    # each deployment's cost over the period, split by every key's tokens on it
    names = {r[1] for r in rows}
    per_hour = hourly_cost(session, names)
    hours = (now - start).total_seconds() / 3600
    dep_tokens = dict(
        session.execute(
            select(UsageRecord.deployment, func.sum(total))
            .where(
                UsageRecord.at >= start,
                UsageRecord.deployment.in_(sorted(names)),
                UsageRecord.shadow.is_(False),
            )
            .group_by(UsageRecord.deployment)
        ).all()
    )
    items = []
    for key_id, dep, requests, errors, prompt, completion in rows:
        tokens = int(prompt or 0) + int(completion or 0)
        share = tokens / dep_tokens[dep] if dep_tokens.get(dep) else 0.0
        items.append(
            UsageRow(
                key_id=key_id,
                deployment=dep,
                requests=int(requests),
                errors=int(errors or 0),
                prompt_tokens=int(prompt or 0),
                completion_tokens=int(completion or 0),
                total_tokens=tokens,
                estimated_cost=round(per_hour.get(dep, 0.0) * hours * share, 6),
                **where.get((key_id, dep), {}),
            )
        )
    return UsageReport(
        since=start,
        until=now,
        items=items,
        total_tokens=sum(i.total_tokens for i in items),
        estimated_cost=round(sum(i.estimated_cost for i in items), 6),
        shadow=_shadow_usage(session, scope),
        batch=_batch_usage(session, filters),
    )


def _marked_totals(session, marker, groups: tuple, filters: list) -> list[tuple]:
    """Requests, errors and tokens of the records with `marker` set, per `groups`: the
    group's values, then (requests, errors, prompt tokens, completion tokens)."""
    rows = session.execute(
        select(
            *groups,
            func.count(),
            func.sum(case((UsageRecord.status >= 400, 1), else_=0)),
            func.sum(UsageRecord.prompt_tokens),
            func.sum(UsageRecord.completion_tokens),
        )
        .where(marker.is_(True), *filters)
        .group_by(*groups)
        .order_by(*groups)
    ).all()
    k = len(groups)
    return [(*row[:k], *(int(v or 0) for v in row[k:])) for row in rows]


def _shadow_usage(session, filters: list) -> list[ShadowUsageRow]:
    rows = _marked_totals(session, UsageRecord.shadow, (UsageRecord.deployment, UsageRecord.version), filters)
    return [
        ShadowUsageRow(
            deployment=dep,
            version=version,
            requests=n,
            errors=errors,
            prompt_tokens=prompt,
            completion_tokens=completion,
        )
        for dep, version, n, errors, prompt, completion in rows
    ]


def _batch_usage(session, filters: list) -> list[BatchUsageRow]:
    rows = _marked_totals(session, UsageRecord.batch, (UsageRecord.key_id, UsageRecord.deployment), filters)
    return [
        BatchUsageRow(
            key_id=key_id,
            deployment=dep,
            requests=n,
            errors=errors,
            prompt_tokens=prompt,
            completion_tokens=completion,
        )
        for key_id, dep, n, errors, prompt, completion in rows
    ]
