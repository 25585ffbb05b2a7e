"""Short-horizon load prediction: Holt's linear (level + trend) exponential smoothing in
continuous time, per signal. Tiny and dependency-free on purpose: the horizon is a cold
start (about a minute), where a local trend is what matters; daily cycles show up as
slow trends at that scale."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Holt:
    """Level and trend of one rate. `level_s` and `trend_s` are the smoothing time
    constants (seconds): irregular samples are weighted by the time they cover."""

    level_s: float = 10.0
    trend_s: float = 60.0
    level: float | None = None
    trend: float = 0.0
    at: float = 0.0

    def update(self, t: float, value: float) -> None:
        if self.level is None:
            self.level, self.at = value, t
            return
        dt = max(0.0, t - self.at)
        if dt == 0:
            return
        a = 1 - math.exp(-dt / self.level_s)
        b = 1 - math.exp(-dt / self.trend_s)
        prev = self.level
        self.level = a * value + (1 - a) * (prev + self.trend * dt)
        self.trend = b * (self.level - prev) / dt + (1 - b) * self.trend
        self.at = t

    def forecast(self, horizon_s: float) -> float:
        if self.level is None:
            return 0.0
        return max(0.0, self.level + self.trend * max(0.0, horizon_s))
