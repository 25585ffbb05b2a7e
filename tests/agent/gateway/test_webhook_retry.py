"""The webhook retry policy, as a table of (attempt, age) -> what follows."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.gateway.batch.webhook_retry import Next, after_attempt, backoff_s
from fleet_base.batch.config import BatchConfig

CONFIG = BatchConfig(webhook_backoff_s=1.0, webhook_backoff_max_s=60.0, webhook_give_up_s=3600.0)


@pytest.mark.parametrize(
    ("ok", "attempt", "age_s", "draw", "expected"),
    [
        (True, 1, 0.0, 1.0, Next("delivered")),
        (True, 40, 9999.0, 1.0, Next("delivered")),  # late but through: delivered, not given up
        (False, 1, 0.0, 1.0, Next("retry", 1.0)),
        (False, 2, 1.0, 1.0, Next("retry", 2.0)),
        (False, 3, 3.0, 1.0, Next("retry", 4.0)),
        (False, 6, 31.0, 1.0, Next("retry", 32.0)),
        (False, 7, 63.0, 1.0, Next("retry", 60.0)),  # capped
        (False, 500, 3000.0, 1.0, Next("retry", 60.0)),  # no overflow however many attempts
        (False, 3, 3.0, 0.0, Next("retry", 2.0)),  # the draw takes up to half off
        (False, 3, 3.0, 0.5, Next("retry", 3.0)),
        (False, 90, 3590.0, 1.0, Next("retry", 10.0)),  # the last retry lands on the deadline
        (False, 91, 3600.0, 1.0, Next("give_up")),
        (False, 1, 7200.0, 1.0, Next("give_up")),  # a result already too old is not tried again
    ],
)
def test_after_attempt(ok: bool, attempt: int, age_s: float, draw: float, expected: Next) -> None:
    assert after_attempt(ok, attempt, 1000.0, 1000.0 + age_s, CONFIG, draw) == expected


@given(st.integers(1, 10_000), st.integers(1, 10_000), st.floats(0, 1))
def test_backoff_grows_and_stays_bounded(a: int, b: int, draw: float) -> None:
    low, high = sorted((a, b))
    assert backoff_s(low, CONFIG) <= backoff_s(high, CONFIG) <= CONFIG.webhook_backoff_max_s
    assert CONFIG.webhook_backoff_s / 2 <= backoff_s(low, CONFIG, draw) <= backoff_s(low, CONFIG)


def test_retries_over_a_day_are_few() -> None:
    """Walking the policy to the end: the attempts a receiver down for good sees."""
    config = BatchConfig()
    now, attempt = 0.0, 1
    while (step := after_attempt(False, attempt, 0.0, now, config)).action == "retry":
        now += step.delay_s
        attempt += 1
    assert now == config.webhook_give_up_s
    assert attempt < config.webhook_give_up_s / config.webhook_backoff_max_s + 10
