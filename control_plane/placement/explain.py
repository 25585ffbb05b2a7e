"""Say exactly which constraint a demand cannot meet, from the pools alone (pure; shared
by the placers), and why each removed replica goes (the pipeline's explain step)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from control_plane.placement.base import Assignment, PlacementResult, PoolCapacity, ReplicaDemand, Unplaced
from fleet_base import residency
from fleet_base.domain import ClusterStatus, Tier


def _slots(d: ReplicaDemand, pools: Sequence[PoolCapacity]) -> int:
    return sum((p.gpus_per_node // d.gpu_count) * p.nodes for p in pools)


def rule_out(
    d: ReplicaDemand, pools: Sequence[PoolCapacity], labelled: bool = True
) -> str | list[PoolCapacity]:
    """The first pool rule, in the order a reader checks them, that matches no pool (a
    reason), else the pools that pass every rule. Residency comes after the pool's shape:
    when it is what refuses the pools that would fit, the reason names it. `labelled` names the demand's field
    first ("gpu_models: ..."); unlabelled keeps the first-fit placer's own wording."""
    if not pools:
        return "no capacity pools are known"
    memory = "per GPU" if labelled else "GPU memory"
    stages: list[tuple[Callable[[PoolCapacity], bool], str, str]] = [
        (d.model_ok, "gpu_models", f"no pool has an acceptable GPU model ({', '.join(d.gpu_models)})"),
        (d.memory_ok, "gpu_memory_gb", f"no pool of an acceptable model has {d.gpu_memory_gb:g} GB {memory}"),
        (d.region_ok, "regions", f"no matching pool in the allowed regions ({', '.join(d.regions)})"),
        (d.shape_ok, "gpus", f"no matching pool has {d.gpu_count} GPUs per node"),
        (
            d.residency_ok,
            "residency",
            f"no matching pool in the allowed regions is in an allowed jurisdiction "
            f"(residency {residency.describe(d.residency)})",
        ),
        (d.cluster_ok, "", d.clusters_why or "no matching pool in the clusters its pipeline may use"),
        (lambda p: p.accepts_new, "", "no matching pool is on a healthy cluster"),
    ]
    left = list(pools)
    for check, field, reason in stages:
        left = [p for p in left if check(p)]
        if not left:
            return f"{field}: {reason}" if labelled and field else reason
    return left


def residency_note(d: ReplicaDemand, pools: Sequence[PoolCapacity], left: Sequence[PoolCapacity]) -> str:
    """When residency is what keeps a demand short of room: `; residency: ...` naming the
    pools it refuses (that would otherwise match), else ""."""
    if d.residency is None:
        return ""
    refused = [
        p
        for p in pools
        if d.model_ok(p) and d.memory_ok(p) and d.region_ok(p) and d.shape_ok(p) and not d.residency_ok(p)
    ]
    if not refused:
        return ""
    return (
        f"; residency {residency.describe(d.residency)}: only the {len(left)} pool(s) in those "
        f"jurisdictions are allowed, {len(refused)} matching pool(s) elsewhere are not"
    )


def add_note(
    unplaced: dict[tuple[str, int], Unplaced], key: tuple[str, int], d: ReplicaDemand, note: str
) -> None:
    """Append `note` to the demand's Unplaced entry (one with nothing missing if none)."""
    prior = unplaced.get(key)
    unplaced[key] = Unplaced(
        deployment=d.deployment,
        version=d.version,
        missing=prior.missing if prior else 0,
        reason=f"{prior.reason}; {note}" if prior else note,
    )


def explain_shortfall(d: ReplicaDemand, pools: Sequence[PoolCapacity]) -> str:
    """The first rule, in the order a reader checks them, that leaves too little room."""
    left = rule_out(d, pools)
    if isinstance(left, str):
        return left
    total = _slots(d, left)
    if total < d.count:
        return (
            f"capacity: the {len(left)} matching pool(s) hold {total} replica(s) of {d.gpu_count} GPU(s), "
            f"{d.count} wanted{residency_note(d, pools, left)}{pipeline_note(d)}"
        )
    firm = _slots(d, [p for p in left if p.tier != Tier.spot])
    if firm + d.max_spot < d.count:
        return (
            f"max_spot_fraction: at most {d.max_spot} of {d.count} on spot and only {firm} non-spot "
            f"replica slot(s) in the matching pools"
        )
    return (
        f"capacity: the {len(left)} matching pool(s) are taken by other deployments"
        f"{residency_note(d, pools, left)}{pipeline_note(d)}"
    )


def pipeline_note(d: ReplicaDemand) -> str:
    """`; pipeline ...` when co-placement narrows where a step may run, else ""."""
    return f"; {d.clusters_why}" if d.clusters is not None and d.clusters_why else ""


def explain_regions(d: ReplicaDemand, pools: Sequence[PoolCapacity], covered: int) -> str:
    regions = {p.region for p in pools if d.acceptable(p) and p.accepts_new}
    if len(regions) < d.min_regions:
        policy = f" (residency {residency.describe(d.residency)})" if d.residency is not None else ""
        return (
            f"min_regions: only {len(regions)} allowed region(s){policy} have matching pools, "
            f"{d.min_regions} wanted"
        )
    return f"min_regions: only {covered} of {d.min_regions} regions have room"


class RemovalContext(BaseModel):
    """What the explain step needs beyond the placement inputs to say why a running
    replica goes: each deployment's current version, the canary version of those in a
    rollout, every cluster's status (a cluster without pools too)."""

    model_config = ConfigDict(frozen=True)

    current_versions: dict[str, int] = Field(default_factory=dict)
    canary_versions: dict[str, int] = Field(default_factory=dict)
    cluster_status: dict[str, ClusterStatus] = Field(default_factory=dict)


def removal_reasons(
    current: Sequence[Assignment],
    pools: Sequence[PoolCapacity],
    result: PlacementResult,
    context: RemovalContext,
) -> dict[str, str]:
    """Why each removed replica goes, for its event."""
    current_version = context.current_versions
    keys = {p.key for p in pools}
    by_id = {a.replica_id: a for a in current}
    preempted = {p.replica_id: p.reason for p in result.preempted}
    out: dict[str, str] = {}
    for rid in result.removed:
        a = by_id.get(rid)
        if a is None:
            continue
        canary = context.canary_versions.get(a.deployment)
        if rid in preempted:
            why = preempted[rid]
        elif a.deployment not in current_version:
            why = "deployment deleted"
        elif canary is not None and a.version in (canary, current_version[a.deployment]):
            why = f"canary rollout of version {canary} moves capacity"
        elif a.version != current_version[a.deployment]:
            why = f"replaced by version {current_version[a.deployment]}"
        elif context.cluster_status.get(a.cluster) == ClusterStatus.unhealthy:
            why = f"cluster {a.cluster} is unhealthy"
        elif a.pool_key not in keys:
            why = f"pool {a.cluster}/{a.pool} is gone"
        else:
            why = "scaled down or moved"
        out[rid] = why
    return out
