"""`fleetctl batches ls|get|cancel`: every key's batches (the OpenAI Batch API the gateways
serve; docs/batch.md), read from JetStream by the control plane."""

from __future__ import annotations

import re
from datetime import datetime, timezone

import typer
from rich.markup import escape
from rich.table import Table

from control_plane.commands.output import OUTPUT_OPTION, OutputFormat, call, console, done, emit_json, fail

batches_app = typer.Typer(
    help="Batches of every key: list, inspect, cancel (the gateways run them).", no_args_is_help=True
)

STATUS_STYLE = {
    "completed": "green",
    "in_progress": "cyan",
    "validating": "cyan",
    "finalizing": "cyan",
    "cancelling": "yellow",
    "cancelled": "yellow",
    "expired": "yellow",
    "failed": "red",
}


def batch_id(text: str) -> str:
    """ID as it may stand in the URL path (never a path like '../keys' sent elsewhere)."""
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,128}", text):
        fail(f"batch id {text!r}: expected letters, digits, '_' and '-', e.g. batch_0123abcd")
    return text


def when(epoch: int | None) -> str:
    if epoch is None:
        return "-"
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def key_of(row: dict) -> str:
    name = row.get("key_name")
    return f"{name} ({row['key_id']})" if name else row["key_id"]


def counts(row: dict) -> str:
    c = row.get("request_counts") or {}
    return f"{c.get('completed', 0)}/{c.get('failed', 0)}/{c.get('total', 0)}"


def status_of(row: dict) -> str:
    style = STATUS_STYLE.get(row["status"], "white")
    return f"[{style}]{escape(row['status'])}[/{style}]"


@batches_app.command("ls")
def batches_ls(
    status: str = typer.Option(
        None, "--status", help="only batches in this status (in_progress, completed, ...)"
    ),
    key: str = typer.Option(None, "--key", help="only this key's batches (its key id)"),
    limit: int = typer.Option(None, "--limit", min=1, help="at most this many (newest first)"),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """Every key's batches, newest first."""
    params = {k: v for k, v in {"status": status, "key_id": key}.items() if v is not None}
    rows = call(lambda c: c.items("/v1/batches", limit=limit, **params))
    if output == OutputFormat.json:
        emit_json(rows)
        return
    table = Table(title="batches", header_style="bold")
    for col in (
        "id",
        "key",
        "endpoint",
        "status",
        "done/failed/total",
        "created",
        "expires",
        "output",
        "errors",
    ):
        table.add_column(col, justify="right" if col == "done/failed/total" else "left")
    for r in rows:
        table.add_row(
            escape(r["id"]),
            escape(key_of(r)),
            escape(r["endpoint"]),
            status_of(r),
            counts(r),
            when(r.get("created_at")),
            when(r.get("expires_at")),
            escape(r.get("output_file_id") or "-"),
            escape(r.get("error_file_id") or "-"),
        )
    console.print(table)


@batches_app.command("get")
def batches_get(
    batch: str = typer.Argument(..., metavar="ID", help="the batch id"), output: OutputFormat = OUTPUT_OPTION
) -> None:
    """One batch: status and its times, line counts, files, the gateway driving it."""
    row = call(lambda c: c.get(f"/v1/batches/{batch_id(batch)}"))
    if output == OutputFormat.json:
        emit_json(row)
        return
    table = Table(title=f"batch {escape(row['id'])}", header_style="bold", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    claim = row.get("claim") or {}
    fields = [
        ("key", escape(key_of(row))),
        ("endpoint", escape(row["endpoint"])),
        ("status", status_of(row)),
        ("done/failed/total", counts(row)),
        ("input file", escape(row["input_file_id"])),
        ("output file", escape(row.get("output_file_id") or "-")),
        ("error file", escape(row.get("error_file_id") or "-")),
        ("created", when(row.get("created_at"))),
        ("expires", when(row.get("expires_at"))),
    ]
    for stage in ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled"):
        if row.get(f"{stage}_at") is not None:
            fields.append((stage.replace("_", " "), when(row[f"{stage}_at"])))
    fields += [
        ("cluster", escape(row.get("cluster") or "-")),
        ("driven by", escape(claim["holder"]) if claim else "-"),
        ("enqueued lines", str(row.get("enqueued", 0))),
    ]
    for name, value in fields:
        table.add_row(name, value)
    console.print(table)
    for err in (row.get("errors") or {}).get("data", []):
        line = f" (line {err['line']})" if err.get("line") else ""
        console.print(f"[red]{escape(err['code'])}[/red]{line}: {escape(err['message'])}", highlight=False)


@batches_app.command("cancel")
def batches_cancel(
    batch: str = typer.Argument(..., metavar="ID", help="the batch id"), output: OutputFormat = OUTPUT_OPTION
) -> None:
    """Stop dispatching the batch's lines; in-flight lines finish, then it is cancelled with
    the finished part in its output file."""
    row = call(lambda c: c.post(f"/v1/batches/{batch_id(batch)}/cancel"))
    done(row, output, f"batch {escape(row['id'])} is {status_of(row)} ({counts(row)} done/failed/total)")


def register(app: typer.Typer) -> None:
    app.add_typer(batches_app, name="batches")
    app.add_typer(batches_app, name="batch", hidden=True)
