"""Active-passive placement: a deployment's standby regions hold a warm minimum of
replicas (`max(1, min_replicas)` per standby region) that serve nothing while a primary
region is alive (routes flag them `standby`; gateways pass them over).

Pure functions around whichever placer runs: the standby replicas are set aside before
it (their GPUs reserved), the placer sees the primary demand only, and the missing
standby replicas are added afterwards from what is left. While no primary region has a
healthy cluster, the primary demand may also use the standby regions, so the standby
grows to the deployment's full size until the primaries return.
"""

from __future__ import annotations

import fnmatch
import math
from collections import defaultdict
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from agent.protocol import ClusterStatus
from control_plane.loops.snapshot import FleetSnapshot, VersionSpec
from control_plane.placement import Assignment, PlacementResult, PoolCapacity, ReplicaDemand, Unplaced
from control_plane.placement.ffd import new_replica_id

NO_REGION = "-no-primary-region-"  # matches no region: the primary demand is unplaceable


def in_regions(region: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(region, p) for p in patterns)


def standby_count(spec: VersionSpec) -> int:
    return max(1, spec.min_replicas)


def primary_regions(snap: FleetSnapshot, spec: VersionSpec) -> tuple[str, ...]:
    """Where the deployment's serving replicas may go: its allowed regions less the
    standby ones; every allowed or standby region while no primary has a healthy cluster."""
    if not spec.standby_regions:
        return spec.regions
    known = sorted({c.region for c in snap.clusters})
    allowed = [r for r in known if not spec.regions or in_regions(r, spec.regions)]
    primary = [r for r in allowed if not in_regions(r, spec.standby_regions)]
    if not any(c.region in primary and c.status == ClusterStatus.healthy for c in snap.clusters):
        return tuple(sorted(set(allowed) | {r for r in known if in_regions(r, spec.standby_regions)})) or (
            NO_REGION,
        )
    return tuple(primary) or (NO_REGION,)


class StandbySplit(BaseModel):
    model_config = ConfigDict(frozen=True)

    kept: tuple[Assignment, ...] = ()  # standby replicas that stay
    current: tuple[Assignment, ...] = ()  # everything else, for the placer
    pools: tuple[PoolCapacity, ...] = ()  # with the kept standby GPUs reserved


def _standby_specs(snap: FleetSnapshot) -> dict[str, VersionSpec]:
    out = {}
    for d in snap.deployments:
        spec = snap.specs.get((d.name, d.current_version))
        if spec is not None and spec.standby_regions and d.replicas > 0:
            out[d.name] = spec
    return out


def _standby_regions(snap: FleetSnapshot, spec: VersionSpec) -> list[str]:
    return sorted({c.region for c in snap.clusters if in_regions(c.region, spec.standby_regions)})


def split(snap: FleetSnapshot, pools: Sequence[PoolCapacity], current: Sequence[Assignment]) -> StandbySplit:
    specs = _standby_specs(snap)
    if not specs:
        return StandbySplit(current=tuple(current), pools=tuple(pools))
    by_pool = {p.key: p for p in pools}
    kept: list[Assignment] = []
    for name, spec in specs.items():
        demand = _demand(spec)
        for region in _standby_regions(snap, spec):
            group = sorted(
                (
                    a
                    for a in current
                    if a.deployment == name
                    and a.version == spec.version
                    and (p := by_pool.get(a.pool_key)) is not None
                    and p.region == region
                    and p.keeps_existing
                    and demand.acceptable(p)
                ),
                key=lambda a: (by_pool[a.pool_key].preference(), a.replica_id),
            )
            kept += group[: standby_count(spec)]
    ids = {a.replica_id for a in kept}
    used: dict[tuple[str, str], int] = defaultdict(int)
    for a in kept:
        used[a.pool_key] += a.gpus
    return StandbySplit(
        kept=tuple(kept),
        current=tuple(a for a in current if a.replica_id not in ids),
        pools=tuple(_reserve(p, used.get(p.key, 0)) for p in pools),
    )


def _reserve(pool: PoolCapacity, gpus: int) -> PoolCapacity:
    """The pool less `gpus` (a one-node pool shrinks its node, else whole nodes go)."""
    if gpus <= 0:
        return pool
    if pool.nodes == 1:
        left = pool.gpus_per_node - gpus
        return pool.model_copy(update={"gpus_per_node": max(1, left), "nodes": 1 if left > 0 else 0})
    return pool.model_copy(update={"nodes": max(0, pool.nodes - math.ceil(gpus / pool.gpus_per_node))})


def _demand(spec: VersionSpec) -> ReplicaDemand:
    return ReplicaDemand(
        deployment=spec.deployment,
        version=spec.version,
        count=standby_count(spec),
        gpu_models=spec.gpu_models,
        gpu_count=spec.gpu_count,
        gpu_memory_gb=spec.gpu_memory_gb,
    )


def complete(
    snap: FleetSnapshot, pools: Sequence[PoolCapacity], result: PlacementResult, standby: StandbySplit
) -> PlacementResult:
    """The placer's result plus the standby replicas: kept ones, and new ones for each
    standby region short of its count, on the most preferred pool with room left."""
    specs = _standby_specs(snap)
    if not specs:
        return result
    used: dict[tuple[str, str], int] = defaultdict(int)
    for a in (*result.assignments, *standby.kept):
        used[a.pool_key] += a.gpus
    ids = {a.replica_id for a in (*result.assignments, *standby.kept)} | set(result.removed)
    ordered = sorted(pools, key=PoolCapacity.preference)
    added: list[Assignment] = []
    unplaced: list[Unplaced] = []
    for name, spec in sorted(specs.items()):
        demand = _demand(spec)
        for region in _standby_regions(snap, spec):
            have = sum(1 for a in standby.kept if a.deployment == name and by_region(pools, a) == region)
            for _ in range(standby_count(spec) - have):
                pool = next(
                    (
                        p
                        for p in ordered
                        if p.region == region
                        and p.accepts_new
                        and demand.acceptable(p)
                        and p.total_gpus - used[p.key] >= spec.gpu_count
                    ),
                    None,
                )
                if pool is None:
                    unplaced.append(
                        Unplaced(
                            deployment=name,
                            version=spec.version,
                            missing=standby_count(spec) - have,
                            reason=f"standby region {region}: no healthy pool with room",
                        )
                    )
                    break
                rid = new_replica_id(name, spec.version)
                while rid in ids:
                    rid = new_replica_id(name, spec.version)
                ids.add(rid)
                used[pool.key] += spec.gpu_count
                have += 1
                added.append(
                    Assignment(
                        replica_id=rid,
                        deployment=name,
                        version=spec.version,
                        cluster=pool.cluster,
                        pool=pool.name,
                        gpus=spec.gpu_count,
                    )
                )
    return PlacementResult(
        kept=result.kept + standby.kept,
        added=result.added + tuple(added),
        removed=result.removed,
        unplaced=result.unplaced + tuple(unplaced),
    )


def by_region(pools: Sequence[PoolCapacity], a: Assignment) -> str:
    return next((p.region for p in pools if p.key == a.pool_key), "")
