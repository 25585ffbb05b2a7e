"""Optimizing placement: a mixed-integer program solved by HiGHS.

Per (demand d, acceptable pool p) an integer x[d,p] (replicas), per pool an integer
y[p] (nodes to acquire, at most the pool's `nodes`), and:

    sum_p x[d,p] + u[d] = R_d                    every replica placed (u: shortfall)
    sum_d s[d,p] x[d,p] <= G_p y[p]              node packing (s: effective slot size)
    sum_{p spot} x[d,p] <= floor(S_d R_d)        spot share
    z[d,r] <= sum_{p in r} x[d,p],  sum_r z[d,r] + v[d] >= min(K_d, R_d)   active-active
    m[d,p] >= cur[d,p] - x[d,p]                  moves away from the current assignment
    r[d,p] >= ready[d,p] - x[d,p]                of them, replicas that serve (the starting
                                                  ones in a pair go first)
    w[g,c] <= sum_{p in c} x[s,p] <= R_s w[g,c]   pipelines: every step s of group g in
                                                  cluster c, or none (w binary)

minimize   sum_p price_p y_p   (reserved pools: 0, already paid for; plus the pool's
                                reliability premium, control_plane.placement.reliability)
         + move_fraction * (price per GPU of the pool left) * GPUs * (m + r) / 2
                                                  a move must pay (half of it for a replica
                                                  still starting)
         + distance_weight * RTT(pool, demand regions) * GPUs * x            then nearness
         + BIG * u + BIG_R * v                                                 shortfalls last

The weights make the order cost > moves > distance without a second solve: a replica
moves only to save more than `move_fraction` of its own hourly price, and one still
starting for half that: where each removal frees a paid node, a scale-down stops starting
replicas before warm ones unless the warm ones' price per GPU is over (1 - f/2) / (1 - f)
times theirs (f = move_fraction: 1.056 at 0.1); otherwise node costs decide first, and at
equal cost readiness does. The solve is
warm-started from the current assignment (on small instances, from first-fit-decreasing
seeded with it, so it is never worse than FFD; FFD is Python and too slow to seed
thousands of replicas over thousands of pools), runs under a time limit and a relative
gap, and the LP relaxation of the cost-only problem gives a lower bound. Past
`max_pairs` variables, or on any solver failure, the greedy FFD plan is used (made
spot-share safe).

Stateless: an unchanged fleet is not solved again only when the caller hands back the
last plan (`previous`, a `SolvedPlan`). Checking the plan against every rule and falling
back to FFD when it fails is the placement pipeline's verify step
(`control_plane.placement.pipeline`).

The model and its columns are one `MilpVars` (`milp_model.py`); the priority terms
(`milp_priority.py`) and the read-back (`milp_result.py`) take and fill that structure.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import highspy
import numpy as np

from control_plane.geo import default_latency
from control_plane.placement.base import (
    Assignment,
    PlacementResult,
    Placer,
    PoolCapacity,
    ReplicaDemand,
    SolvedPlan,
    SolveInfo,
    current_split,
    demands_by_key,
    fingerprint_inputs,
    register_placer,
)
from control_plane.placement.colocation import Group, name_pipelines, narrow
from control_plane.placement.evaluate import committed_cost, plan_cost, slot_size
from control_plane.placement.ffd import IdFactory, new_replica_id, spot_safe_ffd
from control_plane.placement.milp_model import Key, MilpSolution, MilpVars, Pair, SparseModel
from control_plane.placement.milp_priority import add_priority_terms, shortfall_weights
from control_plane.placement.milp_priority import warm_start as priority_start
from control_plane.placement.milp_result import build_result
from control_plane.placement.quotas import NO_QUOTAS, GpuQuotas
from fleet_base.domain import Tier
from fleet_base.pipelines import PipelineSpec

# RTT in ms from a pool to a client region; None when unknown.
Distance = Callable[[PoolCapacity, str], float | None]


TIE_WEIGHT = 1e-7  # $/hour per preference rank per GPU


class MilpPlacer(Placer):
    name = "milp"

    def __init__(
        self,
        time_limit_s: float = 5.0,
        mip_gap: float = 0.005,
        max_pairs: int = 150_000,
        ffd_warm_limit: int = 500_000,  # replicas x pools up to which FFD seeds the solver
        move_fraction: float = 0.1,
        distance_weight: float = 1e-4,  # $/hour per ms of RTT per GPU
        distance: Distance | None = None,
        id_factory: IdFactory = new_replica_id,
        threads: int = 1,
        quotas: GpuQuotas = NO_QUOTAS,
    ) -> None:
        self.quotas = quotas
        self.time_limit_s = time_limit_s
        self.mip_gap = mip_gap
        self.max_pairs = max_pairs
        self.ffd_warm_limit = ffd_warm_limit
        self.move_fraction = move_fraction
        self.distance_weight = distance_weight
        self._distance = distance
        self._id_factory = id_factory
        self.threads = threads

    def place(
        self,
        demands: Sequence[ReplicaDemand],
        pools: Sequence[PoolCapacity],
        current: Sequence[Assignment] = (),
        pipelines: Sequence[PipelineSpec] = (),
    ) -> PlacementResult:
        return self.solve(demands, pools, current, pipelines=pipelines)[0]

    def solve(
        self,
        demands: Sequence[ReplicaDemand],
        pools: Sequence[PoolCapacity],
        current: Sequence[Assignment] = (),
        lp_bound: bool = False,
        previous: SolvedPlan | None = None,
        pipelines: Sequence[PipelineSpec] = (),
    ) -> tuple[PlacementResult, SolveInfo]:
        started = time.perf_counter()
        fp = self.fingerprint(demands, pools, pipelines)
        if previous is not None and previous.matches(fp, current, lp_bound):
            # Nothing changed since the last plan and the caller runs it: the same answer.
            result = PlacementResult(kept=tuple(current), unplaced=previous.unplaced)
            return result, previous.info.model_copy(update={"method": "unchanged", "solve_s": 0.0})
        return self._solve_fresh(demands, pools, current, lp_bound, started, pipelines)

    def fingerprint(
        self,
        demands: Sequence[ReplicaDemand],
        pools: Sequence[PoolCapacity],
        pipelines: Sequence[PipelineSpec] = (),
    ) -> int:
        """What a `SolvedPlan` of this placer is keyed by: the inputs, quotas and pipelines."""
        return fingerprint_inputs(demands, pools, (self.quotas.fingerprint(), tuple(pipelines)))

    def _solve_fresh(
        self, demands, pools, current, lp_bound, started, pipelines=()
    ) -> tuple[PlacementResult, SolveInfo]:
        demands, groups = narrow(demands, pools, pipelines)
        by_demand = demands_by_key(demands)
        pools = list({p.key: p for p in pools}.values())
        pairs = [
            (d, p)
            for d in by_demand.values()
            for p in pools
            if d.count > 0 and d.acceptable(p) and p.keeps_existing
        ]

        def greedy() -> PlacementResult:
            return spot_safe_ffd(
                list(by_demand.values()), pools, current, self._id_factory, self.quotas, pipelines
            )

        if not any(d.count > 0 for d in by_demand.values()):  # nothing wanted: remove all, exact
            plan = greedy()
            return plan, solve_info("milp-optimal", pools, plan, started, note="nothing to place")
        if len(pairs) > self.max_pairs:
            plan = greedy()
            note = f"{len(pairs)} pairs > {self.max_pairs}"
            return plan, solve_info("greedy-huge", pools, plan, started, note=note)
        # Warm start: FFD seeded with the current assignment while that is cheap (FFD is
        # Python, replicas x pools); past that, the current assignment itself.
        replicas = sum(d.count for d in by_demand.values())
        warm = greedy() if replicas * len(pools) <= self.ffd_warm_limit else None
        try:
            plan, info = self._solve(by_demand, pools, current, pairs, warm, started, lp_bound, groups)
            return name_pipelines(plan, demands), info
        except Exception as e:
            plan = warm or greedy()
            return plan, solve_info("greedy-error", pools, plan, started, note=f"{type(e).__name__}: {e}")

    # ----------------------------------------------------------------- the model

    def _build(self, by_demand, pools, current, pairs, groups=()) -> MilpVars:
        """The model: variables, rows and the maps from (demand, pool) to columns."""
        by_pool = {p.key: p for p in pools}
        cur_ok, removed = current_split(current, by_demand, by_pool)
        cur: dict[Pair, int] = defaultdict(int)
        serving: dict[Pair, int] = defaultdict(int)
        for a in cur_ok:
            cur[((a.deployment, a.version), a.pool_key)] += 1
            if a.ready:
                serving[((a.deployment, a.version), a.pool_key)] += 1
        v = MilpVars(
            by_demand=by_demand, by_pool=by_pool, cur=cur, cur_ok=cur_ok, removed=removed, serving=serving
        )
        m = v.m
        pairs = [(d, p) for d, p in pairs if p.accepts_new or cur[(d.key, p.key)] > 0]
        top_price = max([p.hourly_price + p.reliability_premium for p in pools] + [1.0])
        big = 100.0 * (top_price + 1.0)
        for _, p in pairs:
            if p.key not in v.y:
                price = 0.0 if p.tier == Tier.reserved else p.hourly_price
                # failures priced in (placement.reliability); the LP bound stays in dollars paid
                v.y[p.key] = m.var(price + p.reliability_premium, float(p.nodes), True, cost_only=price)
        # Ties go as first-fit-decreasing would break them (tier, price per GPU, names),
        # so equal-cost plans are deterministic and familiar.
        rank = {p.key: i for i, p in enumerate(sorted(pools, key=PoolCapacity.preference))}
        for d, p in pairs:
            dist = self._demand_distance(d, p)
            upper = d.count if p.accepts_new else min(d.count, cur[(d.key, p.key)])
            tie = TIE_WEIGHT * rank[p.key] * d.gpu_count
            v.x[(d.key, p.key)] = m.var(
                self.distance_weight * dist * d.gpu_count + tie, float(upper), True, cost_only=0.0
            )
        weights, penalty = shortfall_weights(by_demand, pools, big)
        v.u = {k: m.var(weights[d.rank], float(d.count), False) for k, d in by_demand.items() if d.count > 0}
        for (dk, pk), n in cur.items():
            w = self.move_fraction * by_pool[pk].price_per_gpu * by_demand[dk].gpu_count / 2
            v.moves[(dk, pk)] = m.var(w + 1e-3, float(n), False, cost_only=0.0)
            if serving[(dk, pk)]:
                v.ready_moves[(dk, pk)] = m.var(w + 1e-3, float(serving[(dk, pk)]), False, cost_only=0.0)
        _add_capacity_rows(v)
        _add_regions(v, big / 2)
        _add_pipelines(v, groups)
        add_priority_terms(v, self.quotas, weights, penalty)
        # moves: every running replica not kept (a preempted one too); of them, those that
        # serve, once the pair's starting ones are gone
        for counts, columns in ((cur, v.moves), (serving, v.ready_moves)):
            for (dk, pk), j in columns.items():
                kj = v.keep.get((dk, pk), v.x.get((dk, pk)))
                terms = [(j, 1.0)] + ([(kj, 1.0)] if kj is not None else [])
                m.row(terms, float(counts[(dk, pk)]), math.inf)
        return v

    def _solve(self, by_demand, pools, current, pairs, greedy, started, want_bound, groups=()):
        v = self._build(by_demand, pools, current, pairs, groups)
        start = _warm_start(v, greedy)
        m = v.m
        remaining = self.time_limit_s - (time.perf_counter() - started)
        h, values = self._run(m, remaining, start)
        if m.problem(values, h.getInfo().objective_function_value) is not None:
            # HiGHS can report the optimum's objective while handing back the warm start's
            # columns (a worse plan, called optimal): solve again without the start.
            h, values = self._run(m, self.time_limit_s - (time.perf_counter() - started), None)
            problem = m.problem(values, h.getInfo().objective_function_value)
            if problem is not None:
                raise RuntimeError(f"HiGHS's solution does not check out: {problem}")
        status = h.getModelStatus()
        method = {
            highspy.HighsModelStatus.kOptimal: "milp-optimal",
            highspy.HighsModelStatus.kTimeLimit: "milp-time-limit",
        }.get(status, f"milp-{h.modelStatusToString(status).lower().replace(' ', '-')}")
        mip_bound = h.getInfo().mip_dual_bound
        bound, lp_s = None, 0.0
        if want_bound:
            lp_started = time.perf_counter()
            lp = m.highs(True, max(1.0, self.time_limit_s), 0.0, self.threads)
            lp.run()
            if lp.getModelStatus() == highspy.HighsModelStatus.kOptimal:
                bound = lp.getInfo().objective_function_value + committed_cost(pools)
            lp_s = time.perf_counter() - lp_started
            started += lp_s  # solve_s is the placement's own time, not the bound's
        result = build_result(v, MilpSolution.read(v, values), pools, self._id_factory, self.quotas)
        info = solve_info(
            method,
            pools,
            result,
            started,
            lp_bound=bound,
            mip_bound=mip_bound,
            variables=len(m.cost),
            lp_s=round(lp_s, 4),
        )
        return result, info

    def _run(
        self, m: SparseModel, time_limit_s: float, start: np.ndarray | None
    ) -> tuple[highspy.Highs, np.ndarray]:
        h = m.highs(False, time_limit_s, self.mip_gap, self.threads)
        if start is not None:
            sol = highspy.HighsSolution()
            sol.col_value = start.tolist()
            sol.value_valid = True
            h.setSolution(sol)
        h.run()
        values = np.array(h.getSolution().col_value)
        if len(values) != len(m.cost) or h.getInfo().primal_solution_status != 2:
            status = h.modelStatusToString(h.getModelStatus())
            raise RuntimeError(f"HiGHS found no feasible solution ({status})")
        return h, values

    def _demand_distance(self, d: ReplicaDemand, p: PoolCapacity) -> float:
        if not d.demand_regions:
            return 0.0
        dist = self._distance or default_distance()
        total = sum(max(0.0, w) for w in d.demand_regions.values()) or 1.0
        out = 0.0
        for region, w in d.demand_regions.items():
            rtt = dist(p, region)
            out += max(0.0, w) / total * (rtt if rtt is not None else 0.0)
        return out


def solve_info(method: str, pools, result: PlacementResult, started: float, **kw) -> SolveInfo:
    return SolveInfo(
        method=method,
        cost=round(plan_cost(pools, result.assignments), 6),
        solve_s=round(time.perf_counter() - started, 4),
        **kw,
    )


def _add_capacity_rows(v: MilpVars) -> None:
    """Every replica placed or short, node packing, and the spot share."""
    m, x, by_demand, by_pool = v.m, v.x, v.by_demand, v.by_pool
    for (dk, _), j in x.items():
        v.per_demand[dk].append(j)
    for dk, j_u in v.u.items():
        d = by_demand[dk]
        m.row([(j, 1.0) for j in v.per_demand[dk]] + [(j_u, 1.0)], d.count, d.count)
    for (dk, pk), j in x.items():
        v.per_pool[pk].append((j, slot_size(by_demand[dk].gpu_count, by_pool[pk].gpus_per_node)))
    for pk, terms in v.per_pool.items():
        m.row([*terms, (v.y[pk], -float(by_pool[pk].gpus_per_node))], -math.inf, 0.0)
    for dk, d in by_demand.items():
        spot = [x[(dk, pk)] for (dk2, pk) in x if dk2 == dk and by_pool[pk].tier == Tier.spot]
        if spot and d.max_spot < d.count:
            m.row([(j, 1.0) for j in spot], -math.inf, float(d.max_spot))


def _add_regions(v: MilpVars, big_region: float) -> None:
    """Active-active: a binary per (demand, region) covered and a shortfall per demand
    short of its min_regions."""
    m = v.m
    for dk, d in v.by_demand.items():
        k = min(d.min_regions, d.count)
        if k <= 1:
            continue
        by_region: dict[str, list[int]] = defaultdict(list)
        for (dk2, pk), j in v.x.items():
            if dk2 == dk:
                by_region[v.by_pool[pk].region].append(j)
        v.region_short[dk] = m.var(big_region, float(k), False)
        for region, js in by_region.items():
            v.covered[(dk, region)] = m.var(0.0, 1.0, True)
            m.row([(v.covered[(dk, region)], 1.0)] + [(j, -1.0) for j in js], -math.inf, 0.0)
        m.row(
            [(v.covered[(dk, r)], 1.0) for r in by_region] + [(v.region_short[dk], 1.0)], float(k), math.inf
        )


def _add_pipelines(v: MilpVars, groups: Sequence[Group]) -> None:
    """Co-placement: per group and cluster a binary w; each step has between w and R_s * w
    replicas there (demands are already limited to the group's clusters)."""
    m = v.m
    cols: dict[tuple[str, str], list[int]] = defaultdict(list)  # (deployment, cluster) -> x columns
    for (dk, pk), j in v.x.items():
        cols[(dk[0], pk[0])].append(j)
    wanted: dict[str, int] = defaultdict(int)
    for dk, d in v.by_demand.items():
        wanted[dk[0]] += d.count
    for g in groups:
        v.co_steps[g.pipelines] = g.deployments
        for cluster in g.clusters:
            w = v.co_placed[(g.pipelines, cluster)] = m.var(0.0, 1.0, True, cost_only=0.0)
            for dep in g.deployments:
                js = cols.get((dep, cluster), [])
                m.row([(j, 1.0) for j in js] + [(w, -1.0)], 0.0, math.inf)
                m.row([(j, 1.0) for j in js] + [(w, -float(wanted[dep]))], -math.inf, 0.0)


def _seed_counts(v: MilpVars, greedy: PlacementResult | None) -> tuple[dict, dict, dict]:
    """Replicas per (demand, pool) to start from, those of them already running, and the
    running ones the greedy plan preempts: the greedy plan's, else what runs now (capped
    at each demand's count)."""
    counts: dict[Pair, int] = defaultdict(int)
    kept0: dict[Pair, int] = defaultdict(int)
    evicted0: dict[Pair, int] = defaultdict(int)
    running_ids = {a.replica_id for a in v.cur_ok}
    if greedy is not None:
        for a in greedy.assignments:
            counts[((a.deployment, a.version), a.pool_key)] += 1
            if a.replica_id in running_ids:
                kept0[((a.deployment, a.version), a.pool_key)] += 1
        by_id = {a.replica_id: a for a in v.cur_ok}
        for pre in greedy.preempted:
            if pre.replica_id in by_id:
                evicted0[((pre.deployment, pre.version), by_id[pre.replica_id].pool_key)] += 1
    else:
        left = {dk: d.count for dk, d in v.by_demand.items()}
        for (dk, pk), n in sorted(v.cur.items()):
            take = min(n, left.get(dk, 0))
            if take and (dk, pk) in v.x:
                counts[(dk, pk)] = kept0[(dk, pk)] = take
                left[dk] -= take
    return counts, kept0, evicted0


def _warm_start(v: MilpVars, greedy: PlacementResult | None) -> np.ndarray:
    """Start columns from the greedy plan, else what runs now (capped at each demand's count)."""
    by_demand, by_pool, cur = v.by_demand, v.by_pool, v.cur
    counts, kept0, evicted0 = _seed_counts(v, greedy)
    start = np.zeros(len(v.m.cost))
    for key, j in v.x.items():
        start[j] = counts.get(key, 0)
    for pk, j in v.y.items():
        p = by_pool[pk]
        used = sum(start[jx] * s for jx, s in v.per_pool.get(pk, []))
        start[j] = min(p.nodes, math.ceil(used / p.gpus_per_node - 1e-9))
    for dk, j in v.u.items():
        start[j] = by_demand[dk].count - sum(start[jx] for jx in v.per_demand[dk])
    priority_start(v, start, kept0, evicted0)
    for counts, columns in ((cur, v.moves), (v.serving, v.ready_moves)):
        for (dk, pk), j in columns.items():
            kj = v.keep.get((dk, pk), v.x.get((dk, pk)))
            start[j] = max(0.0, counts[(dk, pk)] - (start[kj] if kj is not None else 0))
    covered: dict[Key, set[str]] = defaultdict(set)
    for (dk, pk), jx in v.x.items():
        if start[jx] > 0:
            covered[dk].add(by_pool[pk].region)
    for (dk, region), j in v.covered.items():
        start[j] = 1.0 if region in covered[dk] else 0.0
    for dk, j in v.region_short.items():
        k = min(by_demand[dk].min_regions, by_demand[dk].count)
        start[j] = max(0.0, k - len(covered[dk]))
    hosts: dict[tuple[str, str], float] = defaultdict(float)
    for (dk, pk), jx in v.x.items():
        hosts[(dk[0], pk[0])] += start[jx]
    for (pipes, cluster), j in v.co_placed.items():
        start[j] = 1.0 if all(hosts[(d, cluster)] > 0 for d in v.co_steps[pipes]) else 0.0
    return start


_DISTANCE: Distance | None = None


def default_distance() -> Distance:
    """Pool-to-client-region RTT from the shipped latency model, built once."""
    global _DISTANCE
    if _DISTANCE is None:
        lat = default_latency()
        _DISTANCE = lambda pool, region: lat.rtt_ms(pool.region, region, provider=pool.provider)  # noqa: E731
    return _DISTANCE


register_placer(MilpPlacer.name, lambda: MilpPlacer(time_limit_s=2.0))
