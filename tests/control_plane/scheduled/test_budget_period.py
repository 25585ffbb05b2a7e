"""The budget month's rollover: at the month's first second a hard budget spent last month
stops refusing the team's keys, its stored state moves to the new month, and the key loop
is woken."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

import pytest

from control_plane.context import ControlPlaneContext
from control_plane.cost.budget_store import exhausted_teams
from control_plane.cost.budgets import BudgetState
from control_plane.db import models as m
from control_plane.scheduled import budget_period
from control_plane.settings import Settings

JAN_1 = datetime(2027, 1, 1, 0, 0, 1, tzinfo=timezone.utc).timestamp()


@pytest.mark.parametrize(
    ("hard", "last_month_spent", "refused_before"),
    [
        (True, 120.0, True),  # spent last month: refused until the boundary
        (True, 50.0, False),
        (False, 500.0, False),  # soft budgets never refuse
    ],
)
def test_the_month_rollover_ends_last_months_refusal(
    db, tmp_path, hard, last_month_spent, refused_before
) -> None:
    with db() as s:
        s.add(
            m.TeamBudget(
                team="ml",
                monthly_dollars=100.0,
                hard=hard,
                thresholds=[0.5, 1.0],
                alerted=BudgetState(month="2026-12", thresholds=(0.5, 1.0), spent=last_month_spent).stored(),
            )
        )
        s.commit()
    with db() as s:
        before = exhausted_teams(s, JAN_1 - 2)
        assert ("ml" in before) is refused_before
    ctx = ControlPlaneContext(settings=Settings(home=tmp_path), sessions=db)
    rolled = budget_period.roll(ctx, JAN_1)
    assert rolled.budgets == 1 and rolled.exhausted == []
    with db() as s:
        state = BudgetState.from_stored(s.get(m.TeamBudget, "ml").alerted)
        assert state is not None and state.month == "2027-01" and state.thresholds == ()
        assert exhausted_teams(s, JAN_1) == set()


def test_the_job_wakes_the_key_loop(db, tmp_path) -> None:
    ctx = ControlPlaneContext(settings=Settings(home=tmp_path), sessions=db)

    async def go():
        ctx.keys_changed.clear()
        await budget_period.run(ctx)
        return ctx.keys_changed.is_set()

    assert asyncio.run(go())
