"""When a webhook delivery is tried again, and when it is given up (pure policy).

Exponential backoff from `BatchConfig.webhook_backoff_s`, doubling per failed attempt up to
`webhook_backoff_max_s`, each delay drawn in its upper half (`draw` in [0, 1]) so deliveries
that failed together (a receiver's outage) do not all return together; no retry is
scheduled past `webhook_give_up_s` after the result was ready, and the first attempt
failing after that gives the delivery up (the result stays retrievable regardless).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fleet_base.batch.config import BatchConfig


@dataclass(frozen=True)
class Next:
    action: Literal["delivered", "retry", "give_up"]
    delay_s: float = 0.0


def backoff_s(attempt: int, config: BatchConfig, draw: float = 1.0) -> float:
    """The wait after failed attempt `attempt` (1-based)."""
    exponent = min(max(attempt, 1) - 1, 62)
    full = min(config.webhook_backoff_s * 2.0**exponent, config.webhook_backoff_max_s)
    return full * (0.5 + 0.5 * min(max(draw, 0.0), 1.0))


def after_attempt(
    ok: bool, attempt: int, ready_at: float, now: float, config: BatchConfig, draw: float = 1.0
) -> Next:
    """What follows attempt `attempt` of a delivery whose result was ready at `ready_at`."""
    if ok:
        return Next("delivered")
    give_up_at = ready_at + config.webhook_give_up_s
    if now >= give_up_at:
        return Next("give_up")
    return Next("retry", min(backoff_s(attempt, config, draw), give_up_at - now))
