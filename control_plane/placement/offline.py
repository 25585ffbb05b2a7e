"""`fleetctl plan` without a server: demands.json + catalogs -> a plan and its figures
(nodes per pool, replicas per region, $/hour, LP bound, FFD cost, solve time). Pure.

A deployment's `running` (replicas that run now) is placed first, by first-fit, as the
current assignment; the plan then says which of those replicas it would preempt (a
higher class takes their GPUs) or replace (scale-down, a move), and why."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

from control_plane.placement.base import (
    Assignment,
    PlacementResult,
    PoolCapacity,
    PriorityClass,
    ReplicaDemand,
)
from control_plane.placement.evaluate import nodes_used, plan_cost, violations
from control_plane.placement.ffd import FirstFitDecreasing
from control_plane.placement.milp import MilpPlacer
from control_plane.placement.pipeline import PlacementInputs, run
from control_plane.placement.pipeline_cost import PipelineCost, pipeline_cost
from control_plane.placement.quotas import ClassQuota, GpuQuotas
from control_plane.placement.residency_cost import ResidencyCost, compare, without_residency
from fleet_base.domain import Tier
from fleet_base.pipelines import PipelineSpec
from fleet_base.residency import parse_residency


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
    priority: PriorityClass = "standard"
    running: int = Field(0, ge=0, le=1_000_000)  # replicas that run now (placed first)
    residency: list[str] | None = None  # jurisdictions allowed (catalog `Jurisdiction`); None: any

    @field_validator("residency", mode="before")
    @classmethod
    def _residency(cls, value: object) -> object:
        return value if value is None else parse_residency(value)  # type: ignore[arg-type]

    def demand(self, running: bool = False) -> ReplicaDemand:
        return ReplicaDemand(
            deployment=self.name,
            version=1,
            count=self.running if running else self.replicas,
            gpu_count=self.gpus,
            gpu_models=tuple(self.gpu_models),
            gpu_memory_gb=self.gpu_memory_gb,
            regions=tuple(self.regions),
            min_regions=self.min_regions,
            max_spot_fraction=self.max_spot_fraction,
            demand_regions=self.demand_regions,
            priority=self.priority,
            residency=None if self.residency is None else tuple(self.residency),
        )


class DemandsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    deployments: list[DemandSpec] = Field(min_length=1)
    quotas: dict[PriorityClass, ClassQuota] = Field(default_factory=dict)  # GPU quotas per class
    pipelines: list[PipelineSpec] = Field(default_factory=list)  # steps placed together

    def gpu_quotas(self) -> GpuQuotas:
        return GpuQuotas(classes=self.quotas)


class RemovalLine(BaseModel):
    """A running replica the plan takes away: `action` preempt (a higher class takes its
    GPUs) or replace (scaled down, moved, or its place no longer fits)."""

    replica: str
    deployment: str
    priority: str
    pool: str
    action: str
    by: str | None = None  # the deployment (and class) a preemption makes room for
    reason: str


class PoolLine(BaseModel):
    cluster: str
    pool: str
    region: str
    jurisdiction: str = ""
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
    running: int = 0  # replicas of the current assignment (demands' `running`)
    removed: list[RemovalLine] = Field(default_factory=list)
    # With a deployment under residency: the same demands planned without any policy, compared.
    residency_cost: ResidencyCost | None = None
    # With pipelines: where each is co-placed (or why not), against the same demands without.
    pipeline_cost: PipelineCost | None = None


def plan(
    demands: Sequence[ReplicaDemand],
    pools: Sequence[PoolCapacity],
    time_limit_s: float = 10.0,
    gap: float = 0.005,
    current: Sequence[Assignment] = (),
    quotas: GpuQuotas | None = None,
    pipelines: Sequence[PipelineSpec] = (),
) -> PlanReport:
    quotas = quotas or GpuQuotas()
    placer = MilpPlacer(time_limit_s=time_limit_s, mip_gap=gap, quotas=quotas)
    inputs = PlacementInputs(
        demands=tuple(demands), pools=tuple(pools), current=tuple(current), pipelines=tuple(pipelines)
    )
    outcome = run(inputs, placer, lp_bound=True)
    result, info = outcome.result, outcome.info
    assert info is not None  # the MILP always says how it solved
    ffd = FirstFitDecreasing(quotas=quotas).place(demands, pools, current, pipelines)
    together = None
    if pipelines:
        apart = run(inputs.model_copy(update={"pipelines": ()}), placer).result
        together = pipeline_cost(pipelines, demands, pools, result, apart)
    cost = None
    if any(d.residency is not None for d in demands):
        free = without_residency(demands)
        unbound = run(inputs.model_copy(update={"demands": tuple(free)}), placer).result
        cost = compare(demands, pools, result, unbound)
    by_pool = {p.key: p for p in pools}
    used = nodes_used(pools, result.assignments)
    per_pool = Counter(a.pool_key for a in result.assignments)
    lines = [
        PoolLine(
            cluster=k[0],
            pool=k[1],
            region=by_pool[k].region,
            jurisdiction=by_pool[k].jurisdiction,
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
        # a bound on plans that place every replica: none when this one cannot (it would be
        # the shortfall penalties, not dollars)
        lp_bound=round(info.lp_bound, 4) if info.lp_bound is not None and not result.unplaced else None,
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
        running=len(current),
        removed=removals(demands, current, result),
        residency_cost=cost,
        pipeline_cost=together,
    )


def running_assignment(specs: Sequence[DemandSpec], pools: Sequence[PoolCapacity]) -> list[Assignment]:
    """Where the `running` replicas run now: first-fit, the highest class first."""
    now = [s.demand(running=True) for s in specs if s.running > 0]
    return list(FirstFitDecreasing().place(now, pools).assignments) if now else []


def removals(
    demands: Sequence[ReplicaDemand], current: Sequence[Assignment], result: PlacementResult
) -> list[RemovalLine]:
    by_demand = {d.key: d for d in demands}
    by_id = {a.replica_id: a for a in current}
    preempted = {p.replica_id: p for p in result.preempted}
    placed = Counter((a.deployment, a.version) for a in result.assignments)
    out = []
    for rid in result.removed:
        a = by_id.get(rid)
        if a is None:
            continue
        d = by_demand.get((a.deployment, a.version))
        p = preempted.get(rid)
        if p is not None:
            action, by, why = "preempt", f"{p.by_deployment} ({p.by_priority})", p.reason.rsplit("): ", 1)[-1]
        elif d is None or d.count < sum(1 for c in current if (c.deployment, c.version) == d.key):
            action, by, why = "replace", None, "scaled down"
        elif placed[d.key] >= min(d.count, sum(1 for c in current if (c.deployment, c.version) == d.key)):
            action, by, why = "replace", None, "moved: the plan starts it elsewhere (cheaper or nearer)"
        else:
            action, by, why = "replace", None, "its pool no longer holds it"
        out.append(
            RemovalLine(
                replica=rid,
                deployment=a.deployment,
                priority=d.priority if d else "-",
                pool=f"{a.cluster}/{a.pool}",
                action=action,
                by=by,
                reason=why,
            )
        )
    return sorted(out, key=lambda r: (r.action, r.deployment, r.replica))
