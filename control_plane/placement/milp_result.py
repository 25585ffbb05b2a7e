"""The MILP's solution -> a `PlacementResult`: which running replicas stay (on their
node), which go (moved, scaled down or preempted, with the demand each preemption made
room for), node indices for the new ones, and the reason of every shortfall."""

from __future__ import annotations

from collections import defaultdict

from control_plane.placement.base import (
    Assignment,
    PlacementResult,
    PoolCapacity,
    Preemption,
    ReplicaDemand,
    Unplaced,
)
from control_plane.placement.evaluate import slot_size
from control_plane.placement.explain import add_note, explain_regions, explain_shortfall
from control_plane.placement.ffd import IdFactory, fresh_assignment
from control_plane.placement.milp_model import Key, MilpSolution, MilpVars, Pair
from control_plane.placement.preempt import preemption
from control_plane.placement.quotas import GpuQuotas, class_caps, quota_reason, running_gpus


def build_result(
    v: MilpVars,
    sol: MilpSolution,
    pools: list[PoolCapacity],
    id_factory: IdFactory,
    quotas: GpuQuotas,
) -> PlacementResult:
    by_pair: dict[Pair, list[Assignment]] = defaultdict(list)
    for a in v.cur_ok:
        by_pair[((a.deployment, a.version), a.pool_key)].append(a)
    kept, removed, preempted = _running(v, sol, by_pair)
    new: list[tuple[ReplicaDemand, PoolCapacity]] = []
    for (dk, pk), n in sol.want.items():
        extra = n - min(n, sol.keep.get((dk, pk), len(by_pair.get((dk, pk), []))))
        new += [(v.by_demand[dk], v.by_pool[pk])] * extra
    used_ids = {a.replica_id for a in v.cur_ok} | set(v.removed)
    kept, added, lost = pack(kept, new, v.by_pool, used_ids, id_factory)
    current_ids = {a.replica_id for a in v.cur_ok}
    removed += [a.replica_id for a in lost if a.replica_id in current_ids]
    short = defaultdict(int, sol.shortfall)
    for a in lost:
        short[(a.deployment, a.version)] += 1
    stayable: dict[Key, int] = defaultdict(int)
    for (dk, _), group in by_pair.items():
        stayable[dk] += len(group)
    placed = kept + added
    unplaced = _shortfalls(
        v, pools, short, placed, class_caps(quotas, running_gpus(v.by_demand.values(), stayable)), quotas
    )
    _notes(v, sol, pools, short, placed, preempted, unplaced)
    return PlacementResult(
        kept=tuple(kept),
        added=tuple(added),
        removed=tuple(dict.fromkeys(removed)),
        unplaced=tuple(unplaced[k] for k in sorted(unplaced)),
        preempted=tuple(preempted),
    )


def _running(
    v: MilpVars, sol: MilpSolution, by_pair: dict[Pair, list[Assignment]]
) -> tuple[list[Assignment], list[str], list[Preemption]]:
    """Which running replicas stay, which go, and which of those were preempted (by whom).
    In a pair, those that serve stay first (the model charged their removal only past the
    starting ones), unless the pair is preempted; then replicas stay on the fullest nodes
    and leave from the emptiest, so the room they free comes in whole nodes (what a replica
    of several GPUs, or a preemptor, needs)."""
    kept: list[Assignment] = []
    removed = list(v.removed)
    load: dict[tuple, int] = defaultdict(int)
    for a in v.cur_ok:
        load[(a.pool_key, a.node)] += a.gpus
    preempted: list[Preemption] = []
    for key, group in by_pair.items():
        by_readiness = not sol.evicted.get(key, 0)  # a preemptor needs whole nodes more
        group.sort(
            key=lambda a: (
                by_readiness and not a.ready,
                a.node is None,
                -load[(a.pool_key, a.node)],
                a.node or 0,
                a.replica_id,
            )
        )
        n = min(sol.keep.get(key, sol.want.get(key, 0)), sol.want.get(key, 0))
        kept += group[:n]
        gone = group[n:]
        removed += [a.replica_id for a in gone]
        d = v.by_demand[key[0]]
        by = _preemptor(d, key[1], sol, v.by_demand)
        for a in gone[: sol.evicted.get(key, 0)] if by is not None else ():
            preempted.append(preemption(a, d, by))
    return kept, removed, preempted


def _shortfalls(
    v: MilpVars,
    pools: list[PoolCapacity],
    short: dict[Key, int],
    placed: list[Assignment],
    caps: dict[str, int],
    quotas: GpuQuotas,
) -> dict[Key, Unplaced]:
    """Every demand short of replicas, with why: its class bound, else the first rule that fails."""
    held: dict[str, int] = defaultdict(int)
    for a in placed:
        held[v.by_demand[(a.deployment, a.version)].priority] += a.gpus
    unplaced: dict[Key, Unplaced] = {}
    for dk, n in short.items():
        if n > 0:
            d = v.by_demand[dk]
            cap = caps.get(d.priority)
            if cap is not None and held[d.priority] + d.gpu_count > cap:
                reason = quota_reason(d.priority, quotas, held[d.priority])
            else:
                reason = explain_shortfall(d, pools)
            unplaced[dk] = Unplaced(deployment=d.deployment, version=d.version, missing=n, reason=reason)
    return unplaced


def _notes(
    v: MilpVars,
    sol: MilpSolution,
    pools: list[PoolCapacity],
    short: dict[Key, int],
    placed: list[Assignment],
    preempted: list[Preemption],
    unplaced: dict[Key, Unplaced],
) -> None:
    """Note the demands short of regions, and who preempted an unplaced demand."""
    placed_regions: dict[Key, set[str]] = defaultdict(set)
    for a in placed:
        placed_regions[(a.deployment, a.version)].add(v.by_pool[a.pool_key].region)
    for dk, d in v.by_demand.items():
        k = min(d.min_regions, d.count - short.get(dk, 0))
        if len(placed_regions[dk]) < k or dk in sol.region_short:
            add_note(unplaced, dk, d, explain_regions(d, pools, len(placed_regions[dk])))
    for key, p in sorted({(p.deployment, p.version): p for p in preempted}.items()):
        if key in unplaced:
            add_note(unplaced, key, v.by_demand[key], f"preempted by {p.by_deployment} ({p.by_priority})")


def _preemptor(
    victim: ReplicaDemand, pk: tuple[str, str], sol: MilpSolution, by_demand: dict[Key, ReplicaDemand]
) -> ReplicaDemand | None:
    """The demand of the highest class placing new replicas on the victim's pool."""
    best: tuple | None = None
    for (dk, p2), n in sol.want.items():
        d = by_demand[dk]
        new = n - sol.keep.get((dk, p2), 0)
        if p2 == pk and new > 0 and d.rank > victim.rank:
            score = (d.rank, new * d.gpu_count, d.deployment)
            if best is None or score > best[0]:
                best = (score, d)
    return None if best is None else best[1]


def pack(
    kept: list[Assignment],
    new: list[tuple[ReplicaDemand, PoolCapacity]],
    by_pool: dict[tuple[str, str], PoolCapacity],
    used_ids: set[str],
    id_factory: IdFactory,
) -> tuple[list[Assignment], list[Assignment], list[Assignment]]:
    """Node indices: kept replicas stay on their node when it has room, then everything
    else first-fit, biggest first. Returns (kept, added, lost) where lost are replicas
    no node could take (fragmentation; rare, reported as a shortfall)."""
    free: dict[tuple[str, str], list[float]] = {
        k: [float(p.gpus_per_node)] * p.nodes for k, p in by_pool.items()
    }
    out_kept: list[Assignment] = []
    loose: list[Assignment] = []
    for a in kept:
        size = slot_size(a.gpus, by_pool[a.pool_key].gpus_per_node)
        nodes = free[a.pool_key]
        if a.node is not None and 0 <= a.node < len(nodes) and nodes[a.node] >= size - 1e-9:
            nodes[a.node] -= size
            out_kept.append(a)
        else:
            loose.append(a)
    work: list[tuple[float, int, Assignment | tuple[ReplicaDemand, PoolCapacity]]] = []
    for a in loose:
        work.append((slot_size(a.gpus, by_pool[a.pool_key].gpus_per_node), 0, a))
    for d, p in new:
        work.append((slot_size(d.gpu_count, p.gpus_per_node), 1, (d, p)))
    work.sort(key=lambda w: -w[0])
    added: list[Assignment] = []
    lost: list[Assignment] = []
    for size, is_new, item in work:
        pk = item.pool_key if not is_new else item[1].key
        nodes = free[pk]
        node = next((i for i, f in enumerate(nodes) if f >= size - 1e-9), None)
        if is_new:
            a = fresh_assignment(item[0], item[1], node, used_ids, id_factory)
        else:
            a = item.model_copy(update={"node": node})
        if node is None:
            lost.append(a)
            continue
        nodes[node] -= size
        (added if is_new else out_kept).append(a)
    return out_kept, added, lost
