"""The TCO report (control_plane/cost/tco.py): price files, API pricing, pro-rated
engineering and the break-even volume, against hand-computed tables."""

from __future__ import annotations

from pathlib import Path

import pytest

from control_plane.cost.model import CostReport, CostRow
from control_plane.cost.tco import (
    MONTH_HOURS,
    Engineering,
    PriceFileError,
    break_even,
    parse_prices,
    tco_report,
)

ROOT = Path(__file__).resolve().parents[2]
WEEK_S = 7 * 86400.0
ENG = Engineering(hours_per_month=20, hourly_dollars=100)  # $2,000 a month


def row(group: str, prompt: int, completion: int, gpu: float, idle: float) -> CostRow:
    return CostRow(
        group=group,
        gpu_hours=0.0,
        gpu_dollars=gpu,
        dollars_by_tier={},
        idle_dollars=idle,
        prompt_tokens=prompt,
        completion_tokens=completion,
        prefill_s=0.0,
        decode_s=0.0,
        requests=0,
        utilisation=None,
        dollars_per_mtok={"prefill": None, "decode": None, "total": None},
    )


def report(rows: list[CostRow], window_s: float = WEEK_S, by: str = "deployment") -> CostReport:
    total = row("total", sum(r.prompt_tokens for r in rows), sum(r.completion_tokens for r in rows),
                sum(r.gpu_dollars for r in rows), sum(r.idle_dollars for r in rows))  # fmt: skip
    return CostReport(
        since=1000.0, until=1000.0 + window_s, by=by, rows=rows, total=total, hourly_dollars=0.0
    )


PRICES = """
currency: USD
prices:
  chat: {api: "example A", input_per_mtok: 1.0, output_per_mtok: 4.0}
  meta-llama/Llama-3.1-8B-Instruct: {input_per_mtok: 0.2, output_per_mtok: 0.2}
default: {input_per_mtok: 0.5, output_per_mtok: 1.5}
"""


@pytest.mark.parametrize(
    ("deployment", "model", "entry"),
    [
        ("chat", "meta-llama/Llama-3.1-8B-Instruct", "chat"),  # the deployment's own name wins
        ("llama", "meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"),
        ("other", "some/model", "default"),
        ("other", None, "default"),
    ],
)
def test_price_lookup_order(deployment, model, entry):
    assert parse_prices(PRICES).match(deployment, model)[0] == entry


def test_without_a_default_an_unknown_deployment_is_unpriced_on_both_sides():
    prices = parse_prices({"prices": {"chat": {"input_per_mtok": 1, "output_per_mtok": 4}}})
    got = tco_report(
        report([row("chat", 2_000_000, 1_000_000, 10.0, 4.0), row("batch", 9, 9, 50.0, 0.0)]), prices, ENG
    )
    assert got.unpriced == ["batch"]
    assert [r.deployment for r in got.rows] == ["chat"]
    assert got.api_dollars == pytest.approx(6.0)  # 2 x $1 + 1 x $4
    assert got.gpu_dollars == pytest.approx(10.0)  # batch's $50 left out
    assert any("batch" in w for w in got.warnings)


def test_unused_reserved_capacity_is_fleet_cost_only():
    prices = parse_prices({"prices": {"chat": {"input_per_mtok": 1, "output_per_mtok": 4}}})
    got = tco_report(report([row("chat", 1_000_000, 0, 2.0, 1.0), row("(unallocated)", 0, 0, 7.0, 7.0)]),
                     prices, ENG)  # fmt: skip
    assert got.unpriced == [] and got.rows[1].priced_as is None and got.rows[1].api_dollars == 0
    assert got.gpu_dollars == pytest.approx(9.0) and got.idle_dollars == pytest.approx(8.0)
    assert got.api_dollars == pytest.approx(1.0)


def test_a_week_hand_computed():
    """Two deployments over one week; engineering $2,000/month pro-rated to 168 h."""
    prices = parse_prices(PRICES)
    rows = [
        row("chat", 100_000_000, 50_000_000, gpu=300.0, idle=200.0),  # API: 100 + 200 = $300
        row("llama", 500_000_000, 0, gpu=60.0, idle=20.0),  # model's entry: 500 x 0.2 = $100
    ]
    got = tco_report(report(rows), prices, ENG, {"llama": "meta-llama/Llama-3.1-8B-Instruct"})
    assert [(r.deployment, r.priced_as, r.api_dollars) for r in got.rows] == [
        ("chat", "chat", pytest.approx(300.0)),
        ("llama", "meta-llama/Llama-3.1-8B-Instruct", pytest.approx(100.0)),
    ]
    assert got.rows[0].ratio == pytest.approx(1.0) and got.rows[1].ratio == pytest.approx(0.6)
    assert got.window_hours == pytest.approx(168.0)
    eng = 2000 * 168 / 730.5
    assert got.engineering_dollars == pytest.approx(eng)  # $459.96
    assert got.fleet_dollars == pytest.approx(360 + eng)
    assert got.api_dollars == pytest.approx(400.0)
    assert got.ratio == pytest.approx((360 + eng) / 400)
    assert got.warnings == []  # a full week, everything priced
    b = got.break_even
    month = 730.5 / 168
    tokens = 650_000_000
    assert b.current_tokens_per_month == pytest.approx(tokens * month)
    assert b.fixed_dollars_per_month == pytest.approx((220 + eng) * month)  # idle + engineering
    busy = 140 / tokens  # (360 - 220) busy dollars
    api = 400 / tokens
    assert b.fleet_busy_dollars_per_mtok == pytest.approx(busy * 1e6)
    assert b.api_dollars_per_mtok == pytest.approx(api * 1e6)
    assert b.tokens_per_month == pytest.approx((220 + eng) * month / (api - busy))
    # Fleet costs more today (ratio > 1): the break-even volume is above today's
    assert got.ratio > 1 and b.tokens_per_month > b.current_tokens_per_month
    assert "dearer" in b.note


@pytest.mark.parametrize(
    ("tokens", "api", "gpu", "idle", "expected"),
    [
        # hours=730.5 (a month): fixed = idle + eng; volume = fixed / (api/token - busy/token)
        (1_000_000, 10.0, 4.0, 2.0, (2.0 + 100.0) / (10e-6 - 2e-6)),
        (1_000_000, 2.0, 4.0, 2.0, None),  # API per token == Fleet's busy cost: never
        (1_000_000, 1.0, 4.0, 0.0, None),  # API cheaper per token than busy GPUs
        (0, 0.0, 4.0, 4.0, None),  # no tokens: nothing per token
    ],
)
def test_break_even_table(tokens, api, gpu, idle, expected):
    b = break_even(MONTH_HOURS, tokens, api, gpu, idle, engineering_dollars=100.0)
    assert b.fixed_dollars_per_month == pytest.approx(idle + 100.0)
    if expected is None:
        assert b.tokens_per_month is None and b.note
    else:
        assert b.tokens_per_month == pytest.approx(expected)
    assert "linear" in b.model


def test_short_window_warns_and_file_overrides_engineering():
    prices = parse_prices(PRICES + "engineering: {hours_per_month: 10}\n")
    got = tco_report(report([row("chat", 1000, 1000, 1.0, 0.5)], window_s=3600), prices, ENG)
    assert got.engineering == Engineering(hours_per_month=10, hourly_dollars=100)
    assert got.engineering_dollars == pytest.approx(1000 / 730.5)
    assert any("a week or more" in w for w in got.warnings)


def test_only_deployment_reports():
    with pytest.raises(ValueError, match="deployments"):
        tco_report(report([], by="team"), parse_prices(PRICES), ENG)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("prices: [", "not YAML or JSON"),
        ("- a\n- b\n", "must be a mapping"),
        ("currency: USD\n", "prices nothing"),
        ("default: {input_per_mtok: -1, output_per_mtok: 1}\n", "default.input_per_mtok"),
        ("default: {input_per_mtok: .nan, output_per_mtok: 1}\n", "default.input_per_mtok"),
        ("default: {input_per_mtok: 1}\n", "default.output_per_mtok"),
        ("default: {input_per_mtok: 1, output_per_mtok: 1, extra: 2}\n", "default.extra"),
        ("prise: {}\n", "prise"),
        ("a: &x [1, 2]\nb: *x\n", "aliases"),
        ('{"default": {"input_per_mtok": 1, "output_per_mtok": 1}, "engineering": {"hourly_dollars": -5}}',
         "engineering.hourly_dollars"),
        ("x" * 300_000, "over"),
    ],
)  # fmt: skip
def test_bad_price_files_say_why(content, reason):
    with pytest.raises(PriceFileError, match=reason):
        parse_prices(content)


def test_the_shipped_sample_parses():
    prices = parse_prices((ROOT / "docs/examples/api-prices.yaml").read_text())
    assert prices.default is not None and prices.prices
    assert all(p.api and "example" in p.api.lower() for p in [*prices.prices.values(), prices.default])
