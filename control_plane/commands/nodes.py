"""`fleetctl nodes`: where replicas run, their health and failure record (ls, show), and an
operator's cordon or uncordon, which the cluster's agent applies (docs/health.md)."""

from __future__ import annotations

from typing import Any

import typer
from rich.table import Table

from control_plane.commands.output import OUTPUT_OPTION, OutputFormat, call, console, done, emit_json

nodes_app = typer.Typer(help="Nodes' health and failure record; cordon and uncordon.", no_args_is_help=True)

STATE_STYLE = {
    "healthy": "green",
    "remediated": "green",
    "suspect": "yellow",
    "cordoned": "red",
    "drained": "red",
    "retired": "bold red",
}


def _state(state: str) -> str:
    style = STATE_STYLE.get(state, "white")
    return f"[{style}]{state}[/{style}]"


def _gpus(row: dict) -> str:
    withheld = row.get("gpus_withheld") or []
    return f"{row['gpus']}" + (f" ({len(withheld)} withheld)" if withheld else "")


def _operator(row: dict) -> str:
    op = row.get("operator")
    if not op:
        return "-"
    return f"{op['action']} by {op['by']} {_when(op['at'])}" + (
        f": {op['reason']}" if op.get("reason") else ""
    )


def _when(value: Any) -> str:
    """An API timestamp as a person reads it: to the second, UTC."""
    return "-" if value is None else str(value)[:19].replace("T", " ")


@nodes_app.command("ls")
def nodes_ls(
    cluster: str = typer.Option(None, "--cluster", help="only this cluster's nodes"),
    state: str = typer.Option(
        None, "--state", help="only nodes in this state (healthy, suspect, cordoned, ...)"
    ),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """Every node with its state, why, its failure count and the operator's last word."""
    rows = call(lambda c: c.items("/v1/nodes", cluster=cluster, state=state))
    if output == OutputFormat.json:
        emit_json(rows)
        return
    table = Table(title="nodes", header_style="bold")
    for col in (
        "cluster",
        "node",
        "state",
        "reason",
        "failures",
        "last fault",
        "gpus",
        "cordoned by",
        "operator",
    ):
        table.add_column(col, justify="right" if col in ("failures", "gpus") else "left")
    for r in rows:
        failures = f"[red]{r['failures']}[/red]" if r["failures"] else "0"
        table.add_row(
            r["cluster"],
            r["node"],
            _state(r["state"]),
            r["reason"] or "-",
            failures,
            _when(r.get("last_fault_at")),
            _gpus(r),
            r.get("cordoned_by") or "-",
            _operator(r),
        )
    console.print(table)


@nodes_app.command("show")
def nodes_show(
    cluster: str = typer.Argument(..., help="the cluster"),
    node: str = typer.Argument(..., help="the node"),
    faults: int = typer.Option(50, "--faults", min=0, max=1000, help="how many of its latest faults"),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """One node: its state and record, and its latest faults (kind, GPU, evidence)."""
    row = call(lambda c: c.get(f"/v1/nodes/{cluster}/{node}", faults=faults))
    if output == OutputFormat.json:
        emit_json(row)
        return
    console.print(
        f"[bold]{row['cluster']}/{row['node']}[/bold]  {_state(row['state'])} since {_when(row['since'])}"
    )
    lines = {
        "reason": row["reason"] or "-",
        "failures": f"{row['failures']} (last {_when(row.get('last_fault_at'))})",
        "gpus": _gpus(row) + (f": {row['gpus_withheld']}" if row.get("gpus_withheld") else ""),
        "pool": row.get("pool") or "-",
        "cordoned by": row.get("cordoned_by") or "-",
        "operator": _operator(row),
        "nvml": row.get("nvml") or "reading",
        "reported": _when(row.get("updated_at")),
    }
    for k, v in lines.items():
        console.print(f"  {k:<12} {v}", highlight=False)
    table = Table(title=f"faults of {row['node']} (latest first)", header_style="bold")
    for col in ("at", "kind", "gpu", "replica", "deployment", "evidence"):
        table.add_column(col)
    for f in row["faults"]:
        kind = f["kind"] if f["node_fault"] else f"[dim]{f['kind']} (not the node's)[/dim]"
        gpu = "-" if f["gpu"] is None else str(f["gpu"])
        table.add_row(
            _when(f["at"]), kind, gpu, f["replica_id"] or "-", f["deployment"] or "-", f["evidence"] or "-"
        )
    console.print(table)


def _act(action: str, cluster: str, node: str, reason: str | None, output: OutputFormat) -> None:
    body = {"reason": reason} if reason else None
    row = call(lambda c: c.request("POST", f"/v1/nodes/{cluster}/{node}/{action}", json=body))
    done(row, output, f"{action} of {cluster}/{node} sent to its agent (now {row['state']})")


@nodes_app.command("cordon")
def nodes_cordon(
    cluster: str = typer.Argument(..., help="the cluster"),
    node: str = typer.Argument(..., help="the node"),
    reason: str = typer.Option(None, "--reason", help="why (kept in the record and the audit log)"),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """No new replicas on the node; its agent moves the ones there away and withholds it."""
    _act("cordon", cluster, node, reason, output)


@nodes_app.command("uncordon")
def nodes_uncordon(
    cluster: str = typer.Argument(..., help="the cluster"),
    node: str = typer.Argument(..., help="the node"),
    reason: str = typer.Option(None, "--reason", help="why (kept in the audit log)"),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """Back into service, whoever cordoned it (healthy again after a clean probe)."""
    _act("uncordon", cluster, node, reason, output)


def register(app: typer.Typer) -> None:
    app.add_typer(nodes_app, name="nodes")
