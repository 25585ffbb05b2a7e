"""Budgets in the database: a pass writes one `budget_threshold` event per threshold
crossed, stores what it decided, marks the keys of a team whose hard budget is spent for
the gateways (and unmarks them when the budget is raised), exports the gauges, and the
budget loop wakes the key loop when the refused teams change."""

from __future__ import annotations

import time
from datetime import datetime, timezone

import pytest
from prometheus_client.core import Metric
from sqlalchemy import select

from control_plane.context import ControlPlaneContext
from control_plane.cost import ledger
from control_plane.cost.budget_metrics import budget_metrics
from control_plane.cost.budget_store import EVENT_KIND, evaluate_budgets, exhausted_teams
from control_plane.db import models as m
from control_plane.fleet_model.snapshot import live_keys
from control_plane.loops.budgets import BudgetLoop
from control_plane.loops.usage import store_records
from control_plane.placement.base import Assignment
from control_plane.settings import Settings
from fleet_base.protocol import UsageRecord


@pytest.fixture
def fleet(sessions):
    with sessions() as s:
        for key_id, team in (("k-ml", "ml"), ("k-ml2", "ml"), ("k-web", "web"), ("k-none", None)):
            s.add(m.ApiKey(key_id=key_id, name=key_id, salt="s", hash="h", scopes=["inference"], team=team))
        s.add(
            m.TeamBudget(team="ml", monthly_dollars=100.0, thresholds=[0.5, 0.8, 1.0], hard=True, alerted={})
        )
        s.add(
            m.TeamBudget(team="web", monthly_dollars=40.0, thresholds=[0.5, 0.8, 1.0], hard=False, alerted={})
        )
        s.commit()
    return sessions


def spend(figures: dict[str, float]):
    return lambda _session, _since, _until: dict(figures)


def run_pass(sessions, figures: dict[str, float], now: float) -> None:
    with sessions() as s:
        evaluate_budgets(s, now, spend=spend(figures))
        s.commit()


def threshold_events(sessions) -> list[str]:
    with sessions() as s:
        return list(s.scalars(select(m.Event.message).where(m.Event.kind == EVENT_KIND).order_by(m.Event.id)))


def refused_keys(sessions) -> set[str]:
    with sessions() as s:
        return {k.key_id for k in live_keys(s) if k.budget_exhausted}


def gauges(sessions, now: float) -> dict[tuple[str, str], float]:
    with sessions() as s:
        families: list[Metric] = list(budget_metrics(s, now))
    return {(f.name, smp.labels["team"]): smp.value for f in families for smp in f.samples}


def test_thresholds_alert_once_and_a_spent_hard_budget_refuses_its_teams_keys(fleet) -> None:
    now = time.time()
    run_pass(fleet, {"ml": 85.0, "web": 50.0, "(none)": 999.0}, now)
    events = threshold_events(fleet)
    assert len(events) == 5  # ml 50%, 80%; web 50%, 80%, 100% (soft: never refuses)
    assert events[0].startswith("team ml reached 50% of its monthly budget: $85.00 of $100.00 spent")
    assert any(e.startswith("team web reached 100% of its monthly budget: $50.00 of $40.00") for e in events)
    assert refused_keys(fleet) == set()

    run_pass(fleet, {"ml": 86.0, "web": 55.0}, now + 30)  # nothing new crossed
    assert len(threshold_events(fleet)) == 5

    run_pass(fleet, {"ml": 100.5, "web": 55.0}, now + 60)
    events = threshold_events(fleet)
    assert len(events) == 6 and events[-1].startswith("team ml reached 100%")
    assert "keys are refused" in events[-1]
    assert refused_keys(fleet) == {"k-ml", "k-ml2"}  # the team's keys only
    g = gauges(fleet, now + 60)
    assert g[("fleet_cost_budget_used_ratio", "ml")] == pytest.approx(1.005)
    assert g[("fleet_cost_budget_dollars", "ml")] == 100.0
    assert g[("fleet_cost_budget_spent_dollars", "web")] == 55.0
    assert (
        g[("fleet_cost_budget_exhausted", "ml")] == 1.0 and g[("fleet_cost_budget_exhausted", "web")] == 0.0
    )

    with fleet() as s:  # the budget raised: served again at the next publish, before any pass
        s.get(m.TeamBudget, "ml").monthly_dollars = 150.0
        s.commit()
    assert refused_keys(fleet) == set()


def test_a_stored_refusal_ends_with_its_month(fleet) -> None:
    now = time.time()
    run_pass(fleet, {"ml": 120.0}, now)
    with fleet() as s:
        assert exhausted_teams(s, now) == {"ml"}
        assert (
            exhausted_teams(s, now + 32 * 86_400) == set()
        )  # next month: last month's spend refuses nothing


async def test_the_loop_wakes_the_key_loop_when_the_refused_teams_change(fleet, tmp_path) -> None:
    ctx = ControlPlaneContext(settings=Settings(home=tmp_path), sessions=fleet)
    figures = {"ml": 10.0}
    loop = BudgetLoop(ctx, interval_s=3600, spend=lambda *_: dict(figures))
    await loop.run_once()
    assert ctx.keys_changed.is_set()  # the first pass always publishes
    ctx.keys_changed.clear()
    await loop.run_once()
    assert not ctx.keys_changed.is_set()  # nothing changed
    figures["ml"] = 100.0
    outcomes = await loop.run_once()
    assert ctx.keys_changed.is_set()
    assert {o.team: o.decision.exhausted for o in outcomes} == {"ml": True, "web": False}


def test_a_budget_crosses_its_thresholds_on_the_real_cost_report(sessions) -> None:
    """The ledger and usage as the loops store them: team ml's one key is the only user of
    a 1-GPU on-demand replica at $10/GPU-hour running since Dec 14, so ml owes $10 an hour
    (idle included); its hard budget is $300."""
    start = datetime(2026, 12, 14, tzinfo=timezone.utc)
    with sessions() as s:
        cluster = m.Cluster(id="c1", region="r")
        cluster.pools = [
            m.CapacityPool(
                name="od", gpu_model="L4", gpus_per_node=1, nodes=2, tier="on-demand", hourly_price=10.0
            )
        ]
        s.add(cluster)
        s.add(m.ApiKey(key_id="ka", name="ka", salt="s", hash="h", team="ml"))
        s.add(m.ApiKey(key_id="kb", name="kb", salt="s", hash="h", team="web"))
        s.add(
            m.TeamBudget(team="ml", monthly_dollars=300.0, thresholds=[0.5, 0.8, 1.0], hard=True, alerted={})
        )
        ledger.start(
            s,
            [Assignment(replica_id="r1", deployment="chat", version=1, cluster="c1", pool="od", gpus=1)],
            start,
        )
        s.commit()
    at = start.timestamp() + 3600
    store_records(
        sessions, [UsageRecord(cluster="c1", key_id="ka", deployment="chat", at=at, latency_s=60.0)]
    )
    hour = 3600.0

    with sessions() as s:  # no spend injected: the real cost report
        (ml,) = evaluate_budgets(s, start.timestamp() + 24 * hour)  # $240: 80%
        s.commit()
    assert ml.decision.spent == pytest.approx(240.0) and ml.decision.crossed == (0.5, 0.8)
    assert not ml.decision.exhausted and refused_keys(sessions) == set()
    with sessions() as s:
        (ml,) = evaluate_budgets(s, start.timestamp() + 30 * hour)  # $300: spent
        s.commit()
    assert ml.decision.crossed == (1.0,) and ml.decision.exhausted
    events = threshold_events(sessions)
    assert [e.split(":")[0] for e in events] == [
        "team ml reached 50% of its monthly budget",
        "team ml reached 80% of its monthly budget",
        "team ml reached 100% of its monthly budget",
    ]
    assert "$300.00 of $300.00 spent in 2026-12" in events[-1]
    with sessions() as s:
        assert exhausted_teams(s, start.timestamp() + 30 * hour) == {"ml"}
