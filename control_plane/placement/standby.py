"""Active-passive placement around whichever placer runs: the standby replicas that stay
are set aside before it (their GPUs reserved, `split`), the placer sees the primary
demand only, and the missing standby replicas are added afterwards from what is left
(`complete`). Pure; what a deployment's standby is comes in as `StandbyDemand`
(built from the fleet snapshot by `control_plane.fleet_model.standby`)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from control_plane.placement.base import Assignment, PlacementResult, PoolCapacity, ReplicaDemand, Unplaced
from control_plane.placement.colocation import Group, presence
from control_plane.placement.ffd import fresh_assignment, keep_rank, new_replica_id
from fleet_base.residency import describe


class StandbyDemand(BaseModel):
    """A warm minimum of `count` replicas of one deployment version in each of `regions`
    (the known regions matching its standby patterns)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    deployment: str
    version: int = Field(ge=0)
    count: int = Field(1, ge=1)
    gpu_models: tuple[str, ...] = ()
    gpu_count: int = Field(1, ge=1)
    gpu_memory_gb: float = Field(0.0, ge=0)
    regions: tuple[str, ...] = ()
    residency: tuple[str, ...] | None = None  # the deployment's: a standby obeys it too

    def demand(self) -> ReplicaDemand:
        """The replica demand of one region's standby (regions are the standby's own)."""
        return ReplicaDemand(**self.model_dump(exclude={"regions"}))


class StandbySplit(BaseModel):
    model_config = ConfigDict(frozen=True)

    kept: tuple[Assignment, ...] = ()  # standby replicas that stay
    current: tuple[Assignment, ...] = ()  # everything else, for the placer
    pools: tuple[PoolCapacity, ...] = ()  # with the kept standby GPUs reserved


def split(
    standby: Sequence[StandbyDemand], pools: Sequence[PoolCapacity], current: Sequence[Assignment]
) -> StandbySplit:
    if not standby:
        return StandbySplit(current=tuple(current), pools=tuple(pools))
    by_pool = {p.key: p for p in pools}
    kept: list[Assignment] = []
    for s in standby:
        demand = s.demand()
        for region in s.regions:
            group = sorted(
                (
                    a
                    for a in current
                    if a.deployment == s.deployment
                    and a.version == s.version
                    and (p := by_pool.get(a.pool_key)) is not None
                    and p.region == region
                    and p.keeps_existing
                    and demand.acceptable(p)
                ),
                key=lambda a: keep_rank(a, by_pool),
            )
            kept += group[: s.count]  # a warm minimum: the ready ones first
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


def complete(
    standby: Sequence[StandbyDemand],
    pools: Sequence[PoolCapacity],
    result: PlacementResult,
    kept: StandbySplit,
    groups: Sequence[Group] = (),
) -> PlacementResult:
    """The placer's result plus the standby replicas: kept ones, and new ones for each
    standby region short of its count, on the most preferred pool with room left. A
    pipeline step's standby obeys co-placement like its primaries (`groups`): only in a
    cluster where every other step of its unit has a replica or a standby of its own, so
    failing over to it never splits the pipeline; one left without them goes."""
    if not standby:
        return result
    allowed = _step_clusters(groups, result.assignments, standby, pools)
    stays = tuple(a for a in kept.kept if a.deployment not in allowed or a.cluster in allowed[a.deployment])
    gone = tuple(a.replica_id for a in kept.kept if a not in stays)
    kept = kept.model_copy(update={"kept": stays})
    used: dict[tuple[str, str], int] = defaultdict(int)
    for a in (*result.assignments, *kept.kept):
        used[a.pool_key] += a.gpus
    ids = {a.replica_id for a in (*result.assignments, *kept.kept)} | set(result.removed) | set(gone)
    ordered = sorted(pools, key=PoolCapacity.preference)
    added: list[Assignment] = []
    unplaced: list[Unplaced] = []
    for s in sorted(standby, key=lambda s: s.deployment):
        demand = s.demand()
        for region in s.regions:
            have = sum(1 for a in kept.kept if a.deployment == s.deployment and by_region(pools, a) == region)
            for _ in range(s.count - have):
                pool = next(
                    (
                        p
                        for p in ordered
                        if p.region == region
                        and (s.deployment not in allowed or p.cluster in allowed[s.deployment])
                        and p.accepts_new
                        and demand.acceptable(p)
                        and p.total_gpus - used[p.key] >= s.gpu_count
                    ),
                    None,
                )
                if pool is None:
                    why = f"standby region {region}: no healthy pool with room"
                    if s.deployment in allowed:
                        why += f" in a cluster holding every step of {_label(groups, s.deployment)}"
                    if s.residency is not None and not any(
                        p.region == region and demand.residency_ok(p) for p in pools
                    ):
                        why = (
                            f"standby region {region}: residency {describe(s.residency)} allows no pool there"
                        )
                    unplaced.append(
                        Unplaced(
                            deployment=s.deployment, version=s.version, missing=s.count - have, reason=why
                        )
                    )
                    break
                added.append(fresh_assignment(s, pool, None, ids, new_replica_id))
                used[pool.key] += s.gpu_count
                have += 1
    if groups:
        split_off = _unsplit(groups, result.assignments, [*kept.kept, *added])
        gone += tuple(a.replica_id for a in kept.kept if a in split_off)
        kept = kept.model_copy(update={"kept": tuple(a for a in kept.kept if a not in split_off)})
        added = [a for a in added if a not in split_off]
        short: dict[tuple[str, int], int] = defaultdict(int)
        for a in split_off:
            short[(a.deployment, a.version)] += 1
        unplaced += [
            Unplaced(
                deployment=dep,
                version=version,
                missing=n,
                reason=f"standby: {_label(groups, dep)}: a cluster lacking another step's replica gets none",
            )
            for (dep, version), n in sorted(short.items())
        ]
    return PlacementResult(
        kept=result.kept + kept.kept,
        added=result.added + tuple(added),
        removed=result.removed + gone,
        unplaced=result.unplaced + tuple(unplaced),
        preempted=result.preempted,
    )


def by_region(pools: Sequence[PoolCapacity], a: Assignment) -> str:
    return next((p.region for p in pools if p.key == a.pool_key), "")


def _step_clusters(
    groups: Sequence[Group],
    assignments: Sequence[Assignment],
    standby: Sequence[StandbyDemand],
    pools: Sequence[PoolCapacity],
) -> dict[str, set[str]]:
    """Pipeline step -> the clusters where every other step of its unit has a replica in
    the plan or a standby in that cluster's region."""
    region = {p.cluster: p.region for p in pools}
    warm = {(s.deployment, r) for s in standby for r in s.regions}
    out: dict[str, set[str]] = {}
    for g in groups:
        where = presence(g, assignments)
        for dep in g.deployments:
            out[dep] = {
                c
                for c in g.clusters
                if all(
                    o in where.get(c, set()) or (o, region.get(c)) in warm for o in g.deployments if o != dep
                )
            }
    return out


def _unsplit(
    groups: Sequence[Group], assignments: Sequence[Assignment], standby: Sequence[Assignment]
) -> set[Assignment]:
    """Standby replicas to take back so that no cluster holds some steps of a unit but not
    all (the plan's own replicas are never split: its verify saw to that)."""
    out: set[Assignment] = set()
    while True:
        left = [a for a in standby if a not in out]
        more = set()
        for g in groups:
            where = presence(g, [*assignments, *left])
            more |= {
                a for a in left if a.deployment in g.steps and len(where[a.cluster]) < len(g.deployments)
            }
        if not more:
            return out
        out |= more


def _label(groups: Sequence[Group], deployment: str) -> str:
    return next(g.label for g in groups if deployment in g.steps)
