"""`fleetctl budgets`: monthly dollar budgets per team (set, list, delete) through the
admin API; thresholds alert as events and metrics, a hard budget refuses the team's keys."""

from __future__ import annotations

from typing import Any

import typer
from rich.table import Table

from control_plane.commands.output import OUTPUT_OPTION, OutputFormat, call, console, done, emit_json, fail

budgets_app = typer.Typer(help="Monthly dollar budgets per team: set, list, delete.", no_args_is_help=True)


def parse_thresholds(text: str) -> list[float]:
    """Percents of the budget, "50,80,100", as fractions [0.5, 0.8, 1.0]."""
    out = []
    for part in filter(None, (p.strip().removesuffix("%") for p in text.split(","))):
        try:
            percent = float(part)
        except ValueError:
            fail(f"--thresholds {text!r}: expected percents such as 50,80,100")
        if not 0 < percent <= 100:
            fail(f"--thresholds {text!r}: each must be above 0 and at most 100 (percent)")
        out.append(percent / 100)
    if not out:
        fail(f"--thresholds {text!r}: expected percents such as 50,80,100")
    return out


@budgets_app.command("set")
def budgets_set(
    team: str = typer.Argument(..., help="the team (as given to `fleetctl keys create --team`)"),
    monthly: float = typer.Option(..., "--monthly", help="dollars per calendar month (UTC)"),
    hard: bool = typer.Option(False, "--hard/--soft", help="refuse the team's keys (429) once spent"),
    thresholds: str = typer.Option(None, "--thresholds", help="percents to alert at (default 50,80,100)"),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """Set (create or replace) a team's monthly budget; it is evaluated at once."""
    body: dict[str, Any] = {"monthly_dollars": monthly, "hard": hard}
    if thresholds is not None:
        body["thresholds"] = parse_thresholds(thresholds)
    row = call(lambda c: c.request("PUT", f"/v1/budgets/{team}", json=body))
    done(row, output, f"budget of team {row['team']}: {_budget_line(row)}")


def _budget_line(row: dict) -> str:
    kind = "hard" if row["hard"] else "soft"
    line = f"${row['monthly_dollars']:,.2f} a month ({kind}), alerts at {_percents(row['thresholds'])}"
    if row.get("spent_dollars") is not None:
        line += f"; {row['month']}: ${row['spent_dollars']:,.2f} spent ({row['used_ratio']:.0%})"
    if row.get("exhausted"):
        line += " [bold red]exhausted: the team's keys are refused[/bold red]"
    return line


def _percents(fractions: list[float]) -> str:
    return ", ".join(f"{f:.0%}" for f in fractions) or "-"


def _used_cell(row: dict) -> str:
    ratio = row.get("used_ratio")
    if ratio is None:
        return "?"
    style = "red" if ratio >= 1 else "yellow" if ratio >= 0.8 else "green"
    return f"[{style}]{ratio:.0%}[/{style}]"


@budgets_app.command("list")
def budgets_list(output: OutputFormat = OUTPUT_OPTION) -> None:
    """Every team's budget with this month's spend, used share and whether it refuses."""
    rows = call(lambda c: c.items("/v1/budgets"))
    if output == OutputFormat.json:
        emit_json(rows)
        return
    month = rows[0]["month"] if rows else ""
    table = Table(title=f"team budgets {month} (UTC)".strip(), header_style="bold")
    for col in ("team", "monthly $", "spent $", "used", "alerts at", "alerted", "hard", "refusing"):
        table.add_column(col, justify="right" if "$" in col or col == "used" else "left")
    for r in rows:
        spent = "?" if r.get("spent_dollars") is None else f"{r['spent_dollars']:,.2f}"
        table.add_row(
            r["team"],
            f"{r['monthly_dollars']:,.2f}",
            spent,
            _used_cell(r),
            _percents(r["thresholds"]),
            _percents(r["alerted"]),
            "yes" if r["hard"] else "no",
            "[bold red]yes[/bold red]" if r["exhausted"] else "no",
        )
    console.print(table)


@budgets_app.command("delete")
def budgets_delete(
    team: str = typer.Argument(..., help="the team"), output: OutputFormat = OUTPUT_OPTION
) -> None:
    """Remove a team's budget (its keys are served again if it refused them)."""
    row = call(lambda c: c.delete(f"/v1/budgets/{team}"))
    done(row, output, f"deleted the budget of team {row['team']}")


def register(app: typer.Typer) -> None:
    app.add_typer(budgets_app, name="budgets")
