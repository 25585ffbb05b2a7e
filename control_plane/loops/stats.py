"""Counters the control loops keep about themselves, read by `GET /metrics` at scrape
time: plain numbers, so the loops stay free of any metrics library."""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

# Seconds; a reconcile is a few queries plus placement: milliseconds on a small fleet,
# seconds on a large one with the MIP placer.
RECONCILE_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class ReconcileStats:
    """Reconcile passes: how many, how many failed, and how long the successful ones took."""

    buckets: tuple[float, ...] = RECONCILE_BUCKETS
    passes: int = 0
    failures: int = 0
    seconds_sum: float = 0.0
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; last: +Inf
    last_success_at: float | None = None  # Unix seconds

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, seconds: float) -> None:
        self.passes += 1
        self.seconds_sum += seconds
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.last_success_at = time.time()

    def fail(self) -> None:
        self.failures += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus bucket pairs (`le`, cumulative count), ending with +Inf."""
        out, total = [], 0
        for bound, count in zip([*map(repr, self.buckets), "+Inf"], self.counts, strict=True):
            total += count
            out.append((bound, total))
        return out
