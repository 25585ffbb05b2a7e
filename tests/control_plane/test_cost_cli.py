"""`fleetctl cost`'s flags and tables, without a server: flag mistakes exit before any call,
and the tables carry every row, the total and readable small amounts."""

from __future__ import annotations

import pytest
from rich.console import Console
from typer.testing import CliRunner

from control_plane.cli import app
from control_plane.commands.cost import cost_table, money, tco_lines, tco_table


@pytest.mark.parametrize(
    ("args", "code", "reason"),
    [
        (["cost", "--tco"], 1, "needs --prices"),
        (["cost", "--prices", "prices.yaml"], 1, "--prices is for --tco"),
        (["cost", "--tco", "--prices", "prices.yaml", "--by", "team"], 1, "leave out --by"),
        (["cost", "--tco", "--prices", "/nonexistent/prices.yaml"], 1, "cannot read"),
        (["cost", "--by", "region"], 2, "region"),
    ],
)
def test_flag_mistakes_exit_before_calling(args, code, reason, monkeypatch):
    monkeypatch.setenv("FLEET_API_URL", "http://127.0.0.1:9")  # nothing is asked anyway
    res = CliRunner().invoke(app, args)
    assert res.exit_code == code, res.output
    assert reason in res.output


def _row(group: str, dollars: float) -> dict:
    return {"group": group, "gpu_hours": 0.004, "gpu_dollars": dollars, "idle_dollars": dollars / 2,
            "prompt_tokens": 1234567, "completion_tokens": 89, "utilisation": 0.25, "requests": 3,
            "dollars_per_mtok": {"prefill": 12.5, "decode": None, "total": 0.00002}}  # fmt: skip


def render(table) -> str:
    console = Console(width=200, record=True)
    console.print(table)
    return console.export_text()


def test_cost_table_has_rows_and_a_total():
    report = {"since": 0.0, "until": 3600.0, "by": "team", "hourly_dollars": 3.0,
              "rows": [_row("ml", 2.0), _row("(none)", 1.0)], "total": _row("total", 3.0)}  # fmt: skip
    text = render(cost_table(report))
    assert "cost by team" in text and "1.0 h" in text and "$3.00/h" in text
    for cell in ("ml", "(none)", "total", "1,234,567", "$12.50", "$0.0000200", "25.0%", "0.00400"):
        assert cell in text, cell
    assert "e-0" not in text  # no exponent notation


def test_tco_table_and_lines():
    report = {
        "since": 0.0, "until": 604800.0, "window_hours": 168.0, "currency": "USD",
        "rows": [{"deployment": "chat", "priced_as": "default", "api": None, "prompt_tokens": 10,
                  "completion_tokens": 20, "api_dollars": 300.0, "gpu_dollars": 250.0,
                  "idle_dollars": 100.0, "ratio": 0.8333}],
        "prompt_tokens": 10, "completion_tokens": 20, "api_dollars": 300.0, "gpu_dollars": 250.0,
        "idle_dollars": 100.0, "engineering": {"hours_per_month": 20, "hourly_dollars": 100},
        "engineering_dollars": 459.96, "fleet_dollars": 709.96, "ratio": 2.3665,
        "break_even": {"tokens_per_month": 2.5e9, "current_tokens_per_month": 1.3e8,
                       "fixed_dollars_per_month": 2435.0, "fleet_busy_dollars_per_mtok": 0.5,
                       "api_dollars_per_mtok": 1.5, "model": "linear: ...", "note": "n"},
        "warnings": [],
    }  # fmt: skip
    text = render(tco_table(report))
    for cell in ("chat", "default", "engineering", "20 h/month", "$459.96", "$709.96", "2.37x", "total"):
        assert cell in text, cell
    lines = tco_lines(report)
    assert "break-even: 2,500.0 Mtok/month" in lines[1] and "(now 130.000 Mtok/month)" in lines[1]
    assert "dearer" in lines[0] and "model: linear" in lines[2]
    report["break_even"] |= {"tokens_per_month": None, "note": "the API is cheaper per token"}
    assert tco_lines(report)[1] == "break-even: none (the API is cheaper per token)"


def test_money():
    assert [money(v) for v in (None, 0, 0.5, 1234.5, 5.94e-05)] == ["-", "$0.00", "$0.500", "$1,234.50",
                                                                     "$0.0000594"]  # fmt: skip
