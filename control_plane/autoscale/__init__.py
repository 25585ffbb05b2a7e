"""Autoscaling: pure policies (`policy`, `slo`, `planner`) and the capacity model (`capacity`) used by the control plane's
autoscale loop and by `fleetctl simulate`."""

from control_plane.autoscale.planner import SlaPlanner
from control_plane.autoscale.policy import (
    AutoscaleSettings,
    Decision,
    Observation,
    ScalerState,
    make_policy,
    register_policy,
)
from control_plane.autoscale.slo import SloPolicy

register_policy("slo", lambda: SloPolicy("slo"))
register_policy("ours", lambda: SloPolicy("ours"))
register_policy("planner", SlaPlanner)

__all__ = ["AutoscaleSettings", "Decision", "Observation", "ScalerState", "make_policy", "register_policy"]
