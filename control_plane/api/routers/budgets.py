"""Monthly dollar budgets per team (docs/cost.md). Setting one evaluates it at once
(threshold events, and a hard budget already spent refuses the team's keys at the next key
publish); the budget loop re-evaluates every budget every `budget_interval_s`. Reads show
the month's spend from the cost report as of the request."""

from __future__ import annotations

import logging
import time
from typing import Annotated

from fastapi import APIRouter, Path, Request
from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.api.audit import audit
from control_plane.api.deps import PagingDep, PrincipalDep, SessionDep, as_utc, kick
from control_plane.api.errors import not_found
from control_plane.api.schemas import BudgetIn, BudgetOut, Page
from control_plane.cost.budget_store import budget_of, evaluate_budgets, state_of, team_spend
from control_plane.cost.budgets import Budget, BudgetDecision, decide, exhausted_now, month_of, month_start
from control_plane.db.models import TeamBudget
from fleet_base.domain import TEAM_NAME_PATTERN

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/budgets", tags=["budgets"])

TeamPath = Annotated[str, Path(pattern=TEAM_NAME_PATTERN, description="the team (as keys' `team`)")]


def _config(row: TeamBudget) -> dict:
    """What an operator set: the audit record's before/after."""
    return {
        "team": row.team,
        "monthly_dollars": row.monthly_dollars,
        "thresholds": row.thresholds,
        "hard": row.hard,
    }


def _out(row: TeamBudget, decision: BudgetDecision | None, now: float) -> BudgetOut:
    """The budget with this month's figures: `decision` from a spend measured now, or
    (None: the cost report failed) the stored state's refusal and alerts only."""
    budget, state = budget_of(row), state_of(row)
    month = month_of(now)
    stored_alerts = list(state.thresholds) if state is not None and state.month == month else []
    return BudgetOut(
        team=row.team,
        monthly_dollars=budget.monthly_dollars,
        thresholds=list(budget.thresholds),
        hard=budget.hard,
        month=month,
        spent_dollars=None if decision is None else decision.spent,
        used_ratio=None if decision is None else decision.used_ratio,
        exhausted=exhausted_now(budget, state, now) if decision is None else decision.exhausted,
        alerted=stored_alerts if decision is None else list(decision.alerted),
        updated_at=as_utc(row.updated_at),
    )


def _spend_now(session: Session, now: float) -> dict[str, float] | None:
    try:
        return team_spend(session, month_start(now), now)
    except Exception:
        log.exception("the cost report for team budgets failed")
        return None


def _decide(row: TeamBudget, spent: dict[str, float] | None, now: float) -> BudgetDecision | None:
    """The policy on a spend measured now, unstored (a read has no side effects)."""
    return None if spent is None else decide(budget_of(row), spent.get(row.team, 0.0), state_of(row), now)


@router.get("", response_model=Page[BudgetOut])
def list_budgets(session: SessionDep, who: PrincipalDep, page: PagingDep):
    """Every budget with this month's spend, used ratio and whether it refuses now."""
    rows, total = page.apply(session, select(TeamBudget).order_by(TeamBudget.team))
    now = time.time()
    spent = _spend_now(session, now) if rows else {}
    items = [_out(r, _decide(r, spent, now), now) for r in rows]
    return Page(items=items, total=total, limit=page.limit, offset=page.offset)


@router.get("/{team}", response_model=BudgetOut)
def get_budget(team: TeamPath, session: SessionDep, who: PrincipalDep):
    row = session.get(TeamBudget, team)
    if row is None:
        raise not_found("budget of team", team)
    now = time.time()
    return _out(row, _decide(row, _spend_now(session, now), now), now)


@router.put("/{team}", response_model=BudgetOut)
def set_budget(team: TeamPath, body: BudgetIn, request: Request, session: SessionDep, who: PrincipalDep):
    """Create or replace the team's budget and evaluate it at once."""
    budget = Budget(monthly_dollars=body.monthly_dollars, thresholds=tuple(body.thresholds), hard=body.hard)
    row = session.get(TeamBudget, team)
    before = None if row is None else _config(row)
    if row is None:
        row = TeamBudget(team=team, alerted={})
        session.add(row)
    row.monthly_dollars = budget.monthly_dollars
    row.thresholds = list(budget.thresholds)
    row.hard = budget.hard
    session.flush()
    audit(session, who, "budget.set", "budget", team, before, _config(row))
    now = time.time()
    decision = None
    try:
        with session.begin_nested():
            outcomes = evaluate_budgets(session, now, teams=[team])
        decision = outcomes[0].decision if outcomes else None
    except Exception:
        log.exception("evaluating the budget of team %s failed; the budget loop retries", team)
    session.commit()
    kick(request)  # the key loop republishes: a refusal starts or lifts now
    return _out(row, decision, now)


@router.delete("/{team}", response_model=BudgetOut)
def delete_budget(team: TeamPath, request: Request, session: SessionDep, who: PrincipalDep):
    """Remove the team's budget: no more alerts, and its keys are served again."""
    row = session.get(TeamBudget, team)
    if row is None:
        raise not_found("budget of team", team)
    out = _out(row, None, time.time())
    audit(session, who, "budget.delete", "budget", team, _config(row), None)
    session.delete(row)
    session.commit()
    kick(request)
    return out
