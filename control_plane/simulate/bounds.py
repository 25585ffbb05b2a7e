"""The two references every routing result on a trace with block ids is read against.

- ideal reuse: the share of prompt tokens one unlimited cache, fed the whole trace in
  arrival order, already holds as leading blocks (never the last prompt token). No cache
  and no router can hit more: a replica holds a block only if an earlier request computed
  it, and the unlimited cache holds every such block.
- shared-cache bound: the same fleet (replicas, profile) under least-load routing, every
  replica reading and filling one LRU cache with the fleet's whole device and host
  capacity, hits served at device speed (no loads, no copies of a block on two replicas).
  It is what routing aims at: a router that placed every request where its prefix lives
  without unbalancing the load would come close to it. It is an LRU, not an oracle: an
  idle replica can keep a block that the shared cache, churned by the rest of the fleet,
  dropped, so on a small fleet a routing can, rarely, beat it.

Both count the requests after the warm-up, as the runs do."""

from __future__ import annotations

from collections.abc import Sequence

from control_plane.autoscale.policy import AutoscaleSettings
from control_plane.simulate.des import RunResult, Simulation
from control_plane.simulate.trace import TraceRequest
from fleet_base.profile import PerfProfile

BOUND_ROUTING = "least-load"


def has_blocks(trace: Sequence[TraceRequest]) -> bool:
    return any(r.hash_ids for r in trace)


def ideal_reuse(trace: Sequence[TraceRequest], warmup_s: float = 0.0) -> float:
    """Hit rate of one unlimited cache over the trace (module docstring)."""
    seen: set[int] = set()
    hit = prompt = 0
    for r in trace:
        n = 0
        for b in r.hash_ids:
            if b not in seen:
                break
            n += 1
        seen.update(r.hash_ids)
        if r.at >= warmup_s:
            prompt += r.prompt_tokens
            hit += max(0, min(n * r.block_tokens, r.prompt_tokens - 1))
    return hit / prompt if prompt else 0.0


def fleet_cache_blocks(trace: Sequence[TraceRequest], profile: PerfProfile, replicas: int) -> int:
    """Blocks the fleet's device and host tiers hold together."""
    block = next((r.block_tokens for r in trace if r.hash_ids), 0)
    if not block:
        return 0
    return replicas * ((profile.kv_capacity_tokens + profile.host_kv_tokens) // block)


def shared_cache_bound(
    trace: list[TraceRequest],
    profile: PerfProfile,
    settings: AutoscaleSettings,
    replicas: int,
    *,
    tick_s: float = 2.0,
    warmup_s: float = 0.0,
) -> RunResult:
    """A static run of `replicas` under least-load over one shared cache (module docstring)."""
    s = settings.model_copy(
        update={"max_replicas": replicas, "min_replicas": min(settings.min_replicas, replicas)}
    )
    run = Simulation(
        trace,
        profile,
        s,
        "static",
        tick_s=tick_s,
        initial_replicas=replicas,
        warmup_s=warmup_s,
        routing=BOUND_ROUTING,
        shared_cache_blocks=max(1, fleet_cache_blocks(trace, profile, replicas)),
    ).run()
    run.policy = "shared-cache bound"
    return run
