"""`fleetctl cost`: what the fleet cost over a window per deployment, key, team or pool
(GET /v1/cost), and with `--tco --prices FILE` the same traffic priced at a hosted API's
per-token prices against Fleet's cost with the break-even volume (POST /v1/cost/tco)."""

from __future__ import annotations

import math
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from control_plane.commands.output import OUTPUT_OPTION, OutputFormat, call, console, emit_json, fail

MTOK = 1_000_000


class By(str, Enum):
    deployment = "deployment"
    key = "key"
    team = "team"
    pool = "pool"


def cost(
    since: str = typer.Option("7d", "--since", help="30m, 1h, 7d or an ISO 8601 time"),
    by: By = typer.Option(None, "--by", help="deployment (default), key, team or pool"),
    tco: bool = typer.Option(False, "--tco", help="compare with a hosted API's prices (needs --prices)"),
    prices: Path = typer.Option(
        None, "--prices", help="the price file for --tco: YAML or JSON (docs/cost.md)", dir_okay=False
    ),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """GPU-hours, dollars, idle dollars, tokens and $/Mtok (prefill, decode, total) over a window;
    `--tco --prices FILE`: Fleet against API prices, with the break-even volume."""
    if tco:
        if prices is None:
            fail("--tco needs --prices FILE (a price file: docs/cost.md, docs/examples/api-prices.yaml)")
        if by not in (None, By.deployment):
            fail("--tco compares deployments; leave out --by")
        _tco(since, prices, output)
        return
    if prices is not None:
        fail("--prices is for --tco")
    report = call(lambda c: c.get("/v1/cost", since=since, by=(by or By.deployment).value))
    if output == OutputFormat.json:
        emit_json(report)
        return
    console.print(cost_table(report))


def _tco(since: str, prices: Path, output: OutputFormat) -> None:
    try:
        text = prices.read_text()
    except (OSError, UnicodeDecodeError) as err:
        fail(f"cannot read {prices}: {err}")
    report = call(lambda c: c.post("/v1/cost/tco", {"prices": text, "since": since}))
    if output == OutputFormat.json:
        emit_json(report)
        return
    console.print(tco_table(report))
    for line in tco_lines(report):
        console.print(line, highlight=False, soft_wrap=True)


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M")


def number(value: float) -> str:
    """Two decimals from 1 up, three significant digits below (a short window's fractions
    of a cent), never in exponent notation."""
    if abs(value) >= 1 or value == 0:
        return f"{value:,.2f}"
    return f"{value:.{2 - math.floor(math.log10(abs(value)))}f}"


def money(value: float | None) -> str:
    return "-" if value is None else f"${number(value)}"


def _int(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


COST_HEADERS = ("GPU-h", "$", "idle $", "tokens\nin", "tokens\nout", "$/Mtok\nprefill", "$/Mtok\ndecode",
                "$/Mtok\ntotal", "util.")  # fmt: skip


def _cost_cells(row: dict[str, Any]) -> list[str]:
    per = row.get("dollars_per_mtok") or {}
    return [
        number(row["gpu_hours"]),
        money(row["gpu_dollars"]),
        money(row["idle_dollars"]),
        _int(row["prompt_tokens"]),
        _int(row["completion_tokens"]),
        money(per.get("prefill")),
        money(per.get("decode")),
        money(per.get("total")),
        _pct(row.get("utilisation")),
    ]


def cost_table(report: dict[str, Any]) -> Table:
    hours = (report["until"] - report["since"]) / 3600
    table = Table(
        title=f"cost by {report['by']}, {_when(report['since'])} to {_when(report['until'])} UTC "
        f"({hours:,.1f} h, {money(report['hourly_dollars'])}/h)",
        header_style="bold",
    )
    table.add_column(report["by"])
    for header in COST_HEADERS:
        table.add_column(header, justify="right")
    rows = report["rows"]
    for i, row in enumerate(rows):
        table.add_row(row["group"], *_cost_cells(row), end_section=i == len(rows) - 1)
    table.add_row("total", *_cost_cells(report["total"]), style="bold")
    return table


def tco_table(report: dict[str, Any]) -> Table:
    table = Table(
        title=f"TCO, {_when(report['since'])} to {_when(report['until'])} UTC "
        f"({report['window_hours']:,.1f} h, {report['currency']})",
        header_style="bold",
    )
    for header, justify in (("deployment", "left"), ("priced as", "left"), ("tokens\nin", "right"),
                            ("tokens\nout", "right"), ("API $", "right"), ("Fleet $", "right"),
                            ("idle $", "right"), ("Fleet\n/ API", "right")):  # fmt: skip
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    rows = report["rows"]
    for row in rows:
        table.add_row(
            row["deployment"],
            row["api"] or row["priced_as"] or "(Fleet only: unused reserved)",
            _int(row["prompt_tokens"]),
            _int(row["completion_tokens"]),
            money(row["api_dollars"]),
            money(row["gpu_dollars"]),
            money(row["idle_dollars"]),
            _ratio(row["ratio"]),
        )
    eng = report["engineering"]
    table.add_row(
        "engineering",
        f"{eng['hours_per_month']:g} h/month x {money(eng['hourly_dollars'])}/h, pro-rated",
        "", "", "", money(report["engineering_dollars"]), "", "",
        end_section=True,
    )  # fmt: skip
    table.add_row(
        "total",
        "",
        _int(report["prompt_tokens"]),
        _int(report["completion_tokens"]),
        money(report["api_dollars"]),
        money(report["fleet_dollars"]),
        money(report["idle_dollars"]),
        _ratio(report["ratio"]),
        style="bold",
    )
    return table


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}x"


def tco_lines(report: dict[str, Any]) -> list[str]:
    """The verdict, the break-even volume and its model, and any warning."""
    out = []
    ratio = report["ratio"]
    if ratio is not None:
        verdict = "cheaper" if ratio < 1 else "dearer"
        out.append(
            f"Fleet {money(report['fleet_dollars'])} vs API {money(report['api_dollars'])}: "
            f"Fleet costs {ratio:,.2f}x the API ({verdict}) over this window"
        )
    b = report["break_even"]
    if b["tokens_per_month"] is not None:
        out.append(
            f"break-even: {b['tokens_per_month'] / MTOK:,.1f} Mtok/month "
            f"(now {b['current_tokens_per_month'] / MTOK:,.3f} Mtok/month); fixed "
            f"{money(b['fixed_dollars_per_month'])}/month, Fleet busy "
            f"{money(b['fleet_busy_dollars_per_mtok'])}/Mtok vs API {money(b['api_dollars_per_mtok'])}/Mtok"
        )
    else:
        out.append(f"break-even: none ({b['note']})")
    out.append(f"[dim]model: {b['model']}[/dim]")
    out += [f"[yellow]warning:[/yellow] {w}" for w in report["warnings"]]
    return out


def register(app: typer.Typer) -> None:
    app.command("cost")(cost)
