"""A deployment's recorded demand (`usage_records`) as daily and weekly cycles, read when the
autoscale loop first builds the deployment's memory (a fresh control plane, a new leader): the
last `HISTORY_S` since the deployment was created, summed in SQL per 15-minute slot, so at
most a few hundred rows come back however many requests were recorded.

A request counts in the slot it finished in, with its prompt and completion tokens; shadow
copies (no user demand) and refused or failed requests (status 400 and above: no work a
replica did) do not. Recorded work starts at the first slot with a record: a deployment whose
usage was never recorded gets no cycle of zeros."""

from __future__ import annotations

import math
from datetime import datetime, timezone

from sqlalchemy import BigInteger, Integer, cast, func, select
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from control_plane.autoscale.seasonal import BIN_S, HISTORY_S, Seasons, from_history
from control_plane.db.models import UsageRecord


def _slot_start(dialect: str) -> ColumnElement[int]:
    """The epoch second at which a record's 15-minute slot starts, in the database's SQL."""
    if dialect == "postgresql":
        epoch = cast(func.floor(func.extract("epoch", UsageRecord.at)), BigInteger)
    else:  # SQLite keeps UTC text; '%s' is its epoch second
        epoch = cast(func.strftime("%s", UsageRecord.at), Integer)
    return epoch - epoch % int(BIN_S)


def slot_totals(
    session: Session, deployment: str, since: float, until: float
) -> dict[int, tuple[float, float, float]]:
    """slot (`epoch // BIN_S`) -> (requests, prompt tokens, output tokens) the deployment's
    recorded requests did in each whole slot within `since` .. `until` (epoch seconds)."""
    first, end = math.ceil(since / BIN_S), math.floor(until / BIN_S)
    if end <= first:
        return {}
    slot = _slot_start(session.get_bind().dialect.name).label("slot")
    rows = session.execute(
        select(
            slot,
            func.count(),
            func.coalesce(func.sum(UsageRecord.prompt_tokens), 0),
            func.coalesce(func.sum(UsageRecord.completion_tokens), 0),
        )
        .where(
            UsageRecord.deployment == deployment,
            UsageRecord.at >= datetime.fromtimestamp(first * BIN_S, timezone.utc),
            UsageRecord.at < datetime.fromtimestamp(end * BIN_S, timezone.utc),
            UsageRecord.shadow.is_(False),
            UsageRecord.status < 400,
        )
        .group_by(slot)
    ).all()
    return {int(start) // int(BIN_S): (float(n), float(p), float(o)) for start, n, p, o in rows}


def read_history(
    session: Session, deployment: str, now: float, created_at: float | None = None
) -> Seasons | None:
    """The cycles of the deployment's recorded work up to the slot `now` is in (None: nothing
    recorded in the last `HISTORY_S`, or since `created_at`)."""
    since = max(now - HISTORY_S, created_at if created_at is not None else -math.inf)
    totals = slot_totals(session, deployment, since, now)
    if not totals:
        return None
    return from_history(totals, min(totals), math.floor(now / BIN_S))
