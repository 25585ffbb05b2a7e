"""How every fleetctl command prints: rich tables for people, `-o json` for scripts, and
one line on stderr with a non-zero exit code on error."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Sequence
from enum import Enum
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table


class OutputFormat(str, Enum):
    table = "table"
    json = "json"


OUTPUT_OPTION = typer.Option(OutputFormat.table, "--output", "-o", help="table or json")

console = Console()
err_console = Console(stderr=True)


def fail(reason: str, code: int = 1) -> NoReturn:
    """Exit with one line on stderr."""
    err_console.print(f"error: {reason}", style="red", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def emit(
    data: Any, fmt: OutputFormat, columns: Sequence[str] | None = None, title: str | None = None
) -> None:
    """Print `data` (a dict or a list of dicts) as JSON or as a table of `columns`."""
    if fmt == OutputFormat.json:
        emit_json(data)
        return
    rows: Iterable[dict] = data if isinstance(data, list) else [data]
    rows = list(rows)
    cols = list(columns or (rows[0].keys() if rows else []))
    table = Table(title=title, header_style="bold")
    for col in cols:
        table.add_column(col)
    for row in rows:
        table.add_row(*[escape(_cell(row.get(col))) for col in cols])  # data, never markup
    console.print(table)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_cell(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k}={_cell(v)}" for k, v in value.items())
    return str(value)


def show(data: Any, output: OutputFormat, columns: dict[str, str], title: str | None = None) -> None:
    """JSON as the API returned it; a table of `columns` (header -> field) otherwise,
    with timestamps shortened to what a person reads."""
    if output == OutputFormat.json:
        emit_json(data)
        return
    rows = data if isinstance(data, list) else [data]
    table = [{header: _short(row.get(key)) for header, key in columns.items()} for row in rows]
    emit(table, output, list(columns), title=title)


def done(data: Any, output: OutputFormat, line: str) -> None:
    """What a command did: JSON as the API returned it, or one line for a person."""
    if output == OutputFormat.json:
        emit_json(data)
    else:
        console.print(line)


def _short(value: Any) -> Any:
    if isinstance(value, str) and len(value) >= 19 and value[4] == "-" and value[10] == "T":
        return value[:19].replace("T", " ")
    return value


def call(fn: Callable[[Any], Any]) -> Any:
    """Run `fn(client)`, turning any API failure into one line and exit code 1."""
    from control_plane.client import ApiError, FleetClient

    try:
        with FleetClient() as client:
            return fn(client)
    except ApiError as err:
        fail(str(err))
