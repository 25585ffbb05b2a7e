"""`cost_report`: read the window's replica intervals, the pools and the usage records,
and hand them to the pure rules (`control_plane.cost.accounting`)."""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import case, func, or_, select
from sqlalchemy.orm import Session

from control_plane.cost.accounting import Interval, PoolPrice, Usage, build_report
from control_plane.cost.model import GROUP_BYS, CostReport, GroupBy
from control_plane.db.models import ApiKey, CapacityPool, ReplicaInterval, UsageRecord


def _dt(t: float) -> datetime:
    return datetime.fromtimestamp(t, timezone.utc)


def read_intervals(session: Session, since: float, until: float) -> list[Interval]:
    """The ledger rows overlapping [since, until)."""
    r = ReplicaInterval
    rows = session.execute(
        select(
            r.deployment, r.cluster, r.pool, r.tier, r.gpus, r.hourly_price, r.started_at, r.ended_at
        ).where(r.started_at < _dt(until), or_(r.ended_at.is_(None), r.ended_at > _dt(since)))
    ).all()
    return [
        Interval(
            dep, cluster, pool, tier, gpus, price, start.timestamp(), None if end is None else end.timestamp()
        )
        for dep, cluster, pool, tier, gpus, price, start, end in rows
    ]


def read_pools(session: Session) -> list[PoolPrice]:
    """Every pool as it is now, its price per GPU-hour (pools store it per node-hour)."""
    return [
        PoolPrice(
            cluster=p.cluster_id,
            pool=p.name,
            tier=p.tier,
            gpus=p.total_gpus,
            hourly_price=(p.hourly_price or 0.0) / max(1, p.gpus_per_node or 1),
        )
        for p in session.scalars(select(CapacityPool)).all()
    ]


def read_usage(session: Session, since: float, until: float) -> list[Usage]:
    """The usage records stored for [since, until), summed per key, deployment and shadow
    flag, with the key's team; time split as `accounting.phase_seconds` does."""
    latency = case((UsageRecord.latency_s > 0, UsageRecord.latency_s), else_=0.0)
    prefill = case(
        (UsageRecord.ttft_s.is_(None), latency),
        (UsageRecord.ttft_s < 0, 0.0),
        (UsageRecord.ttft_s > latency, latency),
        else_=UsageRecord.ttft_s,
    )
    rows = session.execute(
        select(
            UsageRecord.key_id,
            UsageRecord.deployment,
            UsageRecord.shadow,
            ApiKey.team,
            func.sum(UsageRecord.prompt_tokens),
            func.sum(UsageRecord.completion_tokens),
            func.sum(prefill),
            func.sum(latency),
            func.count(),
        )
        .outerjoin(ApiKey, ApiKey.key_id == UsageRecord.key_id)
        .where(UsageRecord.at >= _dt(since), UsageRecord.at < _dt(until))
        .group_by(UsageRecord.key_id, UsageRecord.deployment, UsageRecord.shadow, ApiKey.team)
    ).all()
    return [
        Usage(
            key_id=key_id,
            deployment=dep,
            prompt_tokens=int(prompt or 0),
            completion_tokens=int(completion or 0),
            prefill_s=float(prefill_s or 0.0),
            decode_s=max(0.0, float(latency_s or 0.0) - float(prefill_s or 0.0)),
            requests=int(n),
            shadow=bool(shadow),
            team=team,
        )
        for key_id, dep, shadow, team, prompt, completion, prefill_s, latency_s, n in rows
    ]


def cost_report(session: Session, since: float, until: float, by: str) -> CostReport:
    """GPU dollars and work over [since, until) (Unix seconds), grouped `by` deployment,
    key, team or pool (docs/cost.md)."""
    if by not in GROUP_BYS:
        raise ValueError(f"by must be one of {', '.join(GROUP_BYS)}")
    group: GroupBy = by  # type: ignore[assignment]
    return build_report(
        read_intervals(session, since, until),
        read_pools(session),
        read_usage(session, since, until),
        since,
        until,
        group,
    )
