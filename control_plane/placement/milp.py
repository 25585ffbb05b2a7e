"""Optimizing placement: a mixed-integer program solved by HiGHS.

Per (demand d, acceptable pool p) an integer x[d,p] (replicas), per pool an integer
y[p] (nodes to acquire, at most the pool's `nodes`), and:

    sum_p x[d,p] + u[d] = R_d                    every replica placed (u: shortfall)
    sum_d s[d,p] x[d,p] <= G_p y[p]              node packing (s: effective slot size)
    sum_{p spot} x[d,p] <= floor(S_d R_d)        spot share
    z[d,r] <= sum_{p in r} x[d,p],  sum_r z[d,r] + v[d] >= min(K_d, R_d)   active-active
    m[d,p] >= cur[d,p] - x[d,p]                  moves away from the current assignment

minimize   sum_p price_p y_p   (reserved pools: 0, already paid for)
         + move_fraction * (price per GPU of the pool left) * GPUs * m       a move must pay
         + distance_weight * RTT(pool, demand regions) * GPUs * x            then nearness
         + BIG * u + BIG_R * v                                                 shortfalls last

The weights make the order cost > moves > distance without a second solve: a replica
moves only to save more than `move_fraction` of its own hourly price. The solve is
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

Longer than ~400 lines: the model (`_Model`, `MilpPlacer._build`), its warm start
(`_warm_start`) and the solve and read-back (`MilpPlacer._solve`) share the variable maps
(`_Built`), so they stay in one module.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import highspy
import numpy as np

from control_plane.placement.base import (
    Assignment,
    PlacementResult,
    Placer,
    PoolCapacity,
    ReplicaDemand,
    SolvedPlan,
    SolveInfo,
    fingerprint_inputs,
    register_placer,
)
from control_plane.placement.evaluate import committed_cost, plan_cost, slot_size
from control_plane.placement.ffd import IdFactory, new_replica_id, spot_safe_ffd
from control_plane.placement.milp_priority import PriorityTerms, add_priority_terms, shortfall_weights
from control_plane.placement.milp_priority import read as read_priority
from control_plane.placement.milp_priority import warm_start as priority_start
from control_plane.placement.milp_result import build_result
from control_plane.placement.quotas import NO_QUOTAS, GpuQuotas
from fleet_base.domain import Tier

# RTT in ms from a pool to a client region; None when unknown.
Distance = Callable[[PoolCapacity, str], float | None]


@dataclass
class _Model:
    """A sparse model in row-wise form, built once and solved as MIP and as LP."""

    cost: list[float] = field(default_factory=list)
    cost_only: list[float] = field(default_factory=list)  # objective of the LP bound
    lower: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)
    integer: list[bool] = field(default_factory=list)
    row_lower: list[float] = field(default_factory=list)
    row_upper: list[float] = field(default_factory=list)
    starts: list[int] = field(default_factory=lambda: [0])
    index: list[int] = field(default_factory=list)
    value: list[float] = field(default_factory=list)

    def var(self, cost: float, upper: float, integer: bool, cost_only: float | None = None) -> int:
        self.cost.append(cost)
        self.cost_only.append(cost if cost_only is None else cost_only)
        self.lower.append(0.0)
        self.upper.append(upper)
        self.integer.append(integer)
        return len(self.cost) - 1

    def row(self, terms: dict[int, float] | list[tuple[int, float]], lo: float, hi: float) -> None:
        items = terms.items() if isinstance(terms, dict) else terms
        for i, v in items:
            if v:
                self.index.append(i)
                self.value.append(v)
        self.starts.append(len(self.index))
        self.row_lower.append(lo)
        self.row_upper.append(hi)

    def problem(self, values: np.ndarray, objective: float, tol: float = 1e-6) -> str | None:
        """Why `values` is not the solution the solver claims (bounds, integrality, rows,
        or an objective other than the one it reported), or None. Vectorized: it runs on
        every solve, and large models have hundreds of thousands of entries."""
        lower, upper = np.array(self.lower, dtype=float), np.array(self.upper, dtype=float)
        bad = np.flatnonzero((values < lower - tol) | (values > upper + tol))
        if bad.size:
            j = int(bad[0])
            return f"column {j} = {values[j]} outside [{lower[j]}, {upper[j]}]"
        integer = np.array(self.integer, dtype=bool)
        frac = np.flatnonzero(integer & (np.abs(values - np.round(values)) > tol))
        if frac.size:
            return f"column {int(frac[0])} = {values[int(frac[0])]} is not integral"
        starts = np.array(self.starts, dtype=np.int64)
        rows = len(self.row_lower)
        owner = np.repeat(np.arange(rows), np.diff(starts))
        prod = np.array(self.value, dtype=float) * values[np.array(self.index, dtype=np.int64)]
        totals = np.bincount(owner, weights=prod, minlength=rows) if rows else np.zeros(0)
        row_lower, row_upper = np.array(self.row_lower, dtype=float), np.array(self.row_upper, dtype=float)
        broken = np.flatnonzero((totals < row_lower - tol) | (totals > row_upper + tol))
        if broken.size:
            r = int(broken[0])
            return f"row {r} = {totals[r]} outside [{row_lower[r]}, {row_upper[r]}]"
        own = float(np.dot(self.cost, values))
        if abs(own - objective) > tol * max(1.0, abs(objective)):
            return f"the columns cost {own:.6g}, the solver reported {objective:.6g}"
        return None

    def highs(self, relax: bool, time_limit_s: float, gap: float, threads: int) -> highspy.Highs:
        inf = highspy.kHighsInf
        lp = highspy.HighsLp()
        lp.num_col_ = len(self.cost)
        lp.num_row_ = len(self.row_lower)
        lp.col_cost_ = np.array(self.cost_only if relax else self.cost, dtype=float)
        lp.col_lower_ = np.array(self.lower, dtype=float)
        lp.col_upper_ = np.array([inf if math.isinf(u) else u for u in self.upper], dtype=float)
        lp.row_lower_ = np.array([-inf if math.isinf(v) else v for v in self.row_lower], dtype=float)
        lp.row_upper_ = np.array([inf if math.isinf(v) else v for v in self.row_upper], dtype=float)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.start_ = np.array(self.starts, dtype=np.int32)
        lp.a_matrix_.index_ = np.array(self.index, dtype=np.int32)
        lp.a_matrix_.value_ = np.array(self.value, dtype=float)
        if not relax:
            lp.integrality_ = [
                highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous for i in self.integer
            ]
        h = _new_highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("time_limit", max(0.05, time_limit_s))
        h.setOptionValue("mip_rel_gap", gap)
        h.setOptionValue("threads", threads)
        h.setOptionValue("random_seed", 0)
        h.passModel(lp)
        return h


TIE_WEIGHT = 1e-7  # $/hour per preference rank per GPU
_BANNER_SILENCED = False


def _new_highs() -> highspy.Highs:
    """A Highs instance; the first one of a process prints a banner on stdout from C++
    (which would corrupt `fleetctl plan -o json`), so fd 1 is muted around it."""
    global _BANNER_SILENCED
    if _BANNER_SILENCED:
        return highspy.Highs()
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            h = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    _BANNER_SILENCED = True
    return h


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
    ) -> PlacementResult:
        return self.solve(demands, pools, current)[0]

    def solve(
        self,
        demands: Sequence[ReplicaDemand],
        pools: Sequence[PoolCapacity],
        current: Sequence[Assignment] = (),
        lp_bound: bool = False,
        previous: SolvedPlan | None = None,
    ) -> tuple[PlacementResult, SolveInfo]:
        started = time.perf_counter()
        if previous is not None and previous.matches(self.fingerprint(demands, pools), current, lp_bound):
            # Nothing changed since the last plan and the caller runs it: the same answer.
            result = PlacementResult(kept=tuple(current), unplaced=previous.unplaced)
            return result, previous.info.model_copy(update={"method": "unchanged", "solve_s": 0.0})
        return self._solve_fresh(demands, pools, current, lp_bound, started)

    def fingerprint(self, demands: Sequence[ReplicaDemand], pools: Sequence[PoolCapacity]) -> int:
        """What a `SolvedPlan` of this placer is keyed by: the inputs and the quotas."""
        return fingerprint_inputs(demands, pools, self.quotas.fingerprint())

    def _solve_fresh(self, demands, pools, current, lp_bound, started) -> tuple[PlacementResult, SolveInfo]:
        by_demand: dict[tuple[str, int], ReplicaDemand] = {}
        for d in demands:
            if d.key in by_demand:
                raise ValueError(f"duplicate demand for {d.deployment} v{d.version}")
            by_demand[d.key] = d
        pools = list({p.key: p for p in pools}.values())
        pairs = [
            (d, p)
            for d in by_demand.values()
            for p in pools
            if d.count > 0 and d.acceptable(p) and p.keeps_existing
        ]

        def greedy() -> PlacementResult:
            return spot_safe_ffd(list(by_demand.values()), pools, current, self._id_factory, self.quotas)

        if len(pairs) > self.max_pairs:
            plan = greedy()
            note = f"{len(pairs)} pairs > {self.max_pairs}"
            return plan, solve_info("greedy-huge", pools, plan, started, note=note)
        # Warm start: FFD seeded with the current assignment while that is cheap (FFD is
        # Python, replicas x pools); past that, the current assignment itself.
        replicas = sum(d.count for d in by_demand.values())
        warm = greedy() if replicas * len(pools) <= self.ffd_warm_limit else None
        try:
            return self._solve(by_demand, pools, current, pairs, warm, started, lp_bound)
        except Exception as e:
            plan = warm or greedy()
            return plan, solve_info("greedy-error", pools, plan, started, note=f"{type(e).__name__}: {e}")

    # ----------------------------------------------------------------- the model

    def _build(self, by_demand, pools, current, pairs) -> _Built:
        """The model: variables, rows and the maps from (demand, pool) to columns."""
        by_pool = {p.key: p for p in pools}
        cur_ok, removed = _current_split(current, by_demand, by_pool)
        cur: dict[tuple, int] = defaultdict(int)
        for a in cur_ok:
            cur[((a.deployment, a.version), a.pool_key)] += 1
        pairs = [(d, p) for d, p in pairs if p.accepts_new or cur[(d.key, p.key)] > 0]
        top_price = max([p.hourly_price for p in pools] + [1.0])
        big = 100.0 * (top_price + 1.0)
        big_region = big / 2
        m = _Model()
        x: dict[tuple, int] = {}
        y: dict[tuple[str, str], int] = {}
        for _, p in pairs:
            if p.key not in y:
                price = 0.0 if p.tier == Tier.reserved else p.hourly_price
                y[p.key] = m.var(price, float(p.nodes), True)
        # Ties go as first-fit-decreasing would break them (tier, price per GPU, names),
        # so equal-cost plans are deterministic and familiar.
        rank = {p.key: i for i, p in enumerate(sorted(pools, key=PoolCapacity.preference))}
        for d, p in pairs:
            dist = self._demand_distance(d, p)
            upper = d.count if p.accepts_new else min(d.count, cur[(d.key, p.key)])
            tie = TIE_WEIGHT * rank[p.key] * d.gpu_count
            x[(d.key, p.key)] = m.var(
                self.distance_weight * dist * d.gpu_count + tie, float(upper), True, cost_only=0.0
            )
        weights, penalty = shortfall_weights(by_demand, pools, big)
        u = {k: m.var(weights[d.rank], float(d.count), False) for k, d in by_demand.items() if d.count > 0}
        moves: dict[tuple, int] = {}
        for (dk, pk), n in cur.items():
            p = by_pool[pk]
            w = self.move_fraction * p.price_per_gpu * by_demand[dk].gpu_count + 1e-3
            moves[(dk, pk)] = m.var(w, float(n), False, cost_only=0.0)
        # demand rows
        per_demand: dict[tuple, list[int]] = defaultdict(list)
        for (dk, _), j in x.items():
            per_demand[dk].append(j)
        for dk, j_u in u.items():
            d = by_demand[dk]
            m.row([(j, 1.0) for j in per_demand[dk]] + [(j_u, 1.0)], d.count, d.count)
        # packing rows
        per_pool: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
        for (dk, pk), j in x.items():
            p = by_pool[pk]
            per_pool[pk].append((j, slot_size(by_demand[dk].gpu_count, p.gpus_per_node)))
        for pk, terms in per_pool.items():
            m.row([*terms, (y[pk], -float(by_pool[pk].gpus_per_node))], -math.inf, 0.0)
        # spot share
        for dk, d in by_demand.items():
            spot = [x[(dk, pk)] for (dk2, pk) in x if dk2 == dk and by_pool[pk].tier == Tier.spot]
            if spot and d.max_spot < d.count:
                m.row([(j, 1.0) for j in spot], -math.inf, float(d.max_spot))
        v, z = _add_regions(m, x, by_demand, by_pool, big_region)
        # priorities, preemption, class quotas (placement/milp_priority.py)
        prio = add_priority_terms(m, by_demand, by_pool, x, cur, self.quotas, weights, penalty)
        # moves: every running replica not kept (a preempted one too)
        for (dk, pk), j in moves.items():
            kj = prio.keep.get((dk, pk), x.get((dk, pk)))
            terms = [(j, 1.0)] + ([(kj, 1.0)] if kj is not None else [])
            m.row(terms, float(cur[(dk, pk)]), math.inf)
        return _Built(
            m=m,
            x=x,
            y=y,
            u=u,
            moves=moves,
            v=v,
            z=z,
            prio=prio,
            per_pool=per_pool,
            per_demand=per_demand,
            cur=cur,
            cur_ok=cur_ok,
            removed=removed,
            by_pool=by_pool,
        )

    def _solve(self, by_demand, pools, current, pairs, greedy, started, want_bound):
        b = self._build(by_demand, pools, current, pairs)
        start = _warm_start(b, by_demand, greedy)
        m, x, u, v, prio = b.m, b.x, b.u, b.v, b.prio
        cur_ok, removed = b.cur_ok, b.removed
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
        want = {key: round(values[j]) for key, j in x.items() if values[j] > 0.5}
        shortfall = {dk: round(values[j]) for dk, j in u.items() if values[j] > 0.5}
        region_short = {dk for dk, j in v.items() if values[j] > 0.5}
        keep, evicted = read_priority(prio, values)
        result = build_result(
            by_demand,
            pools,
            cur_ok,
            removed,
            want,
            shortfall,
            region_short,
            keep,
            evicted,
            self._id_factory,
            self.quotas,
        )
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
        self, m: _Model, time_limit_s: float, start: np.ndarray | None
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
        dist = self._distance or _default_distance()
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


@dataclass
class _Built:
    """The model and its variable maps, shared by the warm start and the read-back."""

    m: _Model
    x: dict[tuple, int]  # (demand, pool) -> replicas
    y: dict[tuple[str, str], int]  # pool -> nodes
    u: dict[tuple, int]  # demand -> shortfall
    moves: dict[tuple, int]  # (demand, pool) -> running replicas not kept
    v: dict[tuple, int]  # demand -> regions short
    z: dict[tuple, int]  # (demand, region) -> covered
    prio: PriorityTerms
    per_pool: dict
    per_demand: dict
    cur: dict[tuple, int]
    cur_ok: list[Assignment]
    removed: list[str]
    by_pool: dict[tuple[str, str], PoolCapacity]


def _add_regions(m: _Model, x, by_demand, by_pool, big_region: float) -> tuple[dict, dict]:
    """Active-active: a binary per (demand, region) covered and a shortfall per demand
    short of its min_regions."""
    v: dict[tuple, int] = {}
    z: dict[tuple, int] = {}
    for dk, d in by_demand.items():
        k = min(d.min_regions, d.count)
        if k <= 1:
            continue
        by_region: dict[str, list[int]] = defaultdict(list)
        for (dk2, pk), j in x.items():
            if dk2 == dk:
                by_region[by_pool[pk].region].append(j)
        v[dk] = m.var(big_region, float(k), False)
        for region, js in by_region.items():
            z[(dk, region)] = m.var(0.0, 1.0, True)
            m.row([(z[(dk, region)], 1.0)] + [(j, -1.0) for j in js], -math.inf, 0.0)
        m.row([(z[(dk, r)], 1.0) for r in by_region] + [(v[dk], 1.0)], float(k), math.inf)
    return v, z


def _seed_counts(b: _Built, by_demand, greedy: PlacementResult | None) -> tuple[dict, dict, dict]:
    """Replicas per (demand, pool) to start from, those of them already running, and the
    running ones the greedy plan preempts."""
    cur_ok, cur, x = b.cur_ok, b.cur, b.x
    # warm start: the greedy plan, else what runs now (capped at each demand's count)
    counts: dict[tuple, int] = defaultdict(int)
    kept0: dict[tuple, int] = defaultdict(int)
    evicted0: dict[tuple, int] = defaultdict(int)
    running_ids = {a.replica_id for a in cur_ok}
    if greedy is not None:
        for a in greedy.assignments:
            counts[((a.deployment, a.version), a.pool_key)] += 1
            if a.replica_id in running_ids:
                kept0[((a.deployment, a.version), a.pool_key)] += 1
        by_id = {a.replica_id: a for a in cur_ok}
        for pre in greedy.preempted:
            if pre.replica_id in by_id:
                evicted0[((pre.deployment, pre.version), by_id[pre.replica_id].pool_key)] += 1
    else:
        left = {dk: d.count for dk, d in by_demand.items()}
        for (dk, pk), n in sorted(cur.items()):
            take = min(n, left.get(dk, 0))
            if take and (dk, pk) in x:
                counts[(dk, pk)] = kept0[(dk, pk)] = take
                left[dk] -= take
    return counts, kept0, evicted0


def _warm_start(b: _Built, by_demand, greedy: PlacementResult | None) -> np.ndarray:
    """Start columns from the greedy plan, else what runs now (capped at each demand's count)."""
    m, x, y, u, moves, v, z, prio = b.m, b.x, b.y, b.u, b.moves, b.v, b.z, b.prio
    per_pool, per_demand, cur, by_pool = b.per_pool, b.per_demand, b.cur, b.by_pool
    counts, kept0, evicted0 = _seed_counts(b, by_demand, greedy)
    start = np.zeros(len(m.cost))
    for key, j in x.items():
        start[j] = counts.get(key, 0)
    for pk, j in y.items():
        p = by_pool[pk]
        used = sum(start[jx] * s for jx, s in per_pool.get(pk, []))
        start[j] = min(p.nodes, math.ceil(used / p.gpus_per_node - 1e-9))
    for dk, j in u.items():
        start[j] = by_demand[dk].count - sum(start[jx] for jx in per_demand[dk])
    priority_start(prio, start, by_demand, x, cur, kept0, evicted0)
    for (dk, pk), j in moves.items():
        kj = prio.keep.get((dk, pk), x.get((dk, pk)))
        start[j] = max(0.0, cur[(dk, pk)] - (start[kj] if kj is not None else 0))
    covered: dict[tuple, set[str]] = defaultdict(set)
    for (dk, pk), jx in x.items():
        if start[jx] > 0:
            covered[dk].add(by_pool[pk].region)
    for (dk, region), j in z.items():
        start[j] = 1.0 if region in covered[dk] else 0.0
    for dk, j in v.items():
        k = min(by_demand[dk].min_regions, by_demand[dk].count)
        start[j] = max(0.0, k - len(covered[dk]))
    return start


def _current_split(current, by_demand, by_pool) -> tuple[list[Assignment], list[str]]:
    """Current replicas that may stay (right version and shape, allowed pool, cluster not
    lost) and the ids of those that must go."""
    ok: list[Assignment] = []
    gone: list[str] = []
    seen: set[str] = set()
    for a in current:
        if a.replica_id in seen:
            continue
        seen.add(a.replica_id)
        d, p = by_demand.get((a.deployment, a.version)), by_pool.get(a.pool_key)
        if d is None or p is None or not p.keeps_existing or not d.acceptable(p) or a.gpus != d.gpu_count:
            gone.append(a.replica_id)
        else:
            ok.append(a)
    return ok, gone


_DISTANCE: Distance | None = None


def _default_distance() -> Distance:
    global _DISTANCE
    if _DISTANCE is None:
        from control_plane.geo import default_latency

        lat = default_latency()
        _DISTANCE = lambda pool, region: lat.rtt_ms(pool.region, region, provider=pool.provider)  # noqa: E731
    return _DISTANCE


register_placer(MilpPlacer.name, lambda: MilpPlacer(time_limit_s=2.0))
