"""How a key's token budget is split between the clusters that enforce it: the share
policy (plain and synchronous; docs/quotas.md).

Each cluster gets a floor (`min_share`, at most 1/n) so a region that starts seeing the
key's traffic is never refused outright, and the rest in proportion to its tokens in the
recent window. Shares sum to at most 1, so the gateways' buckets together hold at most the
key's budget. Small moves are not published (hysteresis), to spare the gateways churn.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from pydantic import BaseModel, Field

DIGITS = 4


class ShareSettings(BaseModel):
    interval_s: float = Field(5.0, gt=0)  # how often shares are recomputed
    window_s: float = Field(60.0, gt=0)  # the usage they follow
    min_share: float = Field(0.1, ge=0, le=1)
    min_change: float = Field(0.02, ge=0, le=1)  # smaller moves are not published


def _floor(x: float) -> float:
    return math.floor(x * 10**DIGITS + 1e-6) / 10**DIGITS


def compute_shares(
    usage: Mapping[str, float],
    clusters: Iterable[str],
    previous: Mapping[str, float],
    settings: ShareSettings,
) -> dict[str, float]:
    """cluster -> share of the key's budget; {} when one cluster (or none) enforces it."""
    names = sorted(set(clusters))
    n = len(names)
    if n <= 1:
        return {}
    same_clusters = set(previous) == set(names)
    total = sum(max(0.0, usage.get(c, 0.0)) for c in names)
    if total <= 0:
        if same_clusters:
            return dict(previous)  # no news: keep the split
        return {c: _floor(1 / n) for c in names}
    floor = min(settings.min_share, 1 / n)
    free = 1 - floor * n
    # the ratio first: free * usage underflows for subnormal usage, and the shares stop summing to 1
    shares = {c: _floor(floor + free * (max(0.0, usage.get(c, 0.0)) / total)) for c in names}
    if same_clusters and max(abs(shares[c] - previous[c]) for c in names) < settings.min_change:
        return dict(previous)
    return shares
