"""`fleetctl pipeline create|ls|get|rm`: deployments that serve one request together, placed
in the same clusters (docs/pipelines.md)."""

from __future__ import annotations

import re

import typer
from rich.markup import escape
from rich.table import Table

from control_plane.commands.output import OUTPUT_OPTION, OutputFormat, call, console, done, emit_json, fail
from control_plane.commands.rollout import parse_duration
from fleet_base.domain import DEPLOYMENT_NAME_PATTERN

pipeline_app = typer.Typer(
    help="Pipelines: deployments that serve one request together, co-placed per cluster.",
    no_args_is_help=True,
)


def parse_step(text: str) -> dict[str, str]:
    """'embed=bge-small' -> {"name": "embed", "deployment": "bge-small"}."""
    name, sep, deployment = text.partition("=")
    if not sep or not name.strip() or not deployment.strip():
        fail(f"--step {text!r}: expected STEP=DEPLOYMENT, e.g. --step embed=bge-small")
    return {"name": name.strip(), "deployment": deployment.strip()}


def pipeline_name(name: str) -> str:
    """NAME as it may stand in the URL path: a pipeline's name, or a clear error (never a path
    like '../keys' sent to another route)."""
    if not re.fullmatch(DEPLOYMENT_NAME_PATTERN, name):
        fail(f"pipeline name {name!r}: expected lowercase letters, digits and '-' (at most 63), e.g. rag")
    return name


def _budget(slo_e2e_s: float | None) -> str:
    if slo_e2e_s is None:
        return "-"
    return f"{slo_e2e_s * 1000:g}ms" if slo_e2e_s < 1 else f"{slo_e2e_s:g}s"


def _chain(row: dict) -> str:
    return " -> ".join(f"{s['name']}={s['deployment']}" for s in row["steps"])


@pipeline_app.command("create")
def pipeline_create(
    name: str = typer.Argument(..., help="the pipeline's name"),
    step: list[str] = typer.Option(
        ..., "--step", help="STEP=DEPLOYMENT, in call order; repeat for each step"
    ),
    slo_e2e: str = typer.Option(
        None, "--slo-e2e", help="end-to-end latency budget the steps share (800ms, 2s)"
    ),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """Group existing deployments into a pipeline: their replicas are placed in the same
    clusters, and step-to-step calls stay in the caller's cluster."""
    body: dict = {"name": name, "steps": [parse_step(s) for s in step]}
    if slo_e2e is not None:
        body["slo_e2e_s"] = parse_duration(slo_e2e, "--slo-e2e")
    row = call(lambda c: c.post("/v1/pipelines", body))
    done(row, output, f"created pipeline {escape(row['name'])}: {escape(_chain(row))}")


@pipeline_app.command("ls")
def pipeline_ls(output: OutputFormat = OUTPUT_OPTION) -> None:
    """Every pipeline, its steps and the clusters where every step is ready."""
    rows = call(lambda c: c.items("/v1/pipelines"))
    if output == OutputFormat.json:
        emit_json(rows)
        return
    table = Table(title="pipelines", header_style="bold")
    for col in ("name", "steps", "slo e2e", "ready in", "created"):
        table.add_column(col)
    for r in rows:
        ready = ", ".join(r["ready_clusters"]) or "[yellow]none[/yellow]"
        table.add_row(
            escape(r["name"]),
            escape(_chain(r)),
            _budget(r["slo_e2e_s"]),
            ready,
            str(r["created_at"])[:19].replace("T", " "),
        )
    console.print(table)


@pipeline_app.command("get")
def pipeline_get(
    name: str = typer.Argument(..., help="the pipeline"), output: OutputFormat = OUTPUT_OPTION
) -> None:
    """The pipeline's steps and, per cluster, each step's ready replicas."""
    row = call(lambda c: c.get(f"/v1/pipelines/{pipeline_name(name)}"))
    if output == OutputFormat.json:
        emit_json(row)
        return
    console.print(
        f"[bold]{escape(row['name'])}[/bold]  {escape(_chain(row))}  (slo e2e {_budget(row['slo_e2e_s'])})",
        highlight=False,
    )
    steps = [s["name"] for s in row["steps"]]
    table = Table(title=f"readiness of {escape(row['name'])} per cluster", header_style="bold")
    for col in ("cluster", "region", "ready", *steps):
        table.add_column(escape(col), justify="right" if col in steps else "left")
    for c in row["clusters"]:
        ready = "[green]yes[/green]" if c["ready"] else "[red]no[/red]"
        counts = [str(c["steps"].get(s, 0)) if c["steps"].get(s) else "[red]0[/red]" for s in steps]
        table.add_row(escape(c["cluster"]), escape(c["region"] or "-"), ready, *counts)
    console.print(table)
    if not row["ready_clusters"]:
        console.print(
            "[yellow]no cluster has every step ready: pipeline requests cannot be served whole[/yellow]"
        )


@pipeline_app.command("rm")
def pipeline_rm(
    name: str = typer.Argument(..., help="the pipeline"), output: OutputFormat = OUTPUT_OPTION
) -> None:
    """Delete the pipeline; its deployments stay (and may be placed apart again)."""
    row = call(lambda c: c.delete(f"/v1/pipelines/{pipeline_name(name)}"))
    done(row, output, f"deleted pipeline {escape(row['name'])} (its deployments stay)")


def register(app: typer.Typer) -> None:
    app.add_typer(pipeline_app, name="pipeline")
    app.add_typer(pipeline_app, name="pipelines", hidden=True)
