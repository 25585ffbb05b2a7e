"""Say exactly which constraint a demand cannot meet, from the pools alone (pure)."""

from __future__ import annotations

from collections.abc import Sequence

from agent.protocol import Tier
from control_plane.placement.base import PoolCapacity, ReplicaDemand


def _slots(d: ReplicaDemand, pools: Sequence[PoolCapacity]) -> int:
    return sum((p.gpus_per_node // d.gpu_count) * p.nodes for p in pools)


def explain_shortfall(d: ReplicaDemand, pools: Sequence[PoolCapacity]) -> str:
    """The first rule, in the order a reader checks them, that leaves too little room."""
    if not pools:
        return "no capacity pools are known"
    stages = [
        (d.model_ok, f"gpu_models: no pool has an acceptable GPU model ({', '.join(d.gpu_models)})"),
        (d.memory_ok, f"gpu_memory_gb: no pool of an acceptable model has {d.gpu_memory_gb:g} GB per GPU"),
        (d.region_ok, f"regions: no matching pool in the allowed regions ({', '.join(d.regions)})"),
        (d.shape_ok, f"gpus: no matching pool has {d.gpu_count} GPUs per node"),
        (lambda p: p.accepts_new, "no matching pool is on a healthy cluster"),
    ]
    left = list(pools)
    for check, reason in stages:
        left = [p for p in left if check(p)]
        if not left:
            return reason
    total = _slots(d, left)
    if total < d.count:
        return f"capacity: the {len(left)} matching pool(s) hold {total} replica(s) of {d.gpu_count} GPU(s), {d.count} wanted"
    firm = _slots(d, [p for p in left if p.tier != Tier.spot])
    if firm + d.max_spot < d.count:
        return (
            f"max_spot_fraction: at most {d.max_spot} of {d.count} on spot and only {firm} non-spot "
            f"replica slot(s) in the matching pools"
        )
    return f"capacity: the {len(left)} matching pool(s) are taken by other deployments"


def explain_regions(d: ReplicaDemand, pools: Sequence[PoolCapacity], covered: int) -> str:
    regions = {p.region for p in pools if d.acceptable(p) and p.accepts_new}
    if len(regions) < d.min_regions:
        return (
            f"min_regions: only {len(regions)} allowed region(s) have matching pools, {d.min_regions} wanted"
        )
    return f"min_regions: only {covered} of {d.min_regions} regions have room"
