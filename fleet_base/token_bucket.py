"""A token bucket, plain and clock-free (the caller passes `now`): API-key quotas at the
gateway (`agent.gateway.quota`) and the per-sender budgets of what clusters publish
(`fleet_base.intake`) are made of it.

It holds up to `capacity` units and refills continuously at `rate` per second; a cost is
taken only when it is all there. The level may go negative when a settlement charges more
than was reserved (debt, quotas only)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class TokenBucket:
    """`level` units available now, refilling at `rate`/s up to `capacity`. The level may
    go negative when a settlement charges more than was reserved (debt)."""

    capacity: float
    rate: float
    level: float
    updated: float

    @classmethod
    def full(cls, capacity: float, period_s: float, now: float) -> TokenBucket:
        return cls(capacity=capacity, rate=capacity / period_s, level=capacity, updated=now)

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def available(self, now: float) -> float:
        self.refill(now)
        return self.level

    def fits(self, cost: float, now: float) -> bool:
        return self.available(now) >= cost

    def take(self, cost: float, now: float) -> bool:
        """Take `cost` if it is there; nothing otherwise."""
        if not self.fits(cost, now):
            return False
        self.level -= cost
        return True

    def adjust(self, delta: float, now: float) -> None:
        """Settle: give back (delta > 0, never above capacity) or charge (delta < 0, may go
        into debt)."""
        self.refill(now)
        self.level = min(self.capacity, self.level + delta)

    def wait_s(self, cost: float, now: float) -> float:
        """Seconds until `cost` fits (inf when it never can: larger than the capacity)."""
        level = self.available(now)
        if level >= cost:
            return 0.0
        if cost > self.capacity or self.rate <= 0:
            return math.inf
        return (cost - level) / self.rate

    def reset_s(self, now: float) -> float:
        """Seconds until the bucket is full again (OpenAI's x-ratelimit-reset-*)."""
        level = self.available(now)
        return 0.0 if level >= self.capacity or self.rate <= 0 else (self.capacity - level) / self.rate

    def resize(self, capacity: float, period_s: float, now: float) -> None:
        """A new capacity (the limit or this cluster's share changed). Never a gift: a
        larger bucket keeps its level and grows by refill at the new rate, a smaller one
        is cut to its capacity (debt stays). So a share moving between regions never adds
        tokens to the regions' total, which keeps the bound across regions (docs/quotas.md)."""
        self.refill(now)
        self.capacity = capacity
        self.rate = capacity / period_s
        self.level = min(self.level, capacity)
