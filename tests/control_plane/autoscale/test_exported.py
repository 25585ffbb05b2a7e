"""The SLO autoscaler's predictions as Prometheus gauges (`fleet_autoscale_*`): stable names,
one sample per deployment that has the figure."""

from __future__ import annotations

from control_plane.api.metrics import AUTOSCALE_GAUGES, autoscale_metrics
from control_plane.autoscale import Decision
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
