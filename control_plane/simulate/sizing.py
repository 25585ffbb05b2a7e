"""How many replicas a static deployment of a trace is provisioned for: the replicas the
capacity model (`control_plane.autoscale.capacity`, the one the SLO policy scales by) needs
to meet the TTFT and ITL targets at the trace's busiest window, as an operator would size a
fixed fleet for its peak. Not `max_replicas`: that is an autoscaling bound, and a fleet
sized to it is nearly idle, which hides every difference in how requests are placed.

The fleet is sized for Fleet as it runs: the engines cache prefixes and the gateway routes
on them, so when the trace names its prompt blocks (`hash_ids`) the model is told the share
of prompt tokens a cache would serve (`Load.prefix_reuse`). That share is estimated from the
trace itself: replayed from its start through one LRU over block ids with the whole fleet's
KV capacity (as if the replicas' caches were one, with no duplicates: the best any router
can do), each request's leading blocks already held are not prefilled. The reuse depends on
the count (more replicas hold more) and the count on the reuse, so the size is the smallest
self-consistent count: one whose own caches' reuse needs no more replicas than it. Such
counts form an upper range (a bigger fleet caches at least as much), so a bisection finds
it between the count an unbounded-size fleet's cache would need and the count with no reuse.
Traces without `hash_ids`, or sizing for least-load routing: no reuse, every prompt token
is prefilled."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent.sim.prefix_cache import PrefixCacheModel, capacity_blocks
from control_plane.autoscale.capacity import Load, ReplicaCapacity
from control_plane.autoscale.policy import AutoscaleSettings
from control_plane.autoscale.slo import meets, smallest
from control_plane.simulate.trace import TraceRequest
from fleet_base.profile import PerfProfile

PEAK_WINDOW_S = 60.0  # the autoscalers' stable window: load is judged per minute
MIX_SAMPLE = 256  # prompt lengths of a window the prediction sees (evenly spaced)


@dataclass(frozen=True)
class StaticSize:
    replicas: int
    window_start_s: float  # the busiest window (the one needing the most replicas)
    why: str
    prefix_reuse: float = 0.0  # share of that window's prompt tokens assumed served from cache


def cached_prefixes(trace: Sequence[TraceRequest], blocks: int) -> list[int]:
    """Per request, the prompt tokens an LRU of `blocks` block ids, fed the trace
    in order, already holds as leading blocks (never the last prompt token, which the
    engine always computes), as the simulated replicas count a hit."""
    cache = PrefixCacheModel(max(1, blocks))
    out = []
    for r in trace:
        if not r.hash_ids:
            out.append(0)
            continue
        hit = cache.lookup(r.hash_ids)
        cache.insert(r.hash_ids)
        out.append(max(0, min(hit * r.block_tokens, r.prompt_tokens - 1)))
    return out


def peak_size(
    trace: list[TraceRequest],
    profile: PerfProfile,
    settings: AutoscaleSettings,
    window_s: float = PEAK_WINDOW_S,
    prefix_caching: bool = True,
) -> StaticSize:
    """The most replicas any window of `window_s` (stepped by half of it) needs, within
    `min_replicas` (at least one) .. `max_replicas`; with `prefix_caching` and a trace with
    `hash_ids`, at the prefix reuse the fleet's own caches would give (module docstring)."""
    no_reuse = _peak(trace, profile, settings, window_s, None)
    block = next((r.block_tokens for r in trace if r.hash_ids), 0)
    per_replica = capacity_blocks(profile.kv_capacity_tokens, block)
    if not per_replica:
        return no_reuse
    if not prefix_caching:
        return StaticSize(
            no_reuse.replicas,
            no_reuse.window_start_s,
            f"{no_reuse.why}; no prefix reuse assumed (least-load)",
        )
    sized: dict[int, StaticSize] = {}

    def at(n: int) -> StaticSize:  # the need when the reuse is that of n replicas' caches
        if n not in sized:
            sized[n] = _peak(trace, profile, settings, window_s, cached_prefixes(trace, per_replica * n))
        return sized[n]

    lo = min(at(max(1, settings.max_replicas)).replicas, no_reuse.replicas)
    hi = no_reuse.replicas
    while lo < hi:  # the smallest n whose own caches' reuse needs at most n replicas
        mid = (lo + hi) // 2
        if at(mid).replicas <= mid:
            hi = mid
        else:
            lo = mid + 1
    size = at(hi)
    cache = f"trace hash_ids through one LRU of {hi} replicas' KV, {per_replica * hi:,} blocks"
    if size.why == f"min_replicas {size.replicas}":  # no window needs more than the floor
        why = f"{size.why} (every window fits, with prefix reuse from {cache}; {no_reuse.replicas} without reuse)"
    else:
        why = (
            f"{size.why}, with {100 * size.prefix_reuse:.1f}% of its prompt tokens from prefix caches "
            f"({cache}; {no_reuse.replicas} without reuse)"
        )
    if size.replicas < hi:
        why += f"; {size.replicas} would do at that reuse, but fewer replicas cache too little"
    return StaticSize(hi, size.window_start_s, why, size.prefix_reuse)


def _peak(
    trace: list[TraceRequest],
    profile: PerfProfile,
    settings: AutoscaleSettings,
    window_s: float,
    cached: list[int] | None,
) -> StaticSize:
    """The busiest window's need; `cached`: each request's prompt tokens found in cache
    (None: none)."""
    floor, cap_n = max(1, settings.min_replicas), max(1, settings.max_replicas)
    if not trace:
        return StaticSize(floor, 0.0, "empty trace")
    cap = ReplicaCapacity(profile)
    best = StaticSize(floor, 0.0, f"min_replicas {floor}")
    end = trace[-1].at
    lo = hi = 0
    start = 0.0
    while True:
        while lo < len(trace) and trace[lo].at < start:
            lo += 1
        hi = max(hi, lo)
        while hi < len(trace) and trace[hi].at < start + window_s:
            hi += 1
        window = trace[lo:hi]
        if window:
            span = min(window_s, max(end, 1.0))  # a trace shorter than the window: its length
            prompt = sum(r.prompt_tokens for r in window)
            hit = sum(cached[lo:hi]) if cached is not None else 0
            load = Load(
                len(window) / span,
                prompt / span,
                sum(r.output_tokens for r in window) / span,
                hit / prompt if prompt > 0 else 0.0,
            )
            step = max(1, len(window) // MIX_SAMPLE)
            # The mix's shape: what each request prefills (all of it, without reuse).
            prompts = [
                trace[i].prompt_tokens - (cached[i] if cached is not None else 0) for i in range(lo, hi, step)
            ]
            n, pred = smallest(cap, load, settings, cap_n, 1.0, prompts)
            if n > best.replicas:
                met = "meets" if meets(pred, settings) else "misses (capped at max_replicas)"
                best = StaticSize(
                    n,
                    start,
                    f"capacity model at the busiest {window_s:g} s (from {start:g} s: "
                    f"{load.requests_per_s:.2f} req/s, {load.prompt_tokens_per_s:,.0f} prompt tok/s) "
                    f"{met} TTFT {settings.slo_ttft_s:g} s / ITL {settings.slo_itl_s:g} s",
                    load.prefix_reuse,
                )
        if start + window_s >= end:
            break
        start += window_s / 2
    return best
