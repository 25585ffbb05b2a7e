"""Total cost of ownership: the traffic of a cost report priced at a hosted API's per-token
prices (a price file the user gives) against what Fleet cost for it, GPUs plus the
engineering time that running Fleet takes, and the monthly volume where the two meet.

Pure: no database, no clock. The window is the report's; engineering is a monthly figure
pro-rated to it (a month is 365.25 / 12 days). A week is the suggested shortest window:
shorter ones see one day's traffic shape, not the week's.

Break-even model (linear): per month, Fleet costs a fixed part (engineering, plus the
GPU dollars held but idle in the window, scaled to a month) and a variable part (the busy
GPU dollars per token measured in the window); the API costs its price per token at the
window's input/output mix. Break-even tokens per month = fixed / (API $/token - Fleet's
busy $/token); none when the API's price per token is not above Fleet's busy cost per
token. Idle capacity would absorb growth before new GPUs are bought, so the model
overstates Fleet's cost above today's volume and understates it below.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from control_plane.cost.accounting import UNALLOCATED
from control_plane.cost.model import CostReport

MONTH_HOURS = 365.25 * 24 / 12  # 730.5
SUGGESTED_MIN_WINDOW_S = 7 * 86400.0
MAX_PRICE_FILE_CHARS = 256 * 1024
MAX_PRICES = 1000
MTOK = 1_000_000
MAX_PER_MTOK = 10_000.0

BREAK_EVEN_MODEL = (
    "linear: Fleet per month = fixed (engineering + GPU dollars held idle in the window, scaled "
    "to a month) + busy GPU dollars per token measured in the window x tokens; API per month = "
    "its price per token at the window's input/output mix x tokens; break-even = fixed / "
    "(API $/token - Fleet busy $/token)"
)


class ApiPrice(BaseModel):
    """A hosted API's list price for one model, in the file's currency per million tokens."""

    model_config = ConfigDict(extra="forbid")

    api: str | None = Field(None, max_length=200, description="what these prices are of")
    input_per_mtok: float = Field(ge=0, le=MAX_PER_MTOK, allow_inf_nan=False)
    output_per_mtok: float = Field(ge=0, le=MAX_PER_MTOK, allow_inf_nan=False)

    def dollars(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (prompt_tokens * self.input_per_mtok + completion_tokens * self.output_per_mtok) / MTOK


class Engineering(BaseModel):
    """People's time that running Fleet takes, per month."""

    model_config = ConfigDict(extra="forbid")

    hours_per_month: float = Field(ge=0, le=10_000, allow_inf_nan=False)
    hourly_dollars: float = Field(ge=0, le=100_000, allow_inf_nan=False)

    @property
    def monthly_dollars(self) -> float:
        return self.hours_per_month * self.hourly_dollars


class EngineeringOverride(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hours_per_month: float | None = Field(None, ge=0, le=10_000, allow_inf_nan=False)
    hourly_dollars: float | None = Field(None, ge=0, le=100_000, allow_inf_nan=False)


class PriceFile(BaseModel):
    """`prices`: a deployment's name or the model it serves -> the API price it would
    otherwise pay (a deployment's own name wins over its model's); `default` prices the rest.
    `engineering` overrides the control plane's settings for this report."""

    model_config = ConfigDict(extra="forbid")

    currency: str = Field("USD", min_length=1, max_length=16)
    prices: dict[str, ApiPrice] = Field(default_factory=dict, max_length=MAX_PRICES)
    default: ApiPrice | None = None
    engineering: EngineeringOverride | None = None

    def match(self, deployment: str, model: str | None = None) -> tuple[str, ApiPrice] | None:
        """(the entry's name, its price) for a deployment, or None if nothing prices it."""
        for name in (deployment, model):
            if name is not None and name in self.prices:
                return name, self.prices[name]
        return ("default", self.default) if self.default is not None else None

    def engineering_for(self, settings: Engineering) -> Engineering:
        override = self.engineering.model_dump(exclude_none=True) if self.engineering else {}
        return settings.model_copy(update=override)


class PriceFileError(ValueError):
    """Why a price file cannot be used; safe to show the user."""


class _NoAliases(yaml.SafeLoader):
    """YAML without anchors and aliases: a few bytes of aliases can expand to billions of
    nodes once validated."""

    def compose_node(self, parent, index):  # type: ignore[override]
        if self.check_event(yaml.AliasEvent):
            raise PriceFileError("the price file uses YAML aliases (*name); write the values out")
        return super().compose_node(parent, index)


def parse_prices(content: str | Mapping[str, Any]) -> PriceFile:
    """A price file from its text (YAML, or JSON which is YAML) or already decoded."""
    if isinstance(content, str):
        if len(content) > MAX_PRICE_FILE_CHARS:
            raise PriceFileError(f"the price file is over {MAX_PRICE_FILE_CHARS} characters")
        try:
            data = yaml.load(content, Loader=_NoAliases)  # a SafeLoader
        except yaml.YAMLError as err:
            raise PriceFileError(f"the price file is not YAML or JSON: {_first_line(err)}") from None
    else:
        data = content
    if not isinstance(data, Mapping):
        raise PriceFileError("the price file must be a mapping with `prices` and/or `default`")
    try:
        prices = PriceFile.model_validate(dict(data))
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top)"
        raise PriceFileError(f"price file: {where}: {first['msg']}") from None
    if not prices.prices and prices.default is None:
        raise PriceFileError("the price file prices nothing: give `prices` or a `default`")
    return prices


def _first_line(err: Exception) -> str:
    return " ".join(str(err).split())[:200]


class TcoRow(BaseModel):
    deployment: str
    # the price file's entry: the deployment, its model, or "default"; None: not a
    # deployment (unused reserved capacity, "(unallocated)"): on Fleet's side only
    priced_as: str | None
    api: str | None = None
    prompt_tokens: int
    completion_tokens: int
    api_dollars: float
    gpu_dollars: float
    idle_dollars: float
    ratio: float | None  # Fleet's GPU dollars / the API's dollars (None: no API dollars)


class BreakEven(BaseModel):
    tokens_per_month: float | None  # None: the API is cheaper per token at any volume
    current_tokens_per_month: float  # the window's tokens, scaled to a month
    fixed_dollars_per_month: float
    fleet_busy_dollars_per_mtok: float | None
    api_dollars_per_mtok: float | None
    model: str = BREAK_EVEN_MODEL
    note: str


class TcoReport(BaseModel):
    since: float
    until: float
    window_hours: float
    currency: str
    rows: list[TcoRow]
    unpriced: list[str]  # deployments the price file does not price: left out of both sides
    prompt_tokens: int
    completion_tokens: int
    api_dollars: float
    gpu_dollars: float
    idle_dollars: float
    engineering: Engineering
    engineering_dollars: float  # pro-rated to the window
    fleet_dollars: float  # GPU + engineering
    ratio: float | None  # fleet_dollars / api_dollars (< 1: Fleet is cheaper)
    break_even: BreakEven
    warnings: list[str]


def tco_report(
    report: CostReport,
    prices: PriceFile,
    engineering: Engineering,
    models: Mapping[str, str] | None = None,
) -> TcoReport:
    """`report` must be by deployment; `models` maps a deployment to the model it serves."""
    if report.by != "deployment":
        raise ValueError(f"a TCO report prices deployments, not {report.by}s")
    models = models or {}
    engineering = prices.engineering_for(engineering)
    hours = max(0.0, report.until - report.since) / 3600
    rows: list[TcoRow] = []
    unpriced: list[str] = []
    for row in report.rows:
        if row.group == UNALLOCATED:  # unused reserved capacity: Fleet pays it, no API would
            rows.append(
                TcoRow(
                    deployment=row.group,
                    priced_as=None,
                    prompt_tokens=row.prompt_tokens,
                    completion_tokens=row.completion_tokens,
                    api_dollars=0.0,
                    gpu_dollars=row.gpu_dollars,
                    idle_dollars=row.idle_dollars,
                    ratio=None,
                )
            )
            continue
        found = prices.match(row.group, models.get(row.group))
        if found is None:
            unpriced.append(row.group)
            continue
        name, price = found
        api = price.dollars(row.prompt_tokens, row.completion_tokens)
        rows.append(
            TcoRow(
                deployment=row.group,
                priced_as=name,
                api=price.api,
                prompt_tokens=row.prompt_tokens,
                completion_tokens=row.completion_tokens,
                api_dollars=api,
                gpu_dollars=row.gpu_dollars,
                idle_dollars=row.idle_dollars,
                ratio=row.gpu_dollars / api if api > 0 else None,
            )
        )
    api_dollars = sum(r.api_dollars for r in rows)
    gpu_dollars = sum(r.gpu_dollars for r in rows)
    idle_dollars = sum(r.idle_dollars for r in rows)
    prompt = sum(r.prompt_tokens for r in rows)
    completion = sum(r.completion_tokens for r in rows)
    engineering_dollars = engineering.monthly_dollars * hours / MONTH_HOURS
    fleet_dollars = gpu_dollars + engineering_dollars
    return TcoReport(
        since=report.since,
        until=report.until,
        window_hours=hours,
        currency=prices.currency,
        rows=rows,
        unpriced=unpriced,
        prompt_tokens=prompt,
        completion_tokens=completion,
        api_dollars=api_dollars,
        gpu_dollars=gpu_dollars,
        idle_dollars=idle_dollars,
        engineering=engineering,
        engineering_dollars=engineering_dollars,
        fleet_dollars=fleet_dollars,
        ratio=fleet_dollars / api_dollars if api_dollars > 0 else None,
        break_even=break_even(
            hours, prompt + completion, api_dollars, gpu_dollars, idle_dollars, engineering_dollars
        ),
        warnings=_warnings(report, hours, unpriced, prompt + completion),
    )


def break_even(
    hours: float,
    tokens: int,
    api_dollars: float,
    gpu_dollars: float,
    idle_dollars: float,
    engineering_dollars: float,
) -> BreakEven:
    """The linear model of the module's docstring, over a window of `hours`."""
    per_month = MONTH_HOURS / hours if hours > 0 else 0.0
    fixed = (idle_dollars + engineering_dollars) * per_month
    current = tokens * per_month
    if tokens <= 0 or hours <= 0:
        return BreakEven(
            tokens_per_month=None,
            current_tokens_per_month=current,
            fixed_dollars_per_month=fixed,
            fleet_busy_dollars_per_mtok=None,
            api_dollars_per_mtok=None,
            note="no priced tokens in the window: nothing to compare per token",
        )
    api_per_token = api_dollars / tokens
    busy_per_token = max(0.0, gpu_dollars - idle_dollars) / tokens
    common = {
        "current_tokens_per_month": current,
        "fixed_dollars_per_month": fixed,
        "fleet_busy_dollars_per_mtok": busy_per_token * MTOK,
        "api_dollars_per_mtok": api_per_token * MTOK,
    }
    if api_per_token <= busy_per_token:
        return BreakEven(
            tokens_per_month=None,
            note="the API's price per token is at or below Fleet's busy GPU cost per token: "
            "no volume makes Fleet cheaper at this utilisation",
            **common,
        )
    volume = fixed / (api_per_token - busy_per_token)
    side = "cheaper" if current >= volume else "dearer"
    return BreakEven(
        tokens_per_month=volume,
        note=f"Fleet is {side} than the API at today's volume "
        f"({current / MTOK:,.1f} Mtok/month vs break-even {volume / MTOK:,.1f} Mtok/month)",
        **common,
    )


def _warnings(report: CostReport, hours: float, unpriced: list[str], tokens: int) -> list[str]:
    out = []
    if report.until - report.since < SUGGESTED_MIN_WINDOW_S:
        out.append(
            f"the window is {hours:.1f} h; a week or more is the suggested minimum "
            "(a shorter one misses the week's traffic shape)"
        )
    if unpriced:
        out.append(f"not priced by the price file, left out of both sides: {', '.join(unpriced)}")
    if tokens == 0:
        out.append("no tokens in the window on the priced deployments")
    return out
