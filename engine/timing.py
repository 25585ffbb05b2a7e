"""A histogram of durations the engine thread records and the server's /metrics reads.

Plain Python (no Prometheus in the engine core): buckets, counts and a sum under a lock; the
server turns a snapshot into a Prometheus histogram at scrape time.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class HistogramSnapshot:
    buckets: tuple[float, ...]  # upper bounds, ascending (+Inf implied)
    counts: tuple[int, ...]  # per bucket, len(buckets) + 1 (the last is +Inf)
    total: float
    count: int


class DurationHistogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * (len(self.buckets) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        i = bisect.bisect_left(self.buckets, seconds)
        with self._lock:
            self._counts[i] += 1
            self._sum += seconds

    def snapshot(self) -> HistogramSnapshot:
        with self._lock:
            return HistogramSnapshot(self.buckets, tuple(self._counts), self._sum, sum(self._counts))
