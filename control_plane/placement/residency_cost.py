"""What data residency costs a plan: the same demands placed with every deployment's
residency and with none, compared per deployment and in total. Pure; `fleetctl plan`
prints it, the tests and docs/residency.md read the same figures.

Per deployment: replicas placed and unplaced, GPUs held (GPU-hours per hour of running),
their price (each replica's share of its node, `price_per_gpu * gpus`: nodes are shared,
so a deployment's dollars are its GPUs' share) and the latency to its clients (the
demand-weighted round trip from each `demand_regions` region to the nearest region with a
replica, as the gateways' geo routing sends a request). The total's $/hour is the plan's
own (nodes bought, `evaluate.plan_cost`)."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from control_plane.placement.base import PlacementResult, PoolCapacity, ReplicaDemand
from control_plane.placement.evaluate import plan_cost
from control_plane.placement.milp import Distance, default_distance
from fleet_base.residency import describe

# RTT in ms from a pool to a client region; None when unknown.


class Side(BaseModel):
    """One deployment (or the total) under one plan."""

    model_config = ConfigDict(frozen=True)

    replicas: int
    unplaced: int
    gpus: int  # GPU-hours per hour of running
    cost_per_hour: float
    rtt_ms: float | None  # demand-weighted, to the nearest replica's region; None: unknown


class DeploymentCost(BaseModel):
    model_config = ConfigDict(frozen=True)

    deployment: str
    residency: list[str] | None  # None: no policy (the deployment shares the fleet)
    policy: Side
    none: Side
    regions: list[str]  # where the policy plan put it
    reason: str = ""  # why replicas are unplaced under the policy


class ResidencyCost(BaseModel):
    """`policy` is the plan with residency, `none` the same demands without it."""

    model_config = ConfigDict(frozen=True)

    deployments: list[DeploymentCost]
    policy: Side
    none: Side

    @property
    def extra_cost_per_hour(self) -> float:
        return round(self.policy.cost_per_hour - self.none.cost_per_hour, 4)


def without_residency(demands: Sequence[ReplicaDemand]) -> list[ReplicaDemand]:
    return [d.model_copy(update={"residency": None}) for d in demands]


def compare(
    demands: Sequence[ReplicaDemand],
    pools: Sequence[PoolCapacity],
    policy: PlacementResult,
    none: PlacementResult,
    distance: Distance | None = None,
) -> ResidencyCost:
    """Both plans side by side (`policy`: placed with residency, `none`: without)."""
    rows = []
    for d in sorted(demands, key=lambda d: d.key):
        mine = _side(d, pools, policy, distance)
        regions = sorted(
            {p.region for p in pools for a in policy.assignments if _of(a, d) and a.pool_key == p.key}
        )
        reason = next((u.reason for u in policy.unplaced if (u.deployment, u.version) == d.key), "")
        rows.append(
            DeploymentCost(
                deployment=d.deployment if d.version <= 1 else f"{d.deployment} v{d.version}",
                residency=None if d.residency is None else list(d.residency),
                policy=mine,
                none=_side(d, pools, none, distance),
                regions=regions,
                reason=reason,
            )
        )
    return ResidencyCost(
        deployments=rows, policy=_total(pools, policy, rows, True), none=_total(pools, none, rows, False)
    )


def _of(a, d: ReplicaDemand) -> bool:
    return (a.deployment, a.version) == d.key


def _side(
    d: ReplicaDemand, pools: Sequence[PoolCapacity], result: PlacementResult, distance: Distance | None
) -> Side:
    by_pool = {p.key: p for p in pools}
    placed = [a for a in result.assignments if _of(a, d) and a.pool_key in by_pool]
    missing = sum(u.missing for u in result.unplaced if (u.deployment, u.version) == d.key)
    return Side(
        replicas=len(placed),
        unplaced=missing,
        gpus=sum(a.gpus for a in placed),
        cost_per_hour=round(sum(by_pool[a.pool_key].price_per_gpu * a.gpus for a in placed), 4),
        rtt_ms=_rtt(d, [by_pool[a.pool_key] for a in placed], distance),
    )


def _rtt(d: ReplicaDemand, placed: Sequence[PoolCapacity], distance: Distance | None) -> float | None:
    """Demand-weighted RTT to the nearest region with a replica (None: no clients known,
    nothing placed, or a distance unknown)."""
    weights = {r: w for r, w in d.demand_regions.items() if w > 0}
    if not weights or not placed:
        return None
    dist = distance or default_distance()
    one_per_region = list({p.region: p for p in placed}.values())
    total = 0.0
    for client, w in weights.items():
        rtts = [r for r in (dist(p, client) for p in one_per_region) if r is not None]
        if not rtts:
            return None
        total += w * min(rtts)
    return round(total / sum(weights.values()), 1)


def _total(
    pools: Sequence[PoolCapacity], result: PlacementResult, rows: list[DeploymentCost], policy: bool
) -> Side:
    sides = [r.policy if policy else r.none for r in rows]
    weighted = [(s.rtt_ms, s.replicas) for s in sides if s.rtt_ms is not None and s.replicas]
    n = sum(w for _, w in weighted)
    return Side(
        replicas=sum(s.replicas for s in sides),
        unplaced=sum(s.unplaced for s in sides),
        gpus=sum(s.gpus for s in sides),
        cost_per_hour=round(plan_cost(pools, result.assignments), 4),
        rtt_ms=round(sum(r * w for r, w in weighted) / n, 1) if n else None,
    )


def table_rows(cost: ResidencyCost) -> list[dict[str, object]]:
    """The comparison as rows for a table: one per deployment, then the total."""

    def delta(a: float | None, b: float | None) -> str:
        if a is None or b is None:
            return "-"
        return f"{a - b:+,.2f}"

    def row(name: str, policy: str, p: Side, n: Side, where: str) -> dict[str, object]:
        return {
            "deployment": name,
            "residency": policy,
            "replicas": f"{p.replicas} / {n.replicas}",
            "unplaced": f"{p.unplaced} / {n.unplaced}",
            "GPU-h/h": f"{p.gpus} / {n.gpus}",
            "$/h": f"{p.cost_per_hour:,.2f} / {n.cost_per_hour:,.2f}",
            "Δ $/h": delta(p.cost_per_hour, n.cost_per_hour),
            "$/GPU-h": f"{_per_gpu(p)} / {_per_gpu(n)}",
            "RTT ms": f"{_ms(p.rtt_ms)} / {_ms(n.rtt_ms)}",
            "Δ RTT ms": delta(p.rtt_ms, n.rtt_ms),
            "regions": where,
        }

    out = [
        row(
            r.deployment,
            describe(r.residency),
            r.policy,
            r.none,
            ", ".join(r.regions) or "-",
        )
        for r in cost.deployments
    ]
    out.append(row("total (plan)", "", cost.policy, cost.none, ""))
    return out


def _per_gpu(side: Side) -> str:
    return f"{side.cost_per_hour / side.gpus:,.2f}" if side.gpus else "-"


def summary(cost: ResidencyCost) -> str:
    """One line: what the policy costs in dollars, GPUs and latency, and what it leaves unplaced."""
    p, n = cost.policy, cost.none
    line = (
        f"residency: {round(p.cost_per_hour, 2) - round(n.cost_per_hour, 2):+,.2f} $/hour ({p.cost_per_hour:,.2f} against "
        f"{n.cost_per_hour:,.2f} with no policy), {p.gpus - n.gpus:+d} GPU-hours per hour"
    )
    if p.rtt_ms is not None and n.rtt_ms is not None:
        line += f", {p.rtt_ms - n.rtt_ms:+.1f} ms mean RTT to clients"
    if p.unplaced > n.unplaced:
        line += (
            f"; {p.unplaced - n.unplaced} replica(s) it cannot place in the allowed jurisdictions "
            f"(the cost compares unequal plans)"
        )
    return line


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"
