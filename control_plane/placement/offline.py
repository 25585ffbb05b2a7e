"""`fleetctl plan` without a server: demands.json + catalogs -> a plan and its figures
(nodes per pool, replicas per region, $/hour, LP bound, FFD cost, solve time). Pure."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from agent.protocol import Tier
from control_plane.placement.base import PoolCapacity, ReplicaDemand
from control_plane.placement.evaluate import nodes_used, plan_cost, violations
from control_plane.placement.ffd import FirstFitDecreasing
from control_plane.placement.milp import MilpPlacer


class DemandSpec(BaseModel):
    """One deployment in demands.json."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=63)
    replicas: int = Field(ge=0, le=1_000_000)
    gpus: int = Field(1, ge=1, le=64)
    gpu_models: list[str] = Field(default_factory=list)
    gpu_memory_gb: float = Field(0.0, ge=0)
    regions: list[str] = Field(default_factory=list)
    min_regions: int = Field(1, ge=1, le=100)
    max_spot_fraction: float = Field(1.0, ge=0, le=1)
    demand_regions: dict[str, float] = Field(default_factory=dict)

    def demand(self) -> ReplicaDemand:
        return ReplicaDemand(
            deployment=self.name,
            version=1,
            count=self.replicas,
            gpu_count=self.gpus,
            gpu_models=tuple(self.gpu_models),
            gpu_memory_gb=self.gpu_memory_gb,
            regions=tuple(self.regions),
            min_regions=self.min_regions,
            max_spot_fraction=self.max_spot_fraction,
            demand_regions=self.demand_regions,
        )


class DemandsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    deployments: list[DemandSpec] = Field(min_length=1)


class PoolLine(BaseModel):
    cluster: str
    pool: str
    region: str
    gpu_model: str
    tier: str
    nodes: int
    of: int
    price: float
    replicas: int


class PlanReport(BaseModel):
    method: str
    cost_per_hour: float
    lp_bound: float | None
    gap_pct: float | None
    ffd_cost_per_hour: float
    ffd_unplaced: int
    solve_s: float
    replicas: int
    unplaced: list[dict]
    violations: list[str]
    nodes: list[PoolLine]
    replicas_by_region: dict[str, dict[str, int]]  # deployment -> region -> replicas
    spot_share: dict[str, float]


def plan(
    demands: Sequence[ReplicaDemand],
    pools: Sequence[PoolCapacity],
    time_limit_s: float = 10.0,
    gap: float = 0.005,
) -> PlanReport:
    placer = MilpPlacer(time_limit_s=time_limit_s, mip_gap=gap)
    result, info = placer.solve(demands, pools, lp_bound=True)
    ffd = FirstFitDecreasing().place(demands, pools)
    by_pool = {p.key: p for p in pools}
    used = nodes_used(pools, result.assignments)
    per_pool = Counter(a.pool_key for a in result.assignments)
    lines = [
        PoolLine(
            cluster=k[0],
            pool=k[1],
            region=by_pool[k].region,
            gpu_model=by_pool[k].gpu_model,
            tier=by_pool[k].tier.value,
            nodes=n,
            of=by_pool[k].nodes,
            price=by_pool[k].hourly_price,
            replicas=per_pool[k],
        )
        for k, n in sorted(used.items())
    ]
    regions: dict[str, Counter] = defaultdict(Counter)
    spot: Counter = Counter()
    for a in result.assignments:
        regions[a.deployment][by_pool[a.pool_key].region] += 1
        spot[a.deployment] += by_pool[a.pool_key].tier == Tier.spot
    gap_pct = None
    if info.lp_bound and not result.unplaced:
        gap_pct = round(100 * (info.cost - info.lp_bound) / info.lp_bound, 3)
    return PlanReport(
        method=info.method,
        cost_per_hour=round(info.cost, 4),
        lp_bound=round(info.lp_bound, 4) if info.lp_bound is not None else None,
        gap_pct=gap_pct,
        ffd_cost_per_hour=round(plan_cost(pools, ffd.assignments), 4),
        ffd_unplaced=sum(u.missing for u in ffd.unplaced),
        solve_s=info.solve_s,
        replicas=len(result.assignments),
        unplaced=[u.model_dump() for u in result.unplaced],
        violations=violations(demands, pools, result.assignments),
        nodes=lines,
        replicas_by_region={d: dict(sorted(c.items())) for d, c in sorted(regions.items())},
        spot_share={d: round(spot[d] / sum(c.values()), 3) for d, c in regions.items()},
    )
