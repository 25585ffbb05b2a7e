"""What co-placing pipelines costs a plan: where each pipeline runs whole (or why it
cannot), and the same demands placed with no pipelines, compared in replicas, GPUs held
and $/hour. Pure; `fleetctl plan` prints it and the tests read the same figures."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from pydantic import BaseModel

from control_plane.placement.base import PlacementResult, PoolCapacity, ReplicaDemand
from control_plane.placement.evaluate import plan_cost
from fleet_base.pipelines import PipelineSpec


class PipelineLine(BaseModel):
    """One pipeline in the plan: the clusters holding every step, and each step's GPU
    models; `feasible` when every step's replicas are placed, else `reason` (the first
    step short and why)."""

    pipeline: str
    clusters: list[str]
    steps: dict[str, list[str]]  # step -> acceptable GPU models ([]: any)
    feasible: bool
    reason: str = ""


class Side(BaseModel):
    replicas: int
    unplaced: int
    gpus: int  # GPUs held: GPU-hours per hour
    cost_per_hour: float


class PipelineCost(BaseModel):
    pipelines: list[PipelineLine]
    together: Side  # the plan, pipelines co-placed
    apart: Side  # the same demands with no pipelines


def _side(pools: Sequence[PoolCapacity], result: PlacementResult) -> Side:
    return Side(
        replicas=len(result.assignments),
        unplaced=sum(u.missing for u in result.unplaced),
        gpus=sum(a.gpus for a in result.assignments),
        cost_per_hour=round(plan_cost(pools, result.assignments), 4),
    )


def pipeline_cost(
    pipelines: Sequence[PipelineSpec],
    demands: Sequence[ReplicaDemand],
    pools: Sequence[PoolCapacity],
    together: PlacementResult,
    apart: PlacementResult,
) -> PipelineCost:
    where: dict[str, set[str]] = defaultdict(set)
    for a in together.assignments:
        where[a.deployment].add(a.cluster)
    short = {u.deployment: u for u in together.unplaced if u.missing > 0}
    models: dict[str, list[str]] = {d.deployment: list(d.gpu_models) for d in demands}
    lines = []
    for p in pipelines:
        deps = [s.deployment for s in p.steps]
        clusters = set.intersection(*(where[d] for d in deps)) if deps else set()
        first = next((s for s in p.steps if s.deployment in short), None)
        reason = ""
        if first is not None:
            u = short[first.deployment]
            reason = f"step {first.name} ({first.deployment}): {u.missing} unplaced: {u.reason}"
        lines.append(
            PipelineLine(
                pipeline=p.name,
                clusters=sorted(clusters),
                steps={s.name: models.get(s.deployment, []) for s in p.steps},
                feasible=first is None and bool(clusters),
                reason=reason or ("" if clusters else "no step has a replica"),
            )
        )
    return PipelineCost(pipelines=lines, together=_side(pools, together), apart=_side(pools, apart))


def summary(cost: PipelineCost) -> str:
    t, a = cost.together, cost.apart
    return (
        f"co-placing pipelines: {t.cost_per_hour - a.cost_per_hour:+,.2f} $/hour ({t.cost_per_hour:,.2f} against "
        f"{a.cost_per_hour:,.2f} placed apart), GPUs held {t.gpus} against {a.gpus}, "
        f"unplaced replicas {t.unplaced} against {a.unplaced}"
    )
