"""The SLO autoscaler's predictions as Prometheus gauges (`fleet_autoscale_*`): stable names,
one sample per deployment that has the figure."""

from __future__ import annotations

from control_plane.api.metrics import (
    AUTOSCALE_GAUGES,
    PREDICTION_ERROR_GAUGES,
    autoscale_metrics,
    prediction_error_metrics,
)
from control_plane.autoscale import Decision
from control_plane.autoscale.prediction_error import SIGNALS, PredictionErrors
from tests.control_plane.autoscale.helpers import series
from tests.control_plane.autoscale.test_slo import Work, run


def test_the_burst_forecast_is_exported_per_deployment() -> None:
    quiet, burst = Work(0.5, 1500, 30), Work(16.0, 3500, 30)
    d = run("ours", series((0, 300, quiet), (300, 320, burst), (320, 340, quiet)))[-1][2]
    plain = Decision(1, 1, "static: 1 replicas")
    families = {m.name: m for m in autoscale_metrics({"code": d, "static": plain})}
    assert set(families) == {"fleet_autoscale_" + name for name, _, _ in AUTOSCALE_GAUGES}
    value = lambda name: {s.labels["deployment"]: s.value for s in families[name].samples}  # noqa: E731
    assert value("fleet_autoscale_cold_start_seconds") == {"code": 60.0}
    assert value("fleet_autoscale_burst_held_replicas")["code"] == d.predicted["burst_held"] >= 2
    assert value("fleet_autoscale_bursts")["code"] == 1
    assert value("fleet_autoscale_burst_hold_seconds")["code"] >= 60.0
    assert "fleet_autoscale_burst_gap_seconds" not in {
        n for n, f in families.items() if f.samples
    }  # no gap yet


def test_the_forecasts_error_is_exported_per_deployment_and_signal() -> None:
    quiet, burst = Work(0.5, 1500, 30), Work(16.0, 3500, 30)
    errors = PredictionErrors()
    for t, _, d in run("ours", series((0, 300, quiet), (300, 320, burst), (320, 400, quiet))):
        w = burst if 300 <= t < 320 else quiet
        errors.record(
            "code", t, d.predicted, {"requests_per_s": w.rps, "prompt_tokens_per_s": w.rps * w.prompt}
        )
    errors.record("kpa", 0.0, {}, {"requests_per_s": 1.0})  # forecasts nothing: no sample
    families = {m.name: m for m in prediction_error_metrics(errors)}
    assert set(families) == {"fleet_autoscale_" + name for name, _ in PREDICTION_ERROR_GAUGES}
    samples = {
        (name, s.labels["deployment"], s.labels["signal"]): s.value
        for name, f in families.items()
        for s in f.samples
    }
    assert {d for _, d, _ in samples} == {"code"}
    for signal in SIGNALS:
        key = lambda name, signal=signal: (f"fleet_autoscale_{name}", "code", signal)  # noqa: E731
        observed = samples[key("prediction_observed")]
        assert observed == (0.5 if signal == "requests_per_s" else 750.0)
        assert samples[key("prediction_error")] == samples[key("prediction_predicted")] - observed
        assert samples[key("prediction_error_ratio")] == samples[key("prediction_error")] / observed
        assert samples[key("prediction_mape")] >= 0
    # the burst came unannounced: forecasts made before it under-predicted the 10 s it lasted
    missed = [o for o in errors.deployments["code"].outcomes if 300 <= o.due_at < 320]
    assert missed and all(o.error < 0 for o in missed)
    assert all(not f.samples for f in prediction_error_metrics(None))
