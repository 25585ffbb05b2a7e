"""What a rollout's status says about capacity: whether its canary surges onto free
capacity or replaces baseline replicas in place, why, and the ready floor it keeps.
Computed by the same `capacity_plan` that reconcile places with, from the same snapshot."""

from __future__ import annotations

from control_plane.fleet_model.plan import capacity_plan
from control_plane.fleet_model.snapshot import FleetSnapshot
from control_plane.rollouts.policy import Decision

Numbers = dict[str, int | str]


def capacity_numbers(snap: FleetSnapshot) -> dict[str, Numbers]:
    """By deployment in a canary rollout: mode, reason, ready replicas and the floor."""
    out: dict[str, Numbers] = {}
    for d in snap.deployments:
        plan = capacity_plan(snap, d)
        if plan is None:
            continue
        ready = sum(1 for a in snap.assignments if a.deployment == d.name and a.state == "ready")
        out[d.name] = {
            "capacity_mode": plan.mode,
            "capacity_reason": plan.reason,
            "ready": ready,
            "min_ready": plan.min_ready,
        }
    return out


def with_capacity(decision: Decision, numbers: Numbers | None) -> Decision:
    """The decision with the capacity numbers; a canary waiting for replicas also says
    how it gets them."""
    if not numbers:
        return decision
    message = decision.message
    if decision.action == "wait" and decision.state.phase == "deploying":
        message = f"{message}; {numbers['capacity_mode']}: {numbers['capacity_reason']}"
    return decision.model_copy(update={"numbers": {**decision.numbers, **numbers}, "message": message})
