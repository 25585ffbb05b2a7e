"""`fleetctl plan`: run the optimizing placer offline over catalogs and a demands file
(no server needed) and show what it would buy and what it would cost."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from pydantic import ValidationError

from control_plane.commands.output import OUTPUT_OPTION, OutputFormat, console, emit, emit_json, fail
from fleet_base.domain import Tier


def plan_command(
    catalog: list[Path] = typer.Option(..., "--catalog", help="SkyPilot-layout CSV (repeatable)"),
    demands: Path = typer.Option(..., "--demands", help="demands.json (see docs/placement.md)"),
    capacity: int = typer.Option(8, "--capacity", min=0, help="nodes that may be acquired per pool"),
    tier: list[Tier] = typer.Option(None, "--tier", help="tiers to offer (default on-demand and spot)"),
    time_limit: float = typer.Option(10.0, "--time-limit", min=0.1, help="solver seconds"),
    pipeline: list[str] = typer.Option(
        None,
        "--pipeline",
        help="NAME=STEP:DEPLOYMENT,STEP:DEPLOYMENT... steps placed together (repeatable; "
        "or `pipelines` in demands.json)",
    ),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """Plan placement offline: nodes per pool, replicas per region, $/hour, the LP bound,
    first-fit-decreasing's cost for the same input, solve time; with `running` replicas
    in demands.json, which of them the plan would preempt or replace, and why; with
    pipelines, the clusters each runs whole in (or why none can) and what that costs."""
    # Imported here: the catalog pulls in the solver (highspy, numpy), which every other
    # `fleetctl` command would otherwise pay for at start-up.
    from control_plane.catalog import CatalogError, load_catalog, offers_to_pools
    from control_plane.placement.offline import DemandsFile, plan, running_assignment

    try:
        spec = DemandsFile.model_validate(json.loads(demands.read_text()))
    except (OSError, json.JSONDecodeError) as e:
        fail(f"cannot read {demands}: {e}")
    except ValidationError as e:
        first = e.errors()[0]
        fail(f"{demands}: {'.'.join(str(p) for p in first['loc'])}: {first['msg']}")
    names = [d.name for d in spec.deployments]
    if len(set(names)) != len(names):
        fail(f"{demands}: deployment names repeat")
    pipelines = spec.pipelines + [_parse_pipeline(text) for text in pipeline or []]
    _check_pipelines(pipelines, set(names))
    pools = []
    for path in catalog:
        try:
            offers, _ = load_catalog(
                path, capacity=capacity, tiers=tuple(tier or (Tier.on_demand, Tier.spot))
            )
        except CatalogError as e:
            fail(str(e))
        pools += offers_to_pools(offers)
    if not pools:
        fail("the catalogs hold no GPU offers")
    report = plan(
        [d.demand() for d in spec.deployments],
        pools,
        time_limit_s=time_limit,
        current=running_assignment(spec.deployments, pools),
        quotas=spec.gpu_quotas(),
        pipelines=pipelines,
    )
    if output == OutputFormat.json:
        emit_json(report.model_dump())
        return
    emit(
        [line.model_dump() for line in report.nodes],
        output,
        None if any(line.jurisdiction for line in report.nodes) else _NODE_COLUMNS,
        title="nodes to acquire",
    )
    rows = [
        {"deployment": d, "regions": regions, "spot": report.spot_share.get(d, 0.0)}
        for d, regions in report.replicas_by_region.items()
    ]
    emit(rows, output, ["deployment", "regions", "spot"], title="replicas by region")
    console.print(
        f"$/hour {report.cost_per_hour:,.2f}  LP bound {report.lp_bound or 0:,.2f}"
        f"  gap {report.gap_pct if report.gap_pct is not None else '-'}%"
        f"  FFD $/hour {report.ffd_cost_per_hour:,.2f}  solve {report.solve_s:.2f}s ({report.method})",
        highlight=False,
    )
    if report.residency_cost is not None:
        _residency_table(report.residency_cost)
    if report.pipeline_cost is not None:
        _pipeline_table(report.pipeline_cost, output)
    if report.removed:
        emit(
            [r.model_dump() for r in report.removed],
            output,
            ["replica", "deployment", "priority", "pool", "action", "by", "reason"],
            title=f"running replicas preempted or replaced ({len(report.removed)} of {report.running})",
        )
    for u in report.unplaced:
        console.print(f"[yellow]{u['deployment']}: {u['missing']} unplaced: {u['reason']}[/yellow]")


_NODE_COLUMNS = ["cluster", "pool", "region", "gpu_model", "tier", "nodes", "of", "price", "replicas"]


def _residency_table(cost) -> None:
    """Each deployment with its residency against the same demands placed with no policy."""
    from rich.console import Console
    from rich.table import Table

    from control_plane.placement.residency_cost import summary, table_rows

    rows = table_rows(cost)
    table = Table(
        title="cost of residency: with policy / without (GPU-h/h: GPUs held; RTT: to the clients' regions)",
        header_style="bold",
    )
    for col in rows[0]:
        table.add_column(col, justify="left" if col in ("deployment", "residency", "regions") else "right")
    for row in rows:
        table.add_row(*[str(v) for v in row.values()])
    Console(width=max(160, console.width)).print(table)
    console.print(summary(cost), highlight=False)


def _parse_pipeline(text: str):
    """`rag=embed:emb,answer:chat` -> a PipelineSpec (steps in call order)."""
    from fleet_base.pipelines import PipelineSpec

    name, sep, rest = text.partition("=")
    steps = [part.partition(":") for part in rest.split(",") if part.strip()]
    if not sep or not steps or any(not s or not d for s, _, d in steps):
        fail(f"--pipeline {text!r}: expected NAME=STEP:DEPLOYMENT[,STEP:DEPLOYMENT...]")
    try:
        return PipelineSpec.model_validate(
            {
                "name": name.strip(),
                "steps": [{"name": s.strip(), "deployment": d.strip()} for s, _, d in steps],
            }
        )
    except ValidationError as e:
        fail(f"--pipeline {text!r}: {e.errors()[0]['msg']}")


def _check_pipelines(pipelines, deployments: set[str]) -> None:
    names = [p.name for p in pipelines]
    if len(set(names)) != len(names):
        fail(f"pipeline names repeat: {', '.join(names)}")
    for p in pipelines:
        unknown = [d for d in p.deployments if d not in deployments]
        if unknown:
            fail(f"pipeline {p.name}: no deployment {', '.join(unknown)} in the demands")


def _pipeline_table(cost, output: OutputFormat) -> None:
    """Each pipeline: the clusters holding every step, its steps' GPU models, or why not."""
    from control_plane.placement.pipeline_cost import summary

    rows = [
        {
            "pipeline": line.pipeline,
            "co-placed in": ", ".join(line.clusters) or "-",
            "steps (GPU models)": ", ".join(f"{s} ({'/'.join(m) or 'any'})" for s, m in line.steps.items()),
            "feasible": "yes" if line.feasible else "no",
            "reason": line.reason,
        }
        for line in cost.pipelines
    ]
    emit(rows, output, list(rows[0]), title="pipelines (every step in each cluster listed)")
    console.print(summary(cost), highlight=False)


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_command)
