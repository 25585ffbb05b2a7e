"""Priorities, preemption and GPU quotas inside the placement MILP (`milp.py`): columns
and rows added to the same model, so the solver weighs a preemption against everything
else in one solve (no post-pass).

Per running (demand d, pool p) with cur[d,p] replicas that could stay:

    k[d,p] <= min(cur[d,p], x[d,p])          kept (x - k are new replicas, cur - k leave)
    e[d,p] + k[d,p] <= cur[d,p]              e: replicas preempted (removed, not replaced)
    sum_p x[d,p] + sum_p e[d,p] + f[d] >= min(R_d, C_d)
                                             a running replica leaves only by scale-down, a
                                             move (placed again elsewhere) or a preemption
    sum_{rank d = r} e[d,p] <= M b[p,r],   b[p,r] <= sum_{rank d' > r} (x[d',p] - k[d',p])
                                             class r is preempted on p only where a strictly
                                             higher class places new replicas on p
    sum_{d of c} g_d sum_p e[d,p] <= preemptible_c          never below a class floor
    sum_{d of c} g_d sum_p x[d,p] <= cap_c                  class bound (max_gpus)
    sum_{d of c} g_d sum_p x[d,p] + s_c >= min(floor_c, wanted GPUs of c)   class floor

Weights: a missing replica of rank r costs W_r, with W_{r+1} = F (W_r + P) and F = one
more than the most GPUs of any node, and a preempted replica P on top of its own
shortfall: one replica of a higher class outweighs preempting a whole node of lower
ones (the most one replica needs), so a higher class takes what it must, the lowest
class and the fewest replicas first, and free capacity (any price < W_0) always before
a preemption. A missed floor GPU outweighs any replica; `f` (a running replica that no
longer fits: the pool shrank) outweighs all of it. With one class and no quotas the
weights are the model's usual `big` and nothing here adds a row.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from control_plane.placement.base import PoolCapacity, ReplicaDemand
from control_plane.placement.evaluate import slot_size
from control_plane.placement.quotas import GpuQuotas, class_caps, preemptible, running_gpus

Key = tuple[str, int]
PoolKey = tuple[str, str]


@dataclass
class PriorityTerms:
    keep: dict[tuple[Key, PoolKey], int] = field(default_factory=dict)
    evict: dict[tuple[Key, PoolKey], int] = field(default_factory=dict)
    allow: dict[tuple[PoolKey, int], int] = field(default_factory=dict)
    forced: dict[Key, int] = field(default_factory=dict)
    floor_short: dict[str, tuple[int, float]] = field(default_factory=dict)  # class -> (column, rhs)


def shortfall_weights(
    demands: Mapping[Key, ReplicaDemand], pools: list[PoolCapacity], big: float
) -> tuple[dict[int, float], float]:
    """(cost of a missing replica by class rank, cost of a preemption)."""
    ranks = sorted({d.rank for d in demands.values()})
    fan = 1 + max([p.gpus_per_node for p in pools] + [1])
    penalty = big / 2
    weights: dict[int, float] = {}
    w = big
    for r in ranks:
        weights[r] = w
        w = fan * (w + penalty)
    return weights, penalty


def add_priority_terms(  # noqa: C901 - one term per priority rule of the model, sharing its variable maps
    m,
    by_demand: Mapping[Key, ReplicaDemand],
    by_pool: Mapping[PoolKey, PoolCapacity],
    x: Mapping[tuple[Key, PoolKey], int],
    cur: Mapping[tuple[Key, PoolKey], int],
    quotas: GpuQuotas,
    weights: Mapping[int, float],
    penalty: float,
) -> PriorityTerms:
    t = PriorityTerms()
    x_by_pool: dict[PoolKey, list[tuple[Key, int]]] = defaultdict(list)
    x_by_demand: dict[Key, list[int]] = defaultdict(list)
    for (dk, pk), j in x.items():
        x_by_pool[pk].append((dk, j))
        x_by_demand[dk].append(j)
    for key, n in cur.items():
        if n > 0 and key in x:
            t.keep[key] = m.var(0.0, float(n), True, cost_only=0.0)
            m.row([(t.keep[key], 1.0), (x[key], -1.0)], -math.inf, 0.0)
    # Where a strictly higher class could land new replicas, lower running ones may go.
    higher_on: dict[PoolKey, set[int]] = defaultdict(set)
    for dk, pk in x:
        if by_pool[pk].accepts_new:
            higher_on[pk].add(by_demand[dk].rank)
    for (dk, pk), j_k in t.keep.items():
        r = by_demand[dk].rank
        if any(h > r for h in higher_on[pk]):
            t.evict[(dk, pk)] = j = m.var(penalty, float(cur[(dk, pk)]), True, cost_only=0.0)
            m.row([(j, 1.0), (j_k, 1.0)], -math.inf, float(cur[(dk, pk)]))
    by_pool_rank: dict[tuple[PoolKey, int], list[tuple[Key, PoolKey]]] = defaultdict(list)
    for dk, pk in t.evict:
        by_pool_rank[(pk, by_demand[dk].rank)].append((dk, pk))
    for (pk, r), keys in by_pool_rank.items():
        t.allow[(pk, r)] = b = m.var(0.0, 1.0, True, cost_only=0.0)
        big_m = float(sum(cur[k] for k in keys))
        m.row([(t.evict[k], 1.0) for k in keys] + [(b, -big_m)], -math.inf, 0.0)
        new: list[tuple[int, float]] = []
        for dk, j in x_by_pool[pk]:
            if by_demand[dk].rank > r:
                new.append((j, -1.0))
                if (dk, pk) in t.keep:
                    new.append((t.keep[(dk, pk)], 1.0))
        m.row([(b, 1.0), *new], -math.inf, 0.0)
    # A running replica leaves only by scale-down, a move or a preemption (or: it no longer fits).
    stayable: dict[Key, int] = defaultdict(int)
    for (dk, pk), n in cur.items():
        if (dk, pk) in x:
            stayable[dk] += n
    evict_by_demand: dict[Key, list[int]] = defaultdict(list)
    for (dk, _), j in t.evict.items():
        evict_by_demand[dk].append(j)
    overfull = _overfull_pools(by_demand, by_pool, cur)
    overfull_demands = {dk for (dk, pk) in cur if pk in overfull}
    top = max(weights.values()) if weights else penalty
    huge = (1 + max(p.gpus_per_node for p in by_pool.values())) * (top + penalty)
    for dk, c in stayable.items():
        want = min(by_demand[dk].count, c)
        if want <= 0:
            continue
        terms = [(j, 1.0) for j in x_by_demand[dk]] + [(j, 1.0) for j in evict_by_demand[dk]]
        if dk in overfull_demands:
            t.forced[dk] = m.var(huge * 4, float(want), False, cost_only=0.0)
            terms.append((t.forced[dk], 1.0))
        m.row(terms, float(want), math.inf)
    if quotas:
        _quota_rows(m, t, by_demand, x, quotas, stayable, huge)
    return t


def _quota_rows(m, t: PriorityTerms, by_demand, x, quotas: GpuQuotas, stayable, huge: float) -> None:
    running = running_gpus(by_demand.values(), stayable)
    by_class: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for (dk, _), j in x.items():
        d = by_demand[dk]
        by_class[d.priority].append((j, float(d.gpu_count)))
    for c, cap in class_caps(quotas, running).items():
        if by_class[c]:
            m.row(by_class[c], -math.inf, float(cap))
    for c, left in preemptible(quotas, running).items():
        terms = [
            (j, float(by_demand[dk].gpu_count))
            for (dk, _), j in t.evict.items()
            if by_demand[dk].priority == c
        ]
        if terms:
            m.row(terms, -math.inf, float(left))
    for c, q in quotas.classes.items():
        wanted = sum(d.gpu_count * d.count for d in by_demand.values() if d.priority == c)
        rhs = float(min(q.min_gpus, wanted))
        if rhs > 0 and by_class[c]:
            j = m.var(huge, rhs, False, cost_only=0.0)
            t.floor_short[c] = (j, rhs)
            m.row([*by_class[c], (j, 1.0)], rhs, math.inf)


def _overfull_pools(by_demand, by_pool, cur) -> set[PoolKey]:
    load: dict[PoolKey, float] = defaultdict(float)
    for (dk, pk), n in cur.items():
        load[pk] += n * slot_size(by_demand[dk].gpu_count, by_pool[pk].gpus_per_node)
    return {pk for pk, gpus in load.items() if gpus > by_pool[pk].total_gpus + 1e-9}


def warm_start(
    t: PriorityTerms,
    start: np.ndarray,
    by_demand: Mapping[Key, ReplicaDemand],
    x: Mapping[tuple[Key, PoolKey], int],
    cur: Mapping[tuple[Key, PoolKey], int],
    kept: Mapping[tuple[Key, PoolKey], int],
    evicted: Mapping[tuple[Key, PoolKey], int],
) -> None:
    """Fill this module's columns of a start whose x columns are set (`kept`/`evicted`:
    running replicas the start keeps / preempts per pair)."""
    for key, j in t.keep.items():
        start[j] = min(kept.get(key, 0), start[x[key]], cur[key])
    for key, j in t.evict.items():
        start[j] = min(evicted.get(key, 0), cur[key] - start[t.keep[key]])
    new_by_pool: dict[PoolKey, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    placed: dict[Key, float] = defaultdict(float)
    for (dk, pk), jx in x.items():
        jk = t.keep.get((dk, pk))
        new_by_pool[pk][by_demand[dk].rank] += start[jx] - (start[jk] if jk is not None else 0.0)
        placed[dk] += start[jx]
    for (dk, _), je in t.evict.items():
        placed[dk] += start[je]
    for (pk, r), j in t.allow.items():
        new = sum(n for rank, n in new_by_pool[pk].items() if rank > r)
        start[j] = 1.0 if new >= 1 else 0.0
    stay: dict[Key, int] = defaultdict(int)
    for (dk, pk), n in cur.items():
        if (dk, pk) in x:
            stay[dk] += n
    for dk, j in t.forced.items():
        start[j] = max(0.0, min(by_demand[dk].count, stay[dk]) - placed[dk])
    for c, (j, rhs) in t.floor_short.items():
        held = sum(
            start[jx] * by_demand[dk].gpu_count for (dk, _), jx in x.items() if by_demand[dk].priority == c
        )
        start[j] = max(0.0, rhs - held)


def read(
    t: PriorityTerms, values: np.ndarray
) -> tuple[dict[tuple[Key, PoolKey], int], dict[tuple[Key, PoolKey], int]]:
    """(kept, preempted) replicas per running pair in a solution."""
    kept = {key: round(values[j]) for key, j in t.keep.items()}
    evicted = {key: round(values[j]) for key, j in t.evict.items() if values[j] > 0.5}
    return kept, evicted
