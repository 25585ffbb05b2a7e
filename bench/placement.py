"""Placement benchmark on the real GCP and Azure catalogs (`../shared/data/`).

For 50, 500 and 5,000 replicas across 20 deployments with mixed constraints (GPU model
or memory, GPUs per replica, allowed regions, active-active regions, spot share, demand
regions), it prints: the MILP's $/hour against the LP-relaxation bound and against
first-fit-decreasing, the solve time, and the moves after a 10% demand change (against
the replicas that changed). With `--pipelines N`, deployments 2i and 2i+1 (i < N) are the
two steps of a pipeline, co-placed by both placers: the table adds the pipelines split
(must be 0) and the MILP's $/hour and shortfall with the same demands placed apart. It
measures; it asserts nothing.

    PYTHONPATH=. .venv/bin/python -m bench.placement [--sizes 50,500,5000] [--time-limit 4.5]
        [--pipelines N] [-o json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from control_plane.catalog import load_catalog, offers_to_pools
from control_plane.placement import FirstFitDecreasing, PoolCapacity, ReplicaDemand
from control_plane.placement.colocation import splits
from control_plane.placement.evaluate import plan_cost, violations
from control_plane.placement.milp import MilpPlacer
from fleet_base.domain import Tier
from fleet_base.pipelines import PipelineSpec, PipelineStep

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
CATALOGS = ("gcp_gpu_vms.csv", "azure_gpu_vms.csv")
EXIT_MISSING_INPUT = 2

# (gpu_models, gpus per replica, min GB per GPU) x regions x (min_regions, max spot share)
SHAPES = [
    (("H100", "H200"), 8, 0.0),
    (("A100-80GB", "H100"), 4, 0.0),
    (("A100", "A100-80GB"), 2, 0.0),
    ((), 1, 24.0),
    (("L4",), 1, 0.0),
    (("T4", "L4", "A10"), 1, 0.0),
    ((), 2, 80.0),
    (("H100",), 1, 0.0),
    ((), 8, 80.0),
    (("A10", "L4"), 2, 0.0),
]
REGIONS = [
    (),
    ("us-*",),
    ("europe-*", "*europe*", "germany*", "france*", "uk*"),
    ("asia-*", "japan*", "korea*"),
]
DEMAND_REGIONS = [{}, {"us-east4": 1.0}, {"europe-west4": 1.0, "us-east4": 1.0}, {"asia-northeast1": 1.0}]


class Row(BaseModel):
    replicas: int
    pools: int
    capacity: int
    ffd_cost: float
    ffd_unplaced: int
    milp_cost: float
    milp_unplaced: int
    lp_bound: float | None
    gap_pct: float | None
    vs_ffd_pct: float | None
    solve_s: float
    method: str
    violations: int
    changed: int
    moves: int
    ffd_moves: int
    replan_s: float
    pipelines: int = 0
    splits: int = 0  # clusters holding some steps of a pipeline but not all (MILP + FFD)
    apart_cost: float | None = None  # the MILP with no pipelines, same demands
    apart_unplaced: int | None = None


def make_pipelines(demands: list[ReplicaDemand], n: int) -> list[PipelineSpec]:
    """Deployments 2i and 2i+1 as the two steps of pipeline i."""
    return [
        PipelineSpec(
            name=f"pipe{i:02d}",
            steps=(
                PipelineStep(name="first", deployment=demands[2 * i].deployment),
                PipelineStep(name="second", deployment=demands[2 * i + 1].deployment),
            ),
        )
        for i in range(min(n, len(demands) // 2))
    ]


def load_pools(capacity: int, seed: int = 7) -> list[PoolCapacity]:
    """Both catalogs' on-demand and spot pools (`capacity` nodes each), plus reserved
    commitments on eight on-demand pools (a quarter of the nodes, at 60% of the price)."""
    pools: list[PoolCapacity] = []
    for name in CATALOGS:
        offers, _ = load_catalog(DATA / name, capacity=capacity)
        pools += offers_to_pools(offers)
    rng = random.Random(seed)
    candidates = [p for p in pools if p.tier == Tier.on_demand and p.gpu_model in ("H100", "A100-80GB", "L4")]
    for p in rng.sample(candidates, 8):
        pools.append(
            p.model_copy(
                update={
                    "name": p.name.replace("on-demand", "reserved"),
                    "tier": Tier.reserved,
                    "nodes": max(1, capacity // 4),
                    "hourly_price": round(p.hourly_price * 0.6, 5),
                }
            )
        )
    return pools


def make_demands(total: int, seed: int = 11, n: int = 20) -> list[ReplicaDemand]:
    rng = random.Random(seed)
    weights = [rng.uniform(0.5, 2.0) for _ in range(n)]
    counts = [max(1, round(total * w / sum(weights))) for w in weights]
    counts[0] += total - sum(counts)
    out = []
    for i, count in enumerate(counts):
        models, gpus, memory = SHAPES[i % len(SHAPES)]
        out.append(
            ReplicaDemand(
                deployment=f"dep{i:02d}",
                version=1,
                count=count,
                gpu_models=models,
                gpu_count=gpus,
                gpu_memory_gb=memory,
                regions=REGIONS[(i // 2) % len(REGIONS)],
                min_regions=1 + i % 3,
                max_spot_fraction=(0.0, 0.3, 0.5, 1.0)[i % 4],
                demand_regions=DEMAND_REGIONS[i % len(DEMAND_REGIONS)],
            )
        )
    return out


def change(demands: list[ReplicaDemand], share: float = 0.1, seed: int = 3) -> list[ReplicaDemand]:
    """About `share` of all replicas added or removed, spread over random deployments."""
    rng = random.Random(seed)
    budget = max(1, round(share * sum(d.count for d in demands)))
    counts = {d.deployment: d.count for d in demands}
    while budget > 0:
        d = rng.choice(demands)
        step = min(budget, max(1, round(0.2 * d.count)))
        counts[d.deployment] = max(0, counts[d.deployment] + rng.choice((-1, 1)) * step)
        budget -= step
    return [d.model_copy(update={"count": counts[d.deployment]}) for d in demands]


def _moves(before: list[ReplicaDemand], after: list[ReplicaDemand], removed: int) -> int:
    """Replicas taken away beyond those a scale-down removes."""
    old = {d.deployment: d.count for d in before}
    return removed - sum(max(0, old[d.deployment] - d.count) for d in after)


def run(size: int, time_limit_s: float, n_pipelines: int = 0) -> Row:
    capacity = max(4, size // 50)
    pools = load_pools(capacity)
    demands = make_demands(size)
    pipes = make_pipelines(demands, n_pipelines)
    ffd = FirstFitDecreasing()
    ffd_plan = ffd.place(demands, pools, pipelines=pipes)
    placer = MilpPlacer(time_limit_s=time_limit_s, mip_gap=0.005)
    plan, info = placer.solve(demands, pools, lp_bound=True, pipelines=pipes)
    changed_demands = change(demands)
    changed = sum(abs(a.count - b.count) for a, b in zip(demands, changed_demands, strict=True))
    started = time.perf_counter()
    replan = placer.place(changed_demands, pools, plan.assignments, pipelines=pipes)
    replan_s = time.perf_counter() - started
    ffd_replan = ffd.place(changed_demands, pools, ffd_plan.assignments, pipelines=pipes)
    apart_plan, apart = placer.solve(demands, pools) if pipes else (None, None)
    missing = sum(u.missing for u in plan.unplaced)
    gap = vs_ffd = None
    if info.lp_bound and not missing:
        gap = round(100 * (info.cost - info.lp_bound) / info.lp_bound, 2)
    ffd_cost = plan_cost(pools, ffd_plan.assignments)
    ffd_missing = sum(u.missing for u in ffd_plan.unplaced)
    if not missing and not ffd_missing:
        vs_ffd = round(100 * (info.cost - ffd_cost) / ffd_cost, 2)
    return Row(
        replicas=size,
        pools=len(pools),
        capacity=capacity,
        ffd_cost=round(ffd_cost, 2),
        ffd_unplaced=ffd_missing,
        milp_cost=round(info.cost, 2),
        milp_unplaced=missing,
        lp_bound=round(info.lp_bound, 2) if info.lp_bound is not None else None,
        gap_pct=gap,
        vs_ffd_pct=vs_ffd,
        solve_s=round(info.solve_s, 2),
        method=info.method,
        violations=len(violations(demands, pools, plan.assignments)),
        changed=changed,
        moves=_moves(demands, changed_demands, len(replan.removed)),
        ffd_moves=_moves(demands, changed_demands, len(ffd_replan.removed)),
        replan_s=round(replan_s, 2),
        pipelines=len(pipes),
        splits=len(splits(pipes, demands, plan.assignments))
        + len(splits(pipes, demands, ffd_plan.assignments)),
        apart_cost=round(apart.cost, 2) if apart else None,
        apart_unplaced=sum(u.missing for u in apart_plan.unplaced) if apart_plan else None,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="50,500,5000")
    ap.add_argument("--time-limit", type=float, default=4.5, help="solver seconds per plan")
    ap.add_argument("--pipelines", type=int, default=0, help="pairs of deployments co-placed as pipelines")
    ap.add_argument("-o", "--output", choices=("table", "json"), default="table")
    args = ap.parse_args(argv)
    missing = [c for c in CATALOGS if not (DATA / c).exists()]
    if missing:
        print(
            f"missing input: {', '.join(str(DATA / m) for m in missing)} (see ../shared/data/README.md)",
            file=sys.stderr,
        )
        return EXIT_MISSING_INPUT
    rows = [run(int(s), args.time_limit, args.pipelines) for s in args.sizes.split(",")]
    if args.output == "json":
        print(json.dumps([r.model_dump() for r in rows], indent=2))
        return 0
    table = Table(title="placement on the GCP + Azure catalogs, 20 deployments", header_style="bold")
    cols = [
        ("replicas", "replicas"), ("pools", "pools"), ("nodes/pool", "capacity"), ("FFD $/h", "ffd_cost"),
        ("FFD short", "ffd_unplaced"), ("MILP $/h", "milp_cost"), ("short", "milp_unplaced"), ("LP bound", "lp_bound"),
        ("vs LP %", "gap_pct"), ("vs FFD %", "vs_ffd_pct"), ("solve s", "solve_s"), ("method", "method"),
        ("violations", "violations"), ("10% change", "changed"), ("moves", "moves"), ("FFD moves", "ffd_moves"),
        ("replan s", "replan_s"),
    ]  # fmt: skip
    if args.pipelines:
        cols += [("pipelines", "pipelines"), ("splits", "splits"), ("apart $/h", "apart_cost"),
                 ("apart short", "apart_unplaced")]  # fmt: skip
    for title, _ in cols:
        table.add_column(title)
    for r in rows:
        d = r.model_dump()
        table.add_row(
            *[
                "-" if d[k] is None else (f"{d[k]:,.2f}" if isinstance(d[k], float) else str(d[k]))
                for _, k in cols
            ]
        )
    Console(width=None if sys.stdout.isatty() else 220).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
