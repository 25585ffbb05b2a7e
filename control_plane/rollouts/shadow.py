"""The shadow phase of a rollout: the comparison of copies with their originals, and the
guards that judge it. Plain and side-effect free; `control_plane.rollouts.telemetry`
collects the samples, `control_plane.rollouts.policy.decide` applies the verdict.

A copy is paired with its original by `shadow_of` (the original's record id), so both
sides of every latency and error figure are the same requests. The new version never
answers a user while the phase runs; a breached guard stops the rollout there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from control_plane.rollouts.quantiles import LATENCY_ALPHA, percentile, quantile_above


@dataclass(frozen=True)
class Finished:
    """One finished request as the shadow comparison reads it (an original or a copy)."""

    record_id: str | None
    error: bool
    ttft_s: float | None
    itl_s: float | None
    shadow_of: str | None = None
    greedy_match: bool | None = None
    first_diff_token: int | None = None


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True)


class Pair(_Frozen):
    """A figure for the originals and their copies."""

    original: float | None = None
    copy_: float | None = Field(None, alias="copy", serialization_alias="copy")

    model_config = ConfigDict(frozen=True, populate_by_name=True)


class Greedy(_Frozen):
    compared: int = 0
    identical: int = 0
    agreement: float | None = None  # identical / compared
    first_diff_token_p50: float | None = None  # over the copies that differ


class Comparison(_Frozen):
    """Copies against their originals over the shadow window."""

    requests: int = 0  # originals of the deployment in the window
    copies: int = 0  # copies that finished (paired with an original or not)
    dropped: int = 0  # copies the share asked for that never came: requests x share - copies
    errors: Pair = Field(default_factory=Pair)  # error counts on the compared requests
    ttft_p50_s: Pair = Field(default_factory=Pair)
    ttft_p90_s: Pair = Field(default_factory=Pair)
    itl_p50_s: Pair = Field(default_factory=Pair)
    itl_p90_s: Pair = Field(default_factory=Pair)
    greedy: Greedy = Field(default_factory=Greedy)
    compared: int = 0  # copies paired with an original in the window
    # the copies' paired latencies, for the guards' significance (not part of the stored record;
    # empty: judged on the p90s alone)
    copy_ttft_s: tuple[float, ...] = Field((), exclude=True, repr=False)
    copy_itl_s: tuple[float, ...] = Field((), exclude=True, repr=False)

    def error_rates(self) -> tuple[float, float] | None:
        """(original, copy) error rates over the compared requests."""
        if not self.compared:
            return None
        return (self.errors.original or 0) / self.compared, (self.errors.copy_ or 0) / self.compared

    def as_json(self) -> dict:
        return self.model_dump(mode="json", by_alias=True)


def _pair(originals: list[float], copies: list[float], q: float) -> Pair:
    return Pair(original=_round(percentile(originals, q)), copy=_round(percentile(copies, q)))


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def compare(originals: list[Finished], copies: list[Finished], share: float) -> Comparison:
    """The comparison of `copies` with the `originals` they name (both from one window).
    Latencies: each side's distribution over the pairs where both measured it; greedy:
    the copies that say whether they matched."""
    by_id = {o.record_id: o for o in originals if o.record_id}
    pairs = [(by_id[c.shadow_of], c) for c in copies if c.shadow_of in by_id]
    ttft = [(o.ttft_s, c.ttft_s) for o, c in pairs if o.ttft_s is not None and c.ttft_s is not None]
    itl = [(o.itl_s, c.itl_s) for o, c in pairs if o.itl_s is not None and c.itl_s is not None]
    judged = [c for _, c in pairs if c.greedy_match is not None]
    identical = sum(1 for c in judged if c.greedy_match)
    diffs = [
        float(c.first_diff_token) for c in judged if not c.greedy_match and c.first_diff_token is not None
    ]
    return Comparison(
        requests=len(originals),
        copies=len(copies),
        dropped=max(0, math.floor(len(originals) * share + 1e-9) - len(copies)),
        errors=Pair(original=sum(1 for o, _ in pairs if o.error), copy=sum(1 for _, c in pairs if c.error)),
        ttft_p50_s=_pair([o for o, _ in ttft], [c for _, c in ttft], 0.5),
        ttft_p90_s=_pair([o for o, _ in ttft], [c for _, c in ttft], 0.9),
        itl_p50_s=_pair([o for o, _ in itl], [c for _, c in itl], 0.5),
        itl_p90_s=_pair([o for o, _ in itl], [c for _, c in itl], 0.9),
        greedy=Greedy(
            compared=len(judged),
            identical=identical,
            agreement=_round(identical / len(judged)) if judged else None,
            first_diff_token_p50=percentile(diffs, 0.5),
        ),
        compared=len(pairs),
        copy_ttft_s=tuple(c for _, c in ttft),
        copy_itl_s=tuple(c for _, c in itl),
    )


class ShadowGuards(_Frozen):
    """The thresholds a shadow phase is judged on (a rollout's `RolloutParams`)."""

    min_requests: int = 20
    max_error_rate_increase: float = 0.02
    max_ttft_p90_ratio: float = 1.5
    max_itl_p90_ratio: float = 1.5
    min_greedy_agreement: float = 0.9


def ratio(p: Pair) -> float | None:
    if p.original is None or p.copy_ is None or p.original <= 0:
        return None
    return p.copy_ / p.original


def verdict(guards: ShadowGuards, c: Comparison) -> tuple[bool | None, str]:
    """At the end of the phase: (True, why) proceed to the canary steps, (False, why) stop the
    rollout, (None, why) not enough compared requests yet (the phase waits for traffic)."""
    if c.compared < guards.min_requests:
        return None, f"{c.compared} of min_requests {guards.min_requests} requests compared"
    rates = c.error_rates()
    assert rates is not None
    if rates[1] - rates[0] > guards.max_error_rate_increase:
        return False, (
            f"shadow error rate {rates[1]:.3f} vs {rates[0]:.3f} on the same {c.compared} requests "
            f"(max increase {guards.max_error_rate_increase:g})"
        )
    for name, pair, limit, samples in (
        ("TTFT", c.ttft_p90_s, guards.max_ttft_p90_ratio, c.copy_ttft_s),
        ("ITL", c.itl_p90_s, guards.max_itl_p90_ratio, c.copy_itl_s),
    ):
        r = ratio(pair)
        if r is None or r <= limit:
            continue
        why = f"shadow {name} p90 {pair.copy_:.3f}s is {r:.2f}x the original's {pair.original:.3f}s (max {limit:g}x)"
        if not samples:
            return False, why
        line = limit * (pair.original or 0.0)
        above, p_value = quantile_above(samples, line, 0.9)
        if p_value < LATENCY_ALPHA:  # else a p90 over the line by chance: not a verdict
            return False, f"{why}; {above} of {len(samples)} above {line:.3f}s, p={p_value:.2g}"
    g = c.greedy
    if g.agreement is not None and g.agreement < guards.min_greedy_agreement:
        return False, (
            f"shadow greedy agreement {g.identical}/{g.compared} = {g.agreement:.3f} below "
            f"{guards.min_greedy_agreement:g} (first difference at token {g.first_diff_token_p50:g}, p50)"
            if g.first_diff_token_p50 is not None
            else f"shadow greedy agreement {g.identical}/{g.compared} = {g.agreement:.3f} below "
            f"{guards.min_greedy_agreement:g}"
        )
    agreement = "" if g.agreement is None else f", greedy agreement {g.agreement:.3f} on {g.compared}"
    return True, f"shadow guards held on {c.compared} compared requests{agreement}"
