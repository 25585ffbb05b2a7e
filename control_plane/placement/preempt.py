"""Where a demand that finds no free node could go by preempting: the node whose
strictly-lower-class replicas, once removed, leave room, choosing the cheapest such set
(the lowest classes first, then the fewest replicas and GPUs, then pool preference).
Pure; the placer applies the choice. A replica of an equal or higher class is never a
victim, so priority inversion cannot come out of here."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

from control_plane.placement.base import Assignment, PoolCapacity, Preemption, ReplicaDemand


def choose_victims(
    d: ReplicaDemand,
    pools: Sequence[PoolCapacity],
    free: Mapping[tuple[str, str], list[int]],
    occupants: Sequence[Assignment],
    rank_of: Callable[[Assignment], int],
    budget: Mapping[int, int] | None = None,
) -> tuple[PoolCapacity, int, list[Assignment]] | None:
    """(pool, node, replicas to remove) for one replica of `d`, or None. `free` is GPUs
    free per node of each pool; `occupants` the plan's replicas with their nodes;
    `budget` the GPUs that may still be preempted per class rank (a class with a floor
    quota; ranks not in it are unlimited)."""
    budget = budget or {}
    on_node: dict[tuple[tuple[str, str], int], list[Assignment]] = defaultdict(list)
    for a in occupants:
        if a.node is not None and rank_of(a) < d.rank:
            on_node[(a.pool_key, a.node)].append(a)
    best: tuple[tuple, PoolCapacity, int, list[Assignment]] | None = None
    for order, pool in enumerate(pools):
        if not pool.accepts_new or not d.acceptable(pool):
            continue
        for node, room in enumerate(free.get(pool.key, [])):
            lower = sorted(
                on_node.get((pool.key, node), []), key=lambda a: (rank_of(a), -a.gpus, a.replica_id)
            )
            victims: list[Assignment] = []
            spent: dict[int, int] = defaultdict(int)
            for a in lower:
                if room >= d.gpu_count:
                    break
                r = rank_of(a)
                if r in budget and spent[r] + a.gpus > budget[r]:
                    continue  # its class is at its floor
                spent[r] += a.gpus
                victims.append(a)
                room += a.gpus
            if room < d.gpu_count or not victims:
                continue
            cost = (max(rank_of(a) for a in victims), len(victims), sum(a.gpus for a in victims), order, node)
            if best is None or cost < best[0]:
                best = (cost, pool, node, victims)
    return None if best is None else best[1:]


def preemption(victim: Assignment, victim_demand: ReplicaDemand, d: ReplicaDemand) -> Preemption:
    return Preemption(
        replica_id=victim.replica_id,
        deployment=victim.deployment,
        version=victim.version,
        priority=victim_demand.priority,
        by_deployment=d.deployment,
        by_version=d.version,
        by_priority=d.priority,
        reason=(
            f"{victim.replica_id} ({victim_demand.priority}) preempted on {victim.cluster}/{victim.pool} "
            f"to place {d.deployment} v{d.version} ({d.priority}): no free node with {d.gpu_count} GPU(s)"
        ),
    )
