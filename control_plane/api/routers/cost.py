"""GET /v1/cost: what the fleet cost over a window, per deployment, key, team or pool
(`control_plane.cost.report`); POST /v1/cost/tco: the same traffic priced at a hosted
API's per-token prices against Fleet's cost (`control_plane.cost.tco`). See docs/cost.md."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.api.deps import PrincipalDep, SessionDep
from control_plane.api.errors import invalid
from control_plane.api.routers.usage import parse_since
from control_plane.cost.model import CostReport, GroupBy
from control_plane.cost.report import cost_report
from control_plane.cost.tco import (
    MAX_PRICE_FILE_CHARS,
    Engineering,
    PriceFileError,
    TcoReport,
    parse_prices,
    tco_report,
)
from control_plane.db.models import Deployment, DeploymentVersion

router = APIRouter(prefix="/v1/cost", tags=["cost"])

DEFAULT_SINCE = "7d"


def window(since: str) -> tuple[float, float]:
    """(since, until) in Unix seconds for a `since` of "30m", "1h", "7d" or an ISO time."""
    now = datetime.now(timezone.utc)
    start = parse_since(since, now)
    if start >= now:
        raise invalid("since", "must be in the past")
    return start.timestamp(), now.timestamp()


@router.get("", response_model=CostReport)
def get_cost(
    session: SessionDep,
    who: PrincipalDep,
    since: str = Query(DEFAULT_SINCE, max_length=64, description="30m, 1h, 7d or an ISO 8601 time"),
    by: GroupBy = Query("deployment", description="deployment, key, team or pool"),
) -> CostReport:
    start, until = window(since)
    return cost_report(session, start, until, by)


class TcoRequest(BaseModel):
    prices: str | dict[str, Any] = Field(
        description="the price file: its YAML or JSON text, or the decoded object (docs/cost.md)"
    )
    since: str = Field(DEFAULT_SINCE, max_length=64)


def deployment_models(session: Session) -> dict[str, str]:
    """deployment -> the model its current version serves (a price file may name either)."""
    rows = session.execute(
        select(Deployment.name, DeploymentVersion.model).join(
            DeploymentVersion,
            (DeploymentVersion.deployment_id == Deployment.id)
            & (DeploymentVersion.version == Deployment.current_version),
        )
    ).all()
    return {name: model for name, model in rows}


@router.post("/tco", response_model=TcoReport)
def post_tco(body: TcoRequest, request: Request, session: SessionDep, who: PrincipalDep) -> TcoReport:
    if isinstance(body.prices, str) and len(body.prices) > MAX_PRICE_FILE_CHARS:
        raise invalid("prices", f"over {MAX_PRICE_FILE_CHARS} characters")
    try:
        prices = parse_prices(body.prices)
    except PriceFileError as err:
        raise invalid("prices", str(err)) from None
    start, until = window(body.since)
    settings = request.app.state.ctx.settings
    engineering = Engineering(
        hours_per_month=settings.tco_engineering_hours_per_month,
        hourly_dollars=settings.tco_engineering_hourly_dollars,
    )
    report = cost_report(session, start, until, "deployment")
    return tco_report(report, prices, engineering, deployment_models(session))
