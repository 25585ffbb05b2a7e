"""What a cost report says: one row per group (deployment, key, team or pool) and the
total, in the pools' price currency (dollars).

`dollars_per_mtok` splits a row's GPU dollars between prefill and decode by measured
time (prefill_s vs decode_s) and divides each part by that phase's tokens (prompt tokens
for prefill, completion tokens for decode) per million; "total" is all dollars over all
tokens. None where the row has no tokens of that kind.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

GroupBy = Literal["deployment", "key", "team", "pool"]
GROUP_BYS: tuple[str, ...] = ("deployment", "key", "team", "pool")
NO_TEAM = "(none)"  # the team group of keys without a team
PHASES = ("prefill", "decode", "total")


class CostRow(BaseModel):
    """One group's share of the window's GPU dollars and the work it got for them."""

    group: str  # deployment name / key id / team ("(none)": no team) / "cluster/pool"
    gpu_hours: float = 0.0
    gpu_dollars: float = 0.0
    dollars_by_tier: dict[str, float] = Field(default_factory=dict)  # reserved / on-demand / spot
    idle_dollars: float = 0.0  # the part of gpu_dollars paid for GPUs held but not busy
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    requests: int = 0
    utilisation: float | None = None  # busy seconds / GPU-held seconds; None: no GPU held
    dollars_per_mtok: dict[str, float | None] = Field(
        default_factory=lambda: dict.fromkeys(PHASES)
    )  # "prefill", "decode", "total"


class CostReport(BaseModel):
    """Cost over [since, until) (Unix seconds), grouped `by`; `hourly_dollars` is the total
    dollars over the window's hours."""

    since: float
    until: float
    by: GroupBy
    rows: list[CostRow]
    total: CostRow
    hourly_dollars: float
