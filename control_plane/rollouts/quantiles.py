"""Quantiles of latency samples, and whether a quantile is above a line beyond the noise.

A rollout's latency guard compares the canary's p90 with the baseline's over one window.
On a few dozen requests a nearest-rank p90 is one of the slowest handful, so a canary no
slower than the baseline crossed a 1.3x line in 2-20% of windows (lognormal latencies
with sigma 0.35-0.8; a busy box's cold replicas are worse). `quantile_above` says how
surprising the canary's samples above the line would be if its true quantile were at the
line: the one-sample quantile (sign) test, distribution-free, one binomial tail.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# A latency guard fails a version only when its samples above the line would be this unlikely
# were its true quantile on the line.
LATENCY_ALPHA = 0.01


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (`q` in (0, 1]); None when there are no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), summed in log space (n may be hundreds of thousands)."""
    if k <= 0:
        return 1.0
    if k > n or p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    log_p, log_q, log_n = math.log(p), math.log1p(-p), math.lgamma(n + 1)
    total = 0.0
    for i in range(k, n + 1):
        term = log_n - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q
        total += math.exp(term)
        if i > n * p and term < -40:  # past the mode the terms only shrink
            break
    return min(1.0, total)


def quantile_above(values: Sequence[float], line: float, q: float) -> tuple[int, float]:
    """(how many `values` are above `line`, the p-value of that many or more if the
    population's `q`-quantile were exactly `line`). A small p-value: the quantile is above
    the line, not just this sample's."""
    above = sum(1 for v in values if v > line)
    return above, binomial_tail(above, len(values), 1.0 - q)
