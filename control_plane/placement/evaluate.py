"""What a plan costs and whether it keeps every rule: shared by the optimizing placer,
`fleetctl plan`, the benchmark and the property tests, so all of them count alike.

Cost is per hour: every node of a spot or on-demand pool that holds a replica, plus the
committed price of every reserved node (paid whether used or not)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

from control_plane.placement.base import Assignment, PlacementResult, PoolCapacity, ReplicaDemand
from control_plane.placement.colocation import groups, presence, splits
from control_plane.placement.quotas import GpuQuotas, class_caps, preemptible, running_gpus
from fleet_base.domain import Tier
from fleet_base.pipelines import PipelineSpec


def slot_size(gpus: int, gpus_per_node: int) -> float:
    """GPUs a replica effectively takes on a node: a node holds floor(G/g) replicas of g
    GPUs, so each takes G/floor(G/g). Equal to g when g divides G (1, 2, 4, 8 on 8-GPU
    nodes); with such sizes first-fit-decreasing packs nodes exactly."""
    per_node = gpus_per_node // gpus
    return gpus_per_node / per_node if per_node else math.inf


def nodes_used(
    pools: Sequence[PoolCapacity], assignments: Iterable[Assignment]
) -> dict[tuple[str, str], int]:
    """Nodes holding a replica, per pool (recorded node indices; packed when absent)."""
    by_pool = {p.key: p for p in pools}
    seen: dict[tuple[str, str], set[int]] = defaultdict(set)
    loose: dict[tuple[str, str], float] = defaultdict(float)
    for a in assignments:
        if a.node is not None:
            seen[a.pool_key].add(a.node)
        elif a.pool_key in by_pool:
            p = by_pool[a.pool_key]
            loose[a.pool_key] += slot_size(a.gpus, p.gpus_per_node)
    out = {k: len(v) for k, v in seen.items()}
    for k, gpus in loose.items():
        out[k] = out.get(k, 0) + math.ceil(gpus / by_pool[k].gpus_per_node - 1e-9)
    return out


def committed_cost(pools: Iterable[PoolCapacity]) -> float:
    """Reserved capacity's price, owed whatever the plan."""
    return sum(p.hourly_price * p.nodes for p in pools if p.tier == Tier.reserved)


def plan_cost(pools: Sequence[PoolCapacity], assignments: Iterable[Assignment]) -> float:
    by_pool = {p.key: p for p in pools}
    used = nodes_used(pools, assignments)
    variable = sum(
        by_pool[k].hourly_price * n
        for k, n in used.items()
        if k in by_pool and by_pool[k].tier != Tier.reserved
    )
    return variable + committed_cost(by_pool.values())


def violations(
    demands: Sequence[ReplicaDemand], pools: Sequence[PoolCapacity], assignments: Sequence[Assignment]
) -> list[str]:
    """Every hard rule a plan breaks (empty: it keeps them all). Replica counts may fall
    short (that is reported as unplaced), never exceed; min_regions is checked by the caller
    against the placer's own notes."""
    problems: list[str] = []
    by_pool = {p.key: p for p in pools}
    by_demand = {d.key: d for d in demands}
    count: dict[tuple[str, int], int] = defaultdict(int)
    spot: dict[tuple[str, int], int] = defaultdict(int)
    load: dict[tuple[tuple[str, str], int], float] = defaultdict(float)
    ids: set[str] = set()
    for a in assignments:
        if a.replica_id in ids:
            problems.append(f"replica id {a.replica_id} used twice")
        ids.add(a.replica_id)
        d, p = by_demand.get((a.deployment, a.version)), by_pool.get(a.pool_key)
        if d is None or p is None:
            problems.append(f"{a.replica_id}: unknown demand or pool")
            continue
        if not d.acceptable(p):
            problems.append(f"{a.replica_id}: pool {p.key} breaks a static constraint of {d.deployment}")
        if a.gpus != d.gpu_count:
            problems.append(f"{a.replica_id}: {a.gpus} GPUs, wants {d.gpu_count}")
        if not p.keeps_existing:
            problems.append(f"{a.replica_id}: on unhealthy cluster {p.cluster}")
        count[d.key] += 1
        spot[d.key] += p.tier == Tier.spot
        if a.node is None or not 0 <= a.node < p.nodes:
            problems.append(f"{a.replica_id}: node {a.node} outside pool {p.key} of {p.nodes} nodes")
        else:
            load[(p.key, a.node)] += a.gpus
    for (key, node), gpus in load.items():
        if gpus > by_pool[key].gpus_per_node + 1e-9:
            problems.append(f"node {node} of {key} holds {gpus:g} GPUs of {by_pool[key].gpus_per_node}")
    for key, n in count.items():
        d = by_demand[key]
        if n > d.count:
            problems.append(f"{d.deployment}: {n} replicas placed, {d.count} wanted")
        if spot[key] > d.max_spot:
            problems.append(f"{d.deployment}: {spot[key]} on spot, at most {d.max_spot}")
    return problems


def regions_of(
    demand: ReplicaDemand, pools: Sequence[PoolCapacity], assignments: Iterable[Assignment]
) -> set[str]:
    by_pool = {p.key: p for p in pools}
    return {
        by_pool[a.pool_key].region
        for a in assignments
        if (a.deployment, a.version) == demand.key and a.pool_key in by_pool
    }


def dropped_running(
    demands: Sequence[ReplicaDemand],
    pools: Sequence[PoolCapacity],
    current: Sequence[Assignment],
    removed: Iterable[str],
    added: Iterable[Assignment],
    missing: dict[tuple[str, int], int],
) -> list[str]:
    """Demands a plan leaves short while removing more of their running replicas (ones
    that could stay: demand, pool and shape still allowed) than it places anew. A move is
    a removal plus a placement; a removal with nothing placed instead is a drop."""
    by_pool = {p.key: p for p in pools}
    by_demand = {d.key: d for d in demands}
    gone = set(removed)
    lost: dict[tuple[str, int], int] = defaultdict(int)
    for a in current:
        d, p = by_demand.get((a.deployment, a.version)), by_pool.get(a.pool_key)
        if a.replica_id not in gone or d is None or p is None:
            continue
        if p.keeps_existing and d.acceptable(p) and a.gpus == d.gpu_count:
            lost[d.key] += 1
    for a in added:
        lost[(a.deployment, a.version)] -= 1
    return [
        f"{key[0]} v{key[1]}: {n} running replica(s) dropped while {missing[key]} short"
        for key, n in sorted(lost.items())
        if n > 0 and missing.get(key, 0) > 0
    ]


def priority_problems(
    demands: Sequence[ReplicaDemand],
    pools: Sequence[PoolCapacity],
    current: Sequence[Assignment],
    result: PlacementResult,
    quotas: GpuQuotas | None = None,
) -> list[str]:
    """Every priority or quota rule a plan breaks: a preemption of an equal or higher
    class, of a replica that was not running or is not removed, one whose preemptor gets
    no new replica on that pool; a class over its bound (beyond what it ran) or
    preempted below its floor."""
    by_demand = {d.key: d for d in demands}
    running = {a.replica_id: a for a in current}
    removed = set(result.removed)
    problems: list[str] = []
    landed = {(a.deployment, a.version, a.pool_key) for a in result.added}
    preempted_gpus: dict[str, int] = defaultdict(int)
    for p in result.preempted:
        victim, by = by_demand.get((p.deployment, p.version)), by_demand.get((p.by_deployment, p.by_version))
        a = running.get(p.replica_id)
        if victim is None or by is None or a is None:
            problems.append(f"{p.replica_id}: preempted but not a running replica of a known demand")
            continue
        if victim.rank >= by.rank:
            problems.append(
                f"{p.replica_id} ({victim.priority}) preempted by {by.deployment} ({by.priority})"
            )
        if p.replica_id not in removed:
            problems.append(f"{p.replica_id}: preempted but not removed")
        if (by.deployment, by.version, a.pool_key) not in landed:
            problems.append(
                f"{p.replica_id}: preempted for {by.deployment}, which gets nothing on {a.pool_key}"
            )
        preempted_gpus[victim.priority] += a.gpus
    if quotas:
        stayable: dict[tuple[str, int], int] = defaultdict(int)
        by_pool = {p.key: p for p in pools}
        for a in current:
            d, pool = by_demand.get((a.deployment, a.version)), by_pool.get(a.pool_key)
            if (
                d is not None
                and pool is not None
                and pool.keeps_existing
                and d.acceptable(pool)
                and a.gpus == d.gpu_count
            ):
                stayable[d.key] += 1
        ran = running_gpus(demands, stayable)
        held: dict[str, int] = defaultdict(int)
        for a in result.assignments:
            if (a.deployment, a.version) in by_demand:
                held[by_demand[(a.deployment, a.version)].priority] += a.gpus
        for c, cap in class_caps(quotas, ran).items():
            if held[c] > cap:
                problems.append(f"class {c} holds {held[c]} GPUs, bound {cap}")
        for c, left in preemptible(quotas, ran).items():
            if preempted_gpus[c] > left:
                problems.append(f"class {c}: {preempted_gpus[c]} GPUs preempted, {left} above its floor")
    return problems


def plan_problems(
    demands: Sequence[ReplicaDemand],
    pools: Sequence[PoolCapacity],
    current: Sequence[Assignment],
    result: PlacementResult,
    quotas: GpuQuotas | None = None,
    pipelines: Sequence[PipelineSpec] = (),
) -> list[str]:
    """Every rule the plan breaks, every running replica it drops (a preemption is not a
    drop), every preemption or quota rule it breaks, and every pipeline it splits."""
    missing = {(u.deployment, u.version): u.missing for u in result.unplaced}
    victims = {p.replica_id for p in result.preempted}
    for p in result.preempted:  # short by its preemptions: those are not drops
        missing[(p.deployment, p.version)] = missing.get((p.deployment, p.version), 0) - 1
    removed = [r for r in result.removed if r not in victims]
    forced = _forced_off(pipelines, demands, pools, current, result.assignments)
    return (
        violations(demands, pools, result.assignments)
        + dropped_running(
            demands, pools, current, [r for r in removed if r not in forced], result.added, missing
        )
        + priority_problems(demands, pools, current, result, quotas)
        + splits(pipelines, demands, result.assignments)
    )


def _forced_off(
    pipelines: Sequence[PipelineSpec],
    demands: Sequence[ReplicaDemand],
    pools: Sequence[PoolCapacity],
    current: Sequence[Assignment],
    assignments: Sequence[Assignment],
) -> set[str]:
    """Running replicas of a pipeline step that co-placement forces off their cluster: one
    outside the clusters where every step of its unit can run, or in a cluster the plan
    leaves without some other step of the unit. Dropping those is not a wrong drop; any
    other drop of a step's replica still is."""
    found = groups(pipelines, demands, pools)
    if not found:
        return set()
    out: set[str] = set()
    for g in found:
        where = presence(g, assignments)
        for a in current:
            if a.deployment not in g.steps:
                continue
            others = set(g.deployments) - {a.deployment}
            if a.cluster not in g.clusters or not others <= where.get(a.cluster, set()):
                out.add(a.replica_id)
    return out
