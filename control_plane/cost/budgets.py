"""Monthly dollar budgets per team: the policy, plain and side-effect free.

Given a team's budget, its month-to-date spend and what was already alerted, `decide`
returns the decision as data: the thresholds newly crossed (each alerted once per calendar
month, UTC; a new month starts with none alerted), the used ratio, and whether the team's
keys must be refused (a hard budget whose month-to-date spend is at or over it). The
control plane's budget loop (`control_plane.cost.budget_pass`) feeds it the cost report
and stores `state_after` in `team_budgets.alerted`; the key publisher asks `exhausted_now`
of that stored state, so a raised budget, a budget made soft, or a new month lifts a
refusal at the next publish without waiting for a new spend figure.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

DEFAULT_THRESHOLDS: tuple[float, ...] = (0.5, 0.8, 1.0)
# A threshold is crossed at `spent >= fraction * budget`, less this relative slack, so
# 0.7 x $100 is crossed by $70 despite binary fractions.
SLACK = 1e-9

# A threshold: a fraction of the budget in (0, 1], to the 6 digits thresholds compare by.
Fraction = Annotated[float, Field(ge=1e-6, le=1, allow_inf_nan=False)]


class Budget(BaseModel):
    """A team's monthly budget: dollars, the fractions of it to alert at, and whether new
    requests are refused once it is spent (hard)."""

    model_config = ConfigDict(frozen=True)

    monthly_dollars: float = Field(gt=0, allow_inf_nan=False)
    thresholds: tuple[Fraction, ...] = Field(DEFAULT_THRESHOLDS, min_length=1)
    hard: bool = False

    @field_validator("thresholds")
    @classmethod
    def _sorted_unique(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(sorted({_key(t) for t in value}))


class BudgetState(BaseModel):
    """What is stored between two decisions (`team_budgets.alerted`): the month it is
    about, the thresholds alerted in it, and the spend last measured."""

    model_config = ConfigDict(frozen=True)

    month: str  # "YYYY-MM", UTC
    thresholds: tuple[float, ...] = ()  # alerted this month
    spent: float = Field(0.0, allow_inf_nan=False)
    at: float | None = None  # Unix time of the measurement

    def stored(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_stored(cls, value: object) -> BudgetState | None:
        """The state from its JSON; None for none, another shape, or garbage."""
        if not isinstance(value, dict):
            return None
        try:
            return cls.model_validate(value)
        except ValidationError:
            return None


class BudgetDecision(BaseModel):
    model_config = ConfigDict(frozen=True)

    month: str
    spent: float
    used_ratio: float
    crossed: tuple[float, ...]  # newly crossed: alert each one now
    alerted: tuple[float, ...]  # every threshold alerted this month, these included
    exhausted: bool  # hard and spent: refuse the team's new requests


def _key(fraction: float) -> float:
    """Thresholds compare by value to 6 digits (they round-trip through JSON)."""
    return round(float(fraction), 6)


def month_of(at: float) -> str:
    return datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m")


def month_start(at: float) -> float:
    """The Unix time at which `at`'s calendar month (UTC) began."""
    day = datetime.fromtimestamp(at, timezone.utc)
    return datetime(day.year, day.month, 1, tzinfo=timezone.utc).timestamp()


def _spend(spent: float) -> float:
    """A spend the report cannot have (negative, not finite) counts as none."""
    return spent if math.isfinite(spent) and spent > 0 else 0.0


def _reached(budget: Budget, spent: float, fraction: float) -> bool:
    return spent >= fraction * budget.monthly_dollars * (1 - SLACK)


def is_exhausted(budget: Budget, spent: float) -> bool:
    return budget.hard and _reached(budget, _spend(spent), 1.0)


def decide(budget: Budget, spent: float, before: BudgetState | None, now: float) -> BudgetDecision:
    """The decision for a month-to-date `spent` at `now`, given the state stored last."""
    month = month_of(now)
    spent = _spend(spent)
    already = {_key(t) for t in before.thresholds} if before is not None and before.month == month else set()
    crossed = tuple(t for t in budget.thresholds if t not in already and _reached(budget, spent, t))
    return BudgetDecision(
        month=month,
        spent=spent,
        used_ratio=spent / budget.monthly_dollars,
        crossed=crossed,
        alerted=tuple(sorted(already | set(crossed))),
        exhausted=is_exhausted(budget, spent),
    )


def state_after(decision: BudgetDecision, now: float) -> BudgetState:
    return BudgetState(month=decision.month, thresholds=decision.alerted, spent=decision.spent, at=now)


def exhausted_now(budget: Budget, state: BudgetState | None, now: float) -> bool:
    """Refuse the team's keys now? From the last stored spend, only if it is this month's."""
    return state is not None and state.month == month_of(now) and is_exhausted(budget, state.spent)


__all__ = [
    "DEFAULT_THRESHOLDS",
    "Budget",
    "BudgetDecision",
    "BudgetState",
    "decide",
    "exhausted_now",
    "is_exhausted",
    "month_of",
    "month_start",
    "state_after",
]
