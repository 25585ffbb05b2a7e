"""Where each deployment's requests come from, for the placer's nearness term
(`ReplicaDemand.demand_regions`): tokens in recent usage records by the region of the
gateway that recorded them. A forwarded request is recorded where it was served, so a
region that spills counts partly at its peer; shares are coarse (5% steps) so small
shifts do not re-trigger a solve. Replicas already running move only when that pays
(the move penalty dominates nearness): demand steers new replicas first."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from control_plane.db.models import UsageRecord, utcnow
from control_plane.fleet_model.snapshot import FleetSnapshot
from control_plane.placement import ReplicaDemand

WINDOW_S = 600.0
STEP = 0.05


def region_key(provider: str, region: str) -> str:
    """`provider:region` when the provider is a cloud (control_plane.geo ids), else the name."""
    return f"{provider}:{region}" if provider and provider != "local" else region


def read_demand_regions(
    session: Session, snap: FleetSnapshot, now: datetime | None = None, window_s: float = WINDOW_S
) -> dict[str, dict[str, float]]:
    """deployment -> region -> share of its tokens over the last `window_s`."""
    since = (now or utcnow()) - timedelta(seconds=window_s)
    where = {c.id: region_key(c.provider, c.region) for c in snap.clusters if c.region}
    rows = session.execute(
        select(
            UsageRecord.deployment,
            UsageRecord.cluster,
            func.sum(UsageRecord.prompt_tokens + UsageRecord.completion_tokens),
        )
        .where(UsageRecord.at >= since, UsageRecord.shadow.is_(False))  # copies are no user demand
        .group_by(UsageRecord.deployment, UsageRecord.cluster)
    ).all()
    tokens: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for deployment, cluster, n in rows:
        if cluster in where and n:
            tokens[deployment][where[cluster]] += float(n)
    return {d: shares for d, by_region in tokens.items() if (shares := _coarse(by_region))}


def _coarse(by_region: dict[str, float]) -> dict[str, float]:
    total = sum(by_region.values())
    if total <= 0:
        return {}
    out = {r: round(round(v / total / STEP) * STEP, 2) for r, v in by_region.items()}
    return {r: v for r, v in sorted(out.items()) if v > 0}


def with_demand_regions(
    demands: Sequence[ReplicaDemand], shares: dict[str, dict[str, float]]
) -> list[ReplicaDemand]:
    return [
        d.model_copy(update={"demand_regions": shares[d.deployment]}) if shares.get(d.deployment) else d
        for d in demands
    ]
