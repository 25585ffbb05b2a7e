"""GET /v1/usage: tokens per key and deployment from the stored usage records, with an
estimated cost.

The cost is an allocation, not a bill: a deployment's replicas cost their pools' GPU
price (`hourly_price / gpus_per_node * gpus`, as placed now) over the period asked, and
that cost is split between keys in proportion to the tokens each used on it.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

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


class UsageReport(BaseModel):
    since: datetime
    until: datetime
    items: list[UsageRow]
    total_tokens: int
    estimated_cost: float


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


@router.get("", response_model=UsageReport)
def get_usage(
    session: SessionDep,
    who: PrincipalDep,
    key: str | None = Query(None, max_length=32),
    deployment: str | None = Query(None, max_length=63),
    since: str = Query("1h", max_length=64),
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
        .where(UsageRecord.at >= start)
        .group_by(UsageRecord.key_id, UsageRecord.deployment)
        .order_by(func.sum(total).desc(), UsageRecord.key_id, UsageRecord.deployment)
    )
    if key:
        query = query.where(UsageRecord.key_id == key)
    if deployment:
        query = query.where(UsageRecord.deployment == deployment)
    rows = session.execute(query).all()
    # each deployment's cost over the period, split by every key's tokens on it
    names = {r[1] for r in rows}
    per_hour = hourly_cost(session, names)
    hours = (now - start).total_seconds() / 3600
    dep_tokens = dict(
        session.execute(
            select(UsageRecord.deployment, func.sum(total))
            .where(UsageRecord.at >= start, UsageRecord.deployment.in_(sorted(names)))
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
            )
        )
    return UsageReport(
        since=start,
        until=now,
        items=items,
        total_tokens=sum(i.total_tokens for i in items),
        estimated_cost=round(sum(i.estimated_cost for i in items), 6),
    )
