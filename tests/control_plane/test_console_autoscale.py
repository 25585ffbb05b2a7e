"""The console's view of the autoscaler (in-process, no server): the deployment page's card
and the `autoscale.json` charts, from the autoscale loop's decisions and checked forecasts,
or from the stored `scaled` decisions when the loops run elsewhere."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from control_plane.autoscale.prediction_error import PredictionErrors
from control_plane.console import data, series
from tests.control_plane.autoscale.helpers import series as segments
from tests.control_plane.autoscale.test_slo import Work, run

QUIET, BURST = Work(0.5, 1500, 30), Work(16.0, 3500, 30)
T0 = 1_700_000_000.0


def loop_after_a_burst():
    """An autoscale loop's memory after a quiet spell, a 20 s burst and a lull, fed as the loop does."""
    loop = SimpleNamespace(last={}, errors=PredictionErrors(), recent={"code": deque()})
    work = segments((0, 300, QUIET), (300, 320, BURST), (320, 330, Work(0.0, 0, 0)), (330, 420, QUIET))
    loads = dict(work)
    for t, _, d in run("ours", work):
        w = loads[t]
        loop.errors.record(
            "code", T0 + t, d.predicted, {"requests_per_s": w.rps, "prompt_tokens_per_s": w.rps * w.prompt}
        )
        loop.recent["code"].append((T0 + t, d))
        loop.last["code"] = d
    return loop


def test_charts_show_predicted_against_observed_and_the_plan() -> None:
    loop = loop_after_a_burst()
    decided, checked = data.autoscale_points(loop, None, None, "code", T0 + 120)
    charts = series.autoscale_series(decided, checked, T0 + 120, T0 + 420)
    assert set(charts) == {"autoscale_prompt", "autoscale_requests", "autoscale_fleet", "autoscale_plan",
                           "autoscale_error"}  # fmt: skip
    for chart in charts.values():
        assert all(len(v) == len(chart["x"]) for v in chart["series"].values())
    prompt = charts["autoscale_prompt"]
    assert set(prompt["series"]) == {"predicted", "observed"}
    assert max(v for v in prompt["series"]["observed"] if v is not None) == 16.0 * 3500
    # the burst was not foreseen: where it was observed, less had been predicted
    during = [i for i, x in enumerate(prompt["x"]) if T0 + 300 <= x < T0 + 316]
    assert during and all(prompt["series"]["predicted"][i] < prompt["series"]["observed"][i] for i in during)
    fleet = charts["autoscale_fleet"]["series"]
    assert set(fleet) == {"replicas wanted", "burst fleet held"}
    assert max(v for v in fleet["burst fleet held"] if v is not None) >= 2  # held after the burst
    assert set(charts["autoscale_plan"]["series"]) >= {"cold start", "scale-down delay", "burst hold"}
    assert {v for v in charts["autoscale_plan"]["series"]["cold start"] if v is not None} == {60.0}
    errors = charts["autoscale_error"]["series"]
    assert set(errors) == {"prompt_tokens_per_s", "requests_per_s"}
    assert all(v >= 0 for v in errors["requests_per_s"] if v is not None)


def test_no_decisions_no_lines() -> None:
    charts = series.autoscale_series([], [], T0, T0 + 300)
    assert all(chart["series"] == {} for chart in charts.values())
    assert all(len(chart["x"]) <= series.MAX_BUCKETS + 1 for chart in charts.values())


def test_the_card_shows_the_live_plan_and_its_errors() -> None:
    loop = loop_after_a_burst()
    a = data.autoscaler(loop, "code", [])
    assert a is not None and a["live"]
    assert a["cold_start_s"] == 60.0 and a["scale_down_delay_s"] > 0 and a["bursts"] == 1
    assert a["burst_held"] == loop.last["code"].predicted["burst_held"]
    assert {e["signal"] for e in a["errors"]} == {"prompt_tokens_per_s", "requests_per_s"}
    assert all(e["mape"] is not None and e["observed"] > 0 for e in a["errors"])
    assert data.autoscaler(loop, "other", []) is None


def test_without_the_loops_the_card_reads_the_last_stored_decision() -> None:
    stored = [
        {"decision": {"desired": 3, "predicted": {"cold_start_s": 45.0, "burst_held": 3, "bursts": 2}}},
        {"decision": {"desired": 1, "predicted": {"cold_start_s": 60.0}}},
    ]
    a = data.autoscaler(None, "code", [{"decision": None}, *stored])
    assert a is not None and not a["live"] and a["errors"] == []
    assert (a["desired"], a["cold_start_s"], a["burst_held"], a["bursts"]) == (3, 45.0, 3, 2)
    assert (
        data.autoscaler(None, "code", [{"decision": {"desired": 3}}]) is None
    )  # a policy without a forecast
