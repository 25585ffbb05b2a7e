"""The monthly budget policy, as a table: thresholds alerted once per calendar month (UTC),
several at once, a new month resets them, and a hard budget refuses exactly while its
month-to-date spend is at or over it (raising it lifts the refusal)."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from control_plane.cost.budgets import (
    Budget,
    BudgetState,
    decide,
    exhausted_now,
    month_of,
    month_start,
    state_after,
)


def ts(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp()


DEC = ts("2026-12-15T12:00:00")
JAN = ts("2027-01-01T00:00:05")
SOFT = Budget(monthly_dollars=500.0)
HARD = Budget(monthly_dollars=500.0, hard=True)


def alerted(month: str, *thresholds: float, spent: float = 0.0) -> BudgetState:
    return BudgetState(month=month, thresholds=thresholds, spent=spent)


CASES = [
    # name, budget, spent, state before, now, newly crossed, alerted after, refused
    ("nothing spent", SOFT, 0.0, None, DEC, (), (), False),
    ("under the first threshold", SOFT, 249.99, None, DEC, (), (), False),
    ("exactly on a threshold crosses it", SOFT, 250.0, None, DEC, (0.5,), (0.5,), False),
    ("already alerted: not again", SOFT, 300.0, alerted("2026-12", 0.5), DEC, (), (0.5,), False),
    ("the next one only", SOFT, 400.0, alerted("2026-12", 0.5), DEC, (0.8,), (0.5, 0.8), False),
    ("several in one step", SOFT, 510.0, None, DEC, (0.5, 0.8, 1.0), (0.5, 0.8, 1.0), False),
    ("soft budget spent: alert, never refuse", SOFT, 900.0, alerted("2026-12", 0.5, 0.8), DEC,
     (1.0,), (0.5, 0.8, 1.0), False),
    ("hard under budget: serve", HARD, 499.0, alerted("2026-12", 0.5, 0.8), DEC, (), (0.5, 0.8), False),
    ("hard at budget: refuse", HARD, 500.0, alerted("2026-12", 0.5, 0.8), DEC, (1.0,), (0.5, 0.8, 1.0), True),
    ("hard over budget, alerted: still refused, no new alert", HARD, 620.0,
     alerted("2026-12", 0.5, 0.8, 1.0), DEC, (), (0.5, 0.8, 1.0), True),
    ("hard budget raised after exhaustion: refusal lifts", Budget(monthly_dollars=1000.0, hard=True), 620.0,
     alerted("2026-12", 0.5, 0.8, 1.0), DEC, (), (0.5, 0.8, 1.0), False),
    ("made soft after exhaustion: refusal lifts", SOFT, 620.0, alerted("2026-12", 0.5, 0.8, 1.0), DEC,
     (), (0.5, 0.8, 1.0), False),
    ("a new month forgets last month's alerts", SOFT, 260.0, alerted("2026-12", 0.5, 0.8, 1.0), JAN,
     (0.5,), (0.5,), False),
    ("a new month with little spent: hard budget serves again", HARD, 3.0,
     alerted("2026-12", 0.5, 0.8, 1.0, spent=700.0), JAN, (), (), False),
    ("custom thresholds", Budget(monthly_dollars=100.0, thresholds=(0.25, 0.9)), 95.0, None, DEC,
     (0.25, 0.9), (0.25, 0.9), False),
    ("a threshold added mid-month below the spend alerts once", Budget(monthly_dollars=100.0,
     thresholds=(0.5, 0.7, 0.8)), 75.0, alerted("2026-12", 0.5), DEC, (0.7,), (0.5, 0.7), False),
    ("float products land on the threshold", Budget(monthly_dollars=100.0, thresholds=(0.07, 0.7)), 70.0,
     None, DEC, (0.07, 0.7), (0.07, 0.7), False),
    ("a negative spend (a refund) is none", HARD, -5.0, None, DEC, (), (), False),
]  # fmt: skip


@pytest.mark.parametrize(
    ("budget", "spent", "before", "now", "crossed", "after", "refused"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_policy_table(
    budget: Budget,
    spent: float,
    before: BudgetState | None,
    now: float,
    crossed: tuple[float, ...],
    after: tuple[float, ...],
    refused: bool,
) -> None:
    d = decide(budget, spent, before, now)
    assert d.crossed == crossed
    assert d.alerted == after
    assert d.exhausted is refused
    assert d.month == month_of(now)
    assert d.used_ratio == pytest.approx(max(0.0, spent) / budget.monthly_dollars)


def test_a_month_of_spend_alerts_each_threshold_once_then_a_new_month_starts_over() -> None:
    """The loop's view: decide, store the state, decide again on the next tick."""
    state: BudgetState | None = None
    alerts: list[tuple[str, float]] = []
    ticks = [(ts("2026-12-01T00:00:30"), 10.0), (ts("2026-12-10T00:00:00"), 260.0),
             (ts("2026-12-10T00:00:30"), 270.0), (ts("2026-12-20T00:00:00"), 505.0),
             (ts("2026-12-31T23:59:59"), 640.0), (ts("2027-01-01T00:00:00"), 0.0),
             (ts("2027-01-09T00:00:00"), 410.0)]  # fmt: skip
    refused = []
    for now, spent in ticks:
        d = decide(HARD, spent, state, now)
        alerts += [(d.month, t) for t in d.crossed]
        state = state_after(d, now)
        refused.append(exhausted_now(HARD, state, now))
    dec, jan = "2026-12", "2027-01"
    assert alerts == [(dec, 0.5), (dec, 0.8), (dec, 1.0), (jan, 0.5), (jan, 0.8)]
    assert refused == [False, False, False, True, True, False, False]


def test_a_stored_refusal_lapses_with_its_month_and_with_a_raised_budget() -> None:
    """What the key publisher applies between two loop ticks, from the last stored spend."""
    spent = BudgetState(month="2026-12", thresholds=(1.0,), spent=520.0)
    assert exhausted_now(HARD, spent, DEC)
    assert not exhausted_now(HARD, spent, JAN)  # last month's spend is no refusal
    assert not exhausted_now(Budget(monthly_dollars=600.0, hard=True), spent, DEC)
    assert not exhausted_now(SOFT, spent, DEC)
    assert not exhausted_now(HARD, None, DEC)


def test_months_are_utc_calendar_months() -> None:
    assert month_of(ts("2026-12-31T23:59:59")) == "2026-12"
    assert month_of(ts("2027-01-01T00:00:00")) == "2027-01"
    assert month_start(DEC) == ts("2026-12-01T00:00:00")
    assert month_start(ts("2027-01-01T00:00:00")) == ts("2027-01-01T00:00:00")


def test_stored_state_round_trips_and_garbage_reads_as_none() -> None:
    d = decide(HARD, 420.0, None, DEC)
    state = state_after(d, DEC)
    assert BudgetState.from_stored(state.stored()) == state
    assert BudgetState.from_stored({}) is None
    assert BudgetState.from_stored({"month": 7, "thresholds": "x"}) is None
    assert BudgetState.from_stored(None) is None


@pytest.mark.parametrize(
    "bad",
    [{"monthly_dollars": 0}, {"monthly_dollars": -1}, {"monthly_dollars": 1, "thresholds": (0.0,)},
     {"monthly_dollars": 1, "thresholds": (1e-9,)},
     {"monthly_dollars": 1, "thresholds": (1.5,)}, {"monthly_dollars": 1, "thresholds": ()},
     {"monthly_dollars": float("nan")}],
)  # fmt: skip
def test_a_budget_is_positive_with_fractions_in_zero_to_one(bad: dict) -> None:
    with pytest.raises(ValueError):
        Budget(**bad)


def test_thresholds_are_sorted_and_unique() -> None:
    assert Budget(monthly_dollars=1, thresholds=(1.0, 0.5, 0.5)).thresholds == (0.5, 1.0)
