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

import numpy as np

from control_plane.placement.base import PoolCapacity, ReplicaDemand
from control_plane.placement.evaluate import slot_size
from control_plane.placement.milp_model import Key, MilpVars, Pair, PoolKey
from control_plane.placement.quotas import GpuQuotas, class_caps, preemptible, running_gpus
from fleet_base.domain import Tier


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


def add_priority_terms(v: MilpVars, quotas: GpuQuotas, weights: Mapping[int, float], penalty: float) -> None:
    """Add the keep, evict, allow, forced and floor columns to `v` with their rows."""
    _keep_columns(v)
    _evict_columns(v, penalty)
    _allow_rows(v)
    top = max(weights.values()) if weights else penalty
    huge = (1 + max(p.gpus_per_node for p in v.by_pool.values())) * (top + penalty)
    stayable = v.stayable()
    _stay_rows(v, stayable, huge)
    if quotas:
        _quota_rows(v, quotas, stayable, huge)


def _keep_columns(v: MilpVars) -> None:
    """k[d,p] <= min(cur[d,p], x[d,p]) per running pair."""
    for key, n in v.cur.items():
        if n > 0 and key in v.x:
            v.keep[key] = v.m.var(0.0, float(n), True, cost_only=0.0)
            v.m.row([(v.keep[key], 1.0), (v.x[key], -1.0)], -math.inf, 0.0)


def _evict_columns(v: MilpVars, penalty: float) -> None:
    """Where a strictly higher class could land new replicas, lower running ones may go."""
    higher_on: dict[PoolKey, set[int]] = defaultdict(set)
    for dk, pk in v.x:
        if v.by_pool[pk].accepts_new:
            higher_on[pk].add(v.by_demand[dk].rank)
    for (dk, pk), j_k in v.keep.items():
        r = v.by_demand[dk].rank
        if any(h > r for h in higher_on[pk]):
            v.evict[(dk, pk)] = j = v.m.var(penalty, float(v.cur[(dk, pk)]), True, cost_only=0.0)
            v.m.row([(j, 1.0), (j_k, 1.0)], -math.inf, float(v.cur[(dk, pk)]))


def _allow_rows(v: MilpVars) -> None:
    """Class r is preempted on a pool only where a strictly higher class places new replicas."""
    x_by_pool: dict[PoolKey, list[tuple[Key, int]]] = defaultdict(list)
    for (dk, pk), j in v.x.items():
        x_by_pool[pk].append((dk, j))
    by_pool_rank: dict[tuple[PoolKey, int], list[Pair]] = defaultdict(list)
    for dk, pk in v.evict:
        by_pool_rank[(pk, v.by_demand[dk].rank)].append((dk, pk))
    for (pk, r), keys in by_pool_rank.items():
        v.allow[(pk, r)] = b = v.m.var(0.0, 1.0, True, cost_only=0.0)
        big_m = float(sum(v.cur[k] for k in keys))
        v.m.row([(v.evict[k], 1.0) for k in keys] + [(b, -big_m)], -math.inf, 0.0)
        new: list[tuple[int, float]] = []
        for dk, j in x_by_pool[pk]:
            if v.by_demand[dk].rank > r:
                new.append((j, -1.0))
                if (dk, pk) in v.keep:
                    new.append((v.keep[(dk, pk)], 1.0))
        v.m.row([(b, 1.0), *new], -math.inf, 0.0)


def _stay_rows(v: MilpVars, stayable: Mapping[Key, int], huge: float) -> None:
    """A running replica leaves only by scale-down, a move or a preemption (or: it no longer
    fits, its pool shrank or its spot share did)."""
    evict_by_demand: dict[Key, list[int]] = defaultdict(list)
    for (dk, _), j in v.evict.items():
        evict_by_demand[dk].append(j)
    overfull = _overfull_pools(v)
    forced = {dk for (dk, pk) in v.cur if pk in overfull} | _over_spot_share(v)
    # a pipeline step's running replicas may have to leave a cluster its other steps no longer fit
    stepped = {dep for deps in v.co_steps.values() for dep in deps}
    for dk, c in stayable.items():
        want = min(v.by_demand[dk].count, c)
        if want <= 0:
            continue
        terms = [(j, 1.0) for j in v.per_demand[dk]] + [(j, 1.0) for j in evict_by_demand[dk]]
        if dk in forced or dk[0] in stepped:
            v.forced[dk] = v.m.var(huge * 4, float(want), False, cost_only=0.0)
            terms.append((v.forced[dk], 1.0))
        v.m.row(terms, float(want), math.inf)


def _quota_rows(v: MilpVars, quotas: GpuQuotas, stayable: Mapping[Key, int], huge: float) -> None:
    by_demand = v.by_demand
    running = running_gpus(by_demand.values(), stayable)
    by_class: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for (dk, _), j in v.x.items():
        d = by_demand[dk]
        by_class[d.priority].append((j, float(d.gpu_count)))
    for c, cap in class_caps(quotas, running).items():
        if by_class[c]:
            v.m.row(by_class[c], -math.inf, float(cap))
    for c, left in preemptible(quotas, running).items():
        terms = [
            (j, float(by_demand[dk].gpu_count))
            for (dk, _), j in v.evict.items()
            if by_demand[dk].priority == c
        ]
        if terms:
            v.m.row(terms, -math.inf, float(left))
    for c, q in quotas.classes.items():
        wanted = sum(d.gpu_count * d.count for d in by_demand.values() if d.priority == c)
        rhs = float(min(q.min_gpus, wanted))
        if rhs > 0 and by_class[c]:
            j = v.m.var(huge, rhs, False, cost_only=0.0)
            v.floor_short[c] = (j, rhs)
            v.m.row([*by_class[c], (j, 1.0)], rhs, math.inf)


def _over_spot_share(v: MilpVars) -> set[Key]:
    """Demands running more replicas on spot than their spot share now allows (scaled
    down, or the share lowered): the share row sends the surplus away even where no other
    pool can take it."""
    on_spot: dict[Key, int] = defaultdict(int)
    for (dk, pk), n in v.cur.items():
        if v.by_pool[pk].tier == Tier.spot:
            on_spot[dk] += n
    return {dk for dk, n in on_spot.items() if n > v.by_demand[dk].max_spot}


def _overfull_pools(v: MilpVars) -> set[PoolKey]:
    load: dict[PoolKey, float] = defaultdict(float)
    for (dk, pk), n in v.cur.items():
        load[pk] += n * slot_size(v.by_demand[dk].gpu_count, v.by_pool[pk].gpus_per_node)
    return {pk for pk, gpus in load.items() if gpus > v.by_pool[pk].total_gpus + 1e-9}


def warm_start(v: MilpVars, start: np.ndarray, kept: Mapping[Pair, int], evicted: Mapping[Pair, int]) -> None:
    """Fill this module's columns of a start whose x columns are set (`kept`/`evicted`:
    running replicas the start keeps / preempts per pair)."""
    by_demand, x, cur = v.by_demand, v.x, v.cur
    for key, j in v.keep.items():
        start[j] = min(kept.get(key, 0), start[x[key]], cur[key])
    for key, j in v.evict.items():
        start[j] = min(evicted.get(key, 0), cur[key] - start[v.keep[key]])
    new_by_pool: dict[PoolKey, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    placed: dict[Key, float] = defaultdict(float)
    for (dk, pk), jx in x.items():
        jk = v.keep.get((dk, pk))
        new_by_pool[pk][by_demand[dk].rank] += start[jx] - (start[jk] if jk is not None else 0.0)
        placed[dk] += start[jx]
    for (dk, _), je in v.evict.items():
        placed[dk] += start[je]
    for (pk, r), j in v.allow.items():
        new = sum(n for rank, n in new_by_pool[pk].items() if rank > r)
        start[j] = 1.0 if new >= 1 else 0.0
    stay = v.stayable()
    for dk, j in v.forced.items():
        start[j] = max(0.0, min(by_demand[dk].count, stay[dk]) - placed[dk])
    for c, (j, rhs) in v.floor_short.items():
        held = sum(
            start[jx] * by_demand[dk].gpu_count for (dk, _), jx in x.items() if by_demand[dk].priority == c
        )
        start[j] = max(0.0, rhs - held)
