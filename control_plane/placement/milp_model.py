"""The placement MILP as data: a sparse row-wise model (`SparseModel`), the columns every
part of the formulation adds to it (`MilpVars`: one field per variable family, keyed by
demand, pool or class), and the solution read back from it (`MilpSolution`).

`milp.py` builds the model and solves it, `milp_priority.py` adds the priority,
preemption and quota terms, `milp_result.py` turns a solution into a placement; they
pass these objects, never loose maps."""

from __future__ import annotations

import math
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field

import highspy
import numpy as np

from control_plane.placement.base import Assignment, PoolCapacity, ReplicaDemand

Key = tuple[str, int]  # a demand: (deployment, version)
PoolKey = tuple[str, str]  # a pool: (cluster, name)
Pair = tuple[Key, PoolKey]


@dataclass
class SparseModel:
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
        h = new_highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("time_limit", max(0.05, time_limit_s))
        h.setOptionValue("mip_rel_gap", gap)
        h.setOptionValue("threads", threads)
        h.setOptionValue("random_seed", 0)
        h.passModel(lp)
        return h


_BANNER_SILENCED = False


def new_highs() -> highspy.Highs:
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


@dataclass
class MilpVars:
    """The model and every column family in it, with the inputs they index.

    x: replicas per (demand, pool); y: nodes per pool; u: shortfall per demand; moves:
    running replicas not kept per pair; ready_moves: of those, the ones that serve (beyond
    the pair's starting ones, which go first); region_short / covered: active-active (regions a
    demand is short of, a binary per (demand, region)); keep / evict: running replicas
    kept / preempted per pair; allow: a binary per (pool, rank) that lets that rank be
    preempted there; forced: running replicas of a demand that no longer fit; floor_short:
    per class the column and right-hand side of its floor row."""

    by_demand: dict[Key, ReplicaDemand]
    by_pool: dict[PoolKey, PoolCapacity]
    cur: dict[Pair, int]  # running replicas that may stay, per pair
    cur_ok: list[Assignment]  # those replicas
    removed: list[str]  # running replicas that must go whatever the solution
    serving: dict[Pair, int] = field(default_factory=dict)  # of `cur`, those reported ready
    m: SparseModel = field(default_factory=SparseModel)
    x: dict[Pair, int] = field(default_factory=dict)
    y: dict[PoolKey, int] = field(default_factory=dict)
    u: dict[Key, int] = field(default_factory=dict)
    moves: dict[Pair, int] = field(default_factory=dict)
    ready_moves: dict[Pair, int] = field(default_factory=dict)
    region_short: dict[Key, int] = field(default_factory=dict)
    covered: dict[tuple[Key, str], int] = field(default_factory=dict)
    keep: dict[Pair, int] = field(default_factory=dict)
    evict: dict[Pair, int] = field(default_factory=dict)
    allow: dict[tuple[PoolKey, int], int] = field(default_factory=dict)
    forced: dict[Key, int] = field(default_factory=dict)
    floor_short: dict[str, tuple[int, float]] = field(default_factory=dict)
    # pipelines: a binary per (group's pipelines, cluster), 1 where every step runs
    co_placed: dict[tuple[tuple[str, ...], str], int] = field(default_factory=dict)
    co_steps: dict[tuple[str, ...], tuple[str, ...]] = field(default_factory=dict)  # group -> deployments
    per_pool: dict[PoolKey, list[tuple[int, float]]] = field(default_factory=lambda: defaultdict(list))
    per_demand: dict[Key, list[int]] = field(default_factory=lambda: defaultdict(list))

    def stayable(self) -> dict[Key, int]:
        """Running replicas per demand that could stay where they are."""
        out: dict[Key, int] = defaultdict(int)
        for (dk, pk), n in self.cur.items():
            if (dk, pk) in self.x:
                out[dk] += n
        return out


@dataclass(frozen=True)
class MilpSolution:
    """What a solution says: replicas per pair (`want`), shortfall per demand, the demands
    short of regions, and running replicas kept / preempted per pair."""

    want: dict[Pair, int]
    shortfall: dict[Key, int]
    region_short: set[Key]
    keep: dict[Pair, int]
    evicted: dict[Pair, int]

    @classmethod
    def read(cls, v: MilpVars, values: np.ndarray) -> MilpSolution:
        return cls(
            want={key: round(values[j]) for key, j in v.x.items() if values[j] > 0.5},
            shortfall={dk: round(values[j]) for dk, j in v.u.items() if values[j] > 0.5},
            region_short={dk for dk, j in v.region_short.items() if values[j] > 0.5},
            keep={key: round(values[j]) for key, j in v.keep.items()},
            evicted={key: round(values[j]) for key, j in v.evict.items() if values[j] > 0.5},
        )
