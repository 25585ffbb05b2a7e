"""Evenly spaced quantiles of weighted values: the one way a stream of prompt lengths is cut
down to a small sample that keeps its spread (an engine's histogram per heartbeat, the
replicas' samples per observation, the SLO policy's remembered mix)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

V = TypeVar("V")


def evenly_spaced(weighted: Iterable[tuple[V, float]], count: int) -> list[V]:
    """`count` values at the weighted quantiles (i + 1/2) / count (none without weight):
    each the first value, in the order given (sort them first), whose running weight passes
    the quantile. A value of weight w stands for w of them (a histogram's bucket, a busy
    replica's lengths); weights of zero or less are never chosen."""
    pairs = [(v, float(w)) for v, w in weighted if w > 0]
    k = count
    if k <= 0 or not pairs:
        return []
    total = sum(w for _, w in pairs)
    out: list[V] = []
    acc, j = pairs[0][1], 0
    for i in range(k):
        q = (i + 0.5) * total / k
        while acc <= q and j + 1 < len(pairs):
            j += 1
            acc += pairs[j][1]
        out.append(pairs[j][0])
    return out
