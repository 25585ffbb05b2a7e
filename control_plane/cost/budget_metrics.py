"""Team budgets as Prometheus gauges, read from the database at scrape time (the state the
budget loop stored last, so every control-plane instance answers the same)."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from sqlalchemy.orm import Session

from control_plane.cost.budget_store import budget_of, budget_rows, state_of
from control_plane.cost.budgets import exhausted_now, month_of


def budget_metrics(session: Session, now: float | None = None) -> Iterator[Metric]:
    now = time.time() if now is None else now
    month = month_of(now)
    ratio = GaugeMetricFamily(
        "fleet_cost_budget_used_ratio",
        "Share of each team's monthly budget spent this month (UTC), as of the last budget pass.",
        labels=["team"],
    )
    dollars = GaugeMetricFamily("fleet_cost_budget_dollars", "Each team's monthly budget.", labels=["team"])
    spent = GaugeMetricFamily(
        "fleet_cost_budget_spent_dollars", "Each team's dollars spent this month (UTC).", labels=["team"]
    )
    exhausted = GaugeMetricFamily(
        "fleet_cost_budget_exhausted",
        "1 while a team's hard budget is spent and its keys are refused.",
        labels=["team"],
    )
    for row in budget_rows(session):
        budget, state = budget_of(row), state_of(row)
        dollars_spent = state.spent if state is not None and state.month == month else 0.0
        ratio.add_metric([row.team], dollars_spent / budget.monthly_dollars)
        dollars.add_metric([row.team], budget.monthly_dollars)
        spent.add_metric([row.team], dollars_spent)
        exhausted.add_metric([row.team], 1.0 if exhausted_now(budget, state, now) else 0.0)
    yield from (ratio, dollars, spent, exhausted)
