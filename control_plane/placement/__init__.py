"""Placement of replicas onto capacity pools, behind one interface (`Placer`) and a
registry by name (`get_placer("ffd")`, `get_placer("milp")`); every caller goes through
one pipeline around them (`placement.pipeline.run`: split -> solve -> complete -> verify
-> explain)."""

from control_plane.placement.base import (
    PRIORITY_RANK,
    Assignment,
    CurrentAssignment,
    PlacementResult,
    Placer,
    PoolCapacity,
    Preemption,
    PriorityClass,
    ReplicaDemand,
    SolvedPlan,
    SolveInfo,
    Unplaced,
    get_placer,
    placer_names,
    register_placer,
)
from control_plane.placement.ffd import FirstFitDecreasing, new_replica_id
from control_plane.placement.milp import MilpPlacer

__all__ = [
    "PRIORITY_RANK",
    "Assignment",
    "CurrentAssignment",
    "FirstFitDecreasing",
    "MilpPlacer",
    "PlacementResult",
    "Placer",
    "PoolCapacity",
    "Preemption",
    "PriorityClass",
    "ReplicaDemand",
    "SolveInfo",
    "SolvedPlan",
    "Unplaced",
    "get_placer",
    "new_replica_id",
    "placer_names",
    "register_placer",
]
