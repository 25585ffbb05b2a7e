"""Team budgets in the database: one pass of the policy over every budget (the loop's
tick, and a budget just set), and which teams' keys are refused now.

A pass reads the month-to-date dollars of every team from the cost report (`by="team"`:
the team's keys' share of GPU dollars, idle included), applies `decide` per budget,
writes one `budget_threshold` event per threshold newly crossed and stores the decision
in `team_budgets.alerted` (`BudgetState`), all in the caller's transaction. The key
publisher reads `exhausted_teams` from that stored state."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.cost.budgets import (
    Budget,
    BudgetDecision,
    BudgetState,
    decide,
    exhausted_now,
    month_start,
    state_after,
)
from control_plane.cost.report import cost_report
from control_plane.db.models import Event, TeamBudget

log = logging.getLogger(__name__)

EVENT_KIND = "budget_threshold"

# (session, since, until) -> {team: dollars}
TeamSpend = Callable[[Session, float, float], dict[str, float]]


def team_spend(session: Session, since: float, until: float) -> dict[str, float]:
    """Each team's dollars over [since, until) from the cost report (its GPU dollars, idle
    part included); nothing for an empty window (the first instant of a month)."""
    if until <= since:
        return {}
    report = cost_report(session, since, until, by="team")
    return {row.group: row.gpu_dollars for row in report.rows}


def budget_of(row: TeamBudget) -> Budget:
    return Budget(monthly_dollars=row.monthly_dollars, thresholds=tuple(row.thresholds or ()), hard=row.hard)


def state_of(row: TeamBudget) -> BudgetState | None:
    return BudgetState.from_stored(row.alerted)


@dataclass(frozen=True)
class Outcome:
    team: str
    budget: Budget
    decision: BudgetDecision


def threshold_message(team: str, budget: Budget, decision: BudgetDecision, fraction: float) -> str:
    text = (
        f"team {team} reached {fraction:.0%} of its monthly budget: ${decision.spent:,.2f} "
        f"of ${budget.monthly_dollars:,.2f} spent in {decision.month}"
    )
    if decision.exhausted and fraction >= 1.0:
        text += "; the budget is hard: the team's keys are refused until it is raised or the month ends"
    return text


def budget_rows(session: Session, teams: Iterable[str] | None = None) -> list[TeamBudget]:
    query = select(TeamBudget).order_by(TeamBudget.team)
    if teams is not None:
        query = query.where(TeamBudget.team.in_(list(teams)))
    return list(session.scalars(query))


def evaluate_budgets(
    session: Session,
    now: float,
    *,
    teams: Iterable[str] | None = None,
    spend: TeamSpend | None = None,
) -> list[Outcome]:
    """Decide every budget (or those of `teams`) at `now`; events and states are added to
    the session, the caller commits."""
    rows = budget_rows(session, teams)
    if not rows:
        return []
    spent = (spend or team_spend)(session, month_start(now), now)
    outcomes = []
    for row in rows:
        budget = budget_of(row)
        decision = decide(budget, spent.get(row.team, 0.0), state_of(row), now)
        for fraction in decision.crossed:
            message = threshold_message(row.team, budget, decision, fraction)
            session.add(Event(kind=EVENT_KIND, message=message))
            log.warning("%s", message)
        row.alerted = state_after(decision, now).stored()
        outcomes.append(Outcome(row.team, budget, decision))
    return outcomes


def exhausted_teams(session: Session, now: float) -> set[str]:
    """The teams whose keys gateways must refuse now (a hard budget, spent this month)."""
    rows = session.scalars(select(TeamBudget).where(TeamBudget.hard.is_(True)))
    return {row.team for row in rows if exhausted_now(budget_of(row), state_of(row), now)}


__all__ = [
    "EVENT_KIND",
    "Outcome",
    "TeamSpend",
    "budget_of",
    "budget_rows",
    "evaluate_budgets",
    "exhausted_teams",
    "state_of",
    "team_spend",
    "threshold_message",
]
