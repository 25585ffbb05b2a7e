"""Traffic-based autoscaling: pure policies (`policy`) used by the control plane's
autoscale loop and by `fleetctl simulate`."""

from control_plane.autoscale.policy import (
    AutoscaleSettings,
    Decision,
    Observation,
    ScalerState,
    make_policy,
    register_policy,
)

__all__ = ["AutoscaleSettings", "Decision", "Observation", "ScalerState", "make_policy", "register_policy"]
