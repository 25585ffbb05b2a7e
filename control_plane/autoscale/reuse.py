"""Prefix reuse as a function of the fleet's size (pure).

A fleet of n replicas caches prefixes in n replicas' KV (device and host tiers); the
gateway routes each prompt to where its prefix is, so the fleet caches about as one LRU of
their sum would (with no duplicates: a bound, reached as prefix routing concentrates each
prefix on one replica). The recent prompts' `ReuseCurve`s (`fleet_base.reuse_curve`) say
what such a cache holds of each: so a count can be judged with the prefill its own caches
would leave, not with the reuse the current fleet happens to see. More replicas cache more.
`bench/reuse_calibration.py` measures this against the simulator; the SLO policy does not
use it yet (docs/autoscaling.md, "Prefix reuse and the fleet's size")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from control_plane.autoscale.capacity import Load
from fleet_base.profile import PerfProfile
from fleet_base.reuse_curve import ReuseCurve, hit_tokens

MAX_REUSE = 0.99  # `Load.prefix_reuse` stays under 1: the last prompt token is always computed


@dataclass(frozen=True)
class FleetReuse:
    """Recent prompts (token counts) and each one's `ReuseCurve`."""

    prompts: tuple[int, ...]
    curves: tuple[ReuseCurve, ...]

    def at(self, cache_tokens: float) -> tuple[float, list[int]]:
        """(share of the prompt tokens a cache of `cache_tokens` holds, each prompt's tokens
        left to prefill)."""
        fresh = [
            max(1, p - hit_tokens(c, cache_tokens)) for p, c in zip(self.prompts, self.curves, strict=True)
        ]
        total = sum(self.prompts)
        share = 1.0 - sum(fresh) / total if total > 0 else 0.0
        return min(MAX_REUSE, max(0.0, share)), fresh


def fleet_cache_tokens(profile: PerfProfile, replicas: int) -> float:
    """KV tokens `replicas` replicas of `profile` cache prefixes in (both tiers)."""
    return float(max(0, replicas) * (profile.kv_capacity_tokens + profile.host_kv_tokens))


def at_fleet(
    load: Load, prompts: Sequence[int], reuse: FleetReuse | None, profile: PerfProfile, replicas: int
) -> tuple[Load, list[int]]:
    """The load and prompt mix `replicas` replicas would prefill: with their caches' reuse
    where the prompts' curves are known, else as given."""
    if reuse is None:
        return load, list(prompts)
    share, fresh = reuse.at(fleet_cache_tokens(profile, replicas))
    scaled = Load(load.requests_per_s, load.prompt_tokens_per_s, load.output_tokens_per_s, share)
    return scaled, fresh
