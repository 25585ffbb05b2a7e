"""The latency guard's statistics: the binomial tail against exact arithmetic, and the
guard itself over many seeded windows of heavy-tailed latencies, read against what it
must tell apart: a canary no slower than its baseline (rolled back in at most 2% of
windows) and one twice as slow (caught in most single windows of 40 requests)."""

from __future__ import annotations

import math
import random
from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.rollouts.policy import Observation, RolloutParams, VersionStats, breach
from control_plane.rollouts.quantiles import binomial_tail, percentile, quantile_above

P = RolloutParams(steps=(50, 100), max_ttft_p90_ratio=1.3, min_requests=30)


def exact_tail(k: int, n: int, p: Fraction) -> float:
    return float(sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(max(k, 0), n + 1)))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 120), k=st.integers(-2, 125), tenths=st.integers(1, 9))
def test_binomial_tail_matches_exact_arithmetic(n, k, tenths):
    got = binomial_tail(k, n, tenths / 10)
    want = exact_tail(k, n, Fraction(tenths, 10)) if k <= n else 0.0
    assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-15), (got, want)


def test_binomial_tail_of_a_large_window_neither_overflows_nor_underflows():
    assert binomial_tail(20_000, 200_000, 0.1) == 1.0 or binomial_tail(20_000, 200_000, 0.1) > 0.49
    assert binomial_tail(21_000, 200_000, 0.1) < 1e-10
    assert 0.0 <= binomial_tail(19_000, 200_000, 0.1) <= 1.0


def test_quantile_above_counts_strictly_above_the_line():
    assert quantile_above([1.0, 2.0, 3.0, 4.0], 2.0, 0.9)[0] == 2
    assert quantile_above([], 1.0, 0.9) == (0, 1.0)
    assert percentile([5.0, 1.0, 3.0], 0.9) == 5.0 and percentile([], 0.5) is None


def window(rng: random.Random, n: int, slower: float, sigma: float) -> VersionStats:
    ttfts = tuple(slower * rng.lognormvariate(math.log(0.08), sigma) for _ in range(n))
    return VersionStats(requests=n, errors=0, ttft_p90_s=percentile(ttfts, 0.9), ttft_samples_s=ttfts)


def rollback_rate(slower: float, n: int, sigma: float, windows: int = 1500) -> float:
    rng = random.Random(f"{slower}-{n}-{sigma}")
    hits = 0
    for _ in range(windows):
        canary, baseline = window(rng, n, slower, sigma), window(rng, n, 1.0, sigma)
        if breach(P, Observation(now=0.0, replicas=4, canary=canary, baseline=baseline)) is not None:
            hits += 1
    return hits / windows


def test_a_canary_no_slower_than_its_baseline_is_rarely_rolled_back():
    # the p90 alone crossed 1.3x in 3% (sigma 0.35) and 18% (sigma 0.8) of these windows
    assert rollback_rate(1.0, 40, 0.35) <= 0.01
    assert rollback_rate(1.0, 40, 0.8) <= 0.02


def test_a_canary_twice_as_slow_is_caught():
    assert rollback_rate(2.0, 40, 0.35) >= 0.9
    assert rollback_rate(2.0, 200, 0.8) >= 0.9


def test_a_breach_names_the_samples_above_the_line_and_their_p_value():
    rng = random.Random(7)
    why = breach(
        P,
        Observation(
            now=0.0, replicas=4, canary=window(rng, 60, 3.0, 0.3), baseline=window(rng, 60, 1.0, 0.3)
        ),
    )
    assert why is not None and "above" in why and "p=" in why
