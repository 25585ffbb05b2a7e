"""Predictions matched to the load observed at their target time (`prediction_error`)."""

from __future__ import annotations

import math

import pytest

from control_plane.autoscale.prediction_error import PredictionErrors, horizon_of


def feed(errors: PredictionErrors, ticks: list[tuple[float, float, float]], horizon: float = 10.0):
    """(at, predicted req/s, observed req/s) per tick; prompt tokens are 1000x requests."""
    out = []
    for at, predicted, observed in ticks:
        out += errors.record(
            "d",
            at,
            {"cold_start_s": horizon, "requests_per_s": predicted, "prompt_tokens_per_s": 1000 * predicted},
            {"requests_per_s": observed, "prompt_tokens_per_s": 1000 * observed},
        )
    return out


@pytest.mark.parametrize(
    ("name", "ticks", "expected"),
    [
        # a prediction is matched with the first observation at or after its target
        ("exact", [(0, 4, 1), (5, 4, 1), (10, 4, 2)], [(0, 4, 2)]),
        ("late tick", [(0, 4, 1), (12, 9, 5)], [(0, 4, 5)]),
        ("not due yet", [(0, 4, 1), (9.9, 4, 5)], []),
        # a target passed long before any observation is dropped, not matched with a later load
        ("stalled loop", [(0, 4, 1), (75, 9, 5)], []),
        # every tick's prediction is kept until its own target
        ("one per tick", [(0, 1, 0), (5, 2, 0), (10, 3, 1), (15, 3, 4)], [(0, 1, 1), (5, 2, 4)]),
    ],
)
def test_predictions_are_matched_at_their_target_time(name, ticks, expected) -> None:
    out = [o for o in feed(PredictionErrors(), ticks) if o.signal == "requests_per_s"]
    assert [(o.made_at, o.predicted, o.observed) for o in out] == expected, name


@pytest.mark.parametrize(
    ("predicted", "observed", "error", "ratio"),
    [
        (6.0, 4.0, 2.0, 0.5),  # over-predicted
        (2.0, 4.0, -2.0, -0.5),  # under-predicted: the burst it did not see
        (3.0, 0.0, 3.0, None),  # nothing came: no ratio, the error in req/s says it
        (0.0, 0.0, 0.0, None),
    ],
)
def test_error_in_the_signals_unit_and_as_a_ratio(predicted, observed, error, ratio) -> None:
    (o,) = [
        o
        for o in feed(PredictionErrors(), [(0, predicted, 9), (10, 9, observed)])
        if o.signal == "requests_per_s"
    ]
    assert o.error == pytest.approx(error)
    assert o.ratio == (None if ratio is None else pytest.approx(ratio))


def test_both_signals_are_tracked() -> None:
    out = feed(PredictionErrors(), [(0, 2, 1), (10, 2, 1)])
    assert {o.signal: o.error for o in out} == {"requests_per_s": 1.0, "prompt_tokens_per_s": 1000.0}


def test_smoothed_mape_weights_by_what_was_observed_and_forgets_old_errors() -> None:
    errors = PredictionErrors(half_life_s=100.0)
    # target 10: predicted 2, observed 1 (100% off); target 20: predicted 10, observed 10
    feed(errors, [(0, 2, 0), (10, 10, 1), (20, 0, 10)])
    d = errors.get("d")
    assert d is not None
    decay = 0.5 ** (10 / 100)
    assert d.mape("requests_per_s") == pytest.approx((1 * decay + 0) / (1 * decay + 10))
    # a near-zero observation in a lull does not blow it up
    feed(errors, [(30, 0.5, 0), (40, 0, 0.01)])
    assert d.mape("requests_per_s") < 0.2
    # an hour of exact predictions later, the old error has faded out
    ticks = [(50 + 10 * i, 5, 5) for i in range(360)]
    feed(errors, ticks)
    assert d.mape("requests_per_s") < 1e-3
    assert d.last["requests_per_s"].mape == d.mape("requests_per_s")  # each outcome carries it (the chart)


@pytest.mark.parametrize(
    ("predicted", "horizon"),
    [
        ({"cold_start_s": 60.0}, 60.0),
        ({"cold_start_s": 60.0, "horizon_s": 66.0}, 66.0),
        ({"cold_start_s": 0.0}, None),
        ({"cold_start_s": math.inf}, None),
        ({"cold_start_s": True}, None),
        ({}, None),
    ],
)
def test_horizon(predicted, horizon) -> None:
    assert horizon_of(predicted) == horizon


def test_a_policy_without_a_forecast_is_not_tracked() -> None:
    errors = PredictionErrors()
    for t in range(0, 100, 5):
        assert errors.record("kpa", t, {}, {"requests_per_s": 3.0}) == []
    d = errors.get("kpa")
    assert d is not None and not d.pending and not d.outcomes


def test_the_rings_are_bounded_and_stay_in_target_order() -> None:
    errors = PredictionErrors()
    # the cold start measured shorter halfway: later predictions fall due earlier
    for t in range(2000):
        horizon = 60.0 if t < 1000 else 10.0
        errors.record("d", t, {"cold_start_s": horizon, "requests_per_s": 1.0}, {"requests_per_s": 1.0})
    d = errors.get("d")
    assert d is not None
    dues = [p.due_at for p in d.pending]
    assert dues == sorted(dues) and len(dues) <= 512
    assert 0 < len(d.outcomes) <= 900
    errors.keep_only({"other"})
    assert errors.get("d") is None
