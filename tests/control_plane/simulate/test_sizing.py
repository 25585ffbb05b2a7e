"""Static sizing: a static deployment run alone gets the replicas the capacity model needs
at the trace's busiest minute, not `max_replicas`, at the prefix reuse the trace's block
ids give through the fleet's own KV capacity."""

from __future__ import annotations

import pytest

from control_plane.autoscale import AutoscaleSettings
from control_plane.autoscale.capacity import Load, ReplicaCapacity
from control_plane.autoscale.slo import meets
from control_plane.simulate import compare
from control_plane.simulate.sizing import cached_prefixes, peak_size
from control_plane.simulate.trace import TraceRequest
from fleet_base.profile import PerfProfile

PROFILE = PerfProfile(
    name="t",
    prefill_tokens=[100.0, 2000.0],
    prefill_s=[0.02, 0.4],
    decode_batch=[1.0, 16.0],
    decode_step_s=[0.01, 0.02],
    kv_capacity_tokens=200_000,
    max_num_seqs=16,
)
SETTINGS = AutoscaleSettings(min_replicas=1, max_replicas=50, target_concurrency=8)


def steady(rate: float, seconds: float, start: float = 0.0, prompt: int = 1500) -> list[TraceRequest]:
    return [TraceRequest(start + i / rate, prompt, 40) for i in range(int(rate * seconds))]


def test_sized_for_the_busiest_minute_and_no_fewer() -> None:
    quiet = peak_size(steady(2.0, 600), PROFILE, SETTINGS)
    burst = steady(2.0, 300) + steady(12.0, 120, start=300) + steady(2.0, 300, start=420)
    peak = peak_size(burst, PROFILE, SETTINGS)
    assert 1 <= quiet.replicas < peak.replicas < SETTINGS.max_replicas
    assert 240 <= peak.window_start_s <= 420 and "busiest 60 s" in peak.why and "meets" in peak.why
    # At the burst's load the count meets the targets and one replica fewer does not.
    window = [r for r in burst if 330 <= r.at < 390]
    load = Load(
        len(window) / 60, sum(r.prompt_tokens for r in window) / 60, sum(r.output_tokens for r in window) / 60
    )
    cap = ReplicaCapacity(PROFILE)
    predict = lambda n: cap.predict(load, n, 1.0, [r.prompt_tokens for r in window], SETTINGS.slo_ttft_s)  # noqa: E731
    assert meets(predict(peak.replicas), SETTINGS) and not meets(predict(peak.replicas - 1), SETTINGS)


def test_bounded_by_min_and_max_replicas() -> None:
    heavy = steady(40.0, 120)
    capped = peak_size(heavy, PROFILE, SETTINGS.model_copy(update={"max_replicas": 3}))
    assert capped.replicas == 3 and "capped" in capped.why
    floor = peak_size(steady(0.1, 120), PROFILE, SETTINGS.model_copy(update={"min_replicas": 5}))
    assert floor.replicas == 5
    assert peak_size([], PROFILE, SETTINGS).replicas == 1


def test_static_alone_runs_at_the_sized_count_for_every_routing() -> None:
    trace = steady(2.0, 200) + steady(10.0, 60, start=200) + steady(2.0, 100, start=260)
    size = peak_size(trace, PROFILE, SETTINGS)
    rep = compare(
        trace, PROFILE, SETTINGS, policies=("static",), routings=("least-load", "prefix"), warmup_s=0
    )
    assert rep.static_replicas == size.replicas < SETTINGS.max_replicas
    assert rep.static_sizing == size.why
    assert [(p.routing, p.replicas_max) for p in rep.policies] == [
        ("least-load", size.replicas),
        ("prefix", size.replicas),
    ]
    fixed = compare(trace, PROFILE, SETTINGS, policies=("static",), static_replicas=7, warmup_s=0)
    assert fixed.static_replicas == 7 and fixed.static_sizing == "--replicas"
    assert fixed.policies[0].replicas_max == 7


def families(rate: float, seconds: float, start: float = 0.0, n_families: int = 8) -> list[TraceRequest]:
    """Requests sharing one of a few long prefixes (3 blocks of 512 tokens) plus a block of
    their own: a system prompt or document many requests repeat."""
    out = []
    for i in range(int(rate * seconds)):
        f = i % n_families
        own = 1_000_000 + int(start * 1000) + i  # a block id no other request has
        out.append(TraceRequest(start + i / rate, 4 * 512, 40, (3 * f, 3 * f + 1, 3 * f + 2, own), 512))
    return out


def test_cached_prefixes_are_the_leading_blocks_an_lru_of_that_size_holds() -> None:
    trace = [
        TraceRequest(0.0, 1024, 1, (1, 2), 512),
        TraceRequest(1.0, 1536, 1, (1, 2, 3), 512),  # 1 and 2 held: 1024 tokens
        TraceRequest(2.0, 1024, 1, (1, 2), 512),  # all held: the last token is computed anyway
        TraceRequest(3.0, 512, 1),  # no block ids: nothing
        TraceRequest(4.0, 1024, 1, (4, 5), 512),
        TraceRequest(5.0, 1024, 1, (1, 2), 512),
    ]
    assert cached_prefixes(trace, 100) == [0, 1024, 1023, 0, 0, 1023]
    # 4, 5 pushed out 3 and 2 (tails go first), the head 1 stays
    assert cached_prefixes(trace, 3) == [0, 1024, 1023, 0, 0, 512]


def test_sizing_with_prefix_reuse_equals_the_old_sizing_where_nothing_repeats() -> None:
    burst = steady(2.0, 120) + steady(12.0, 120, start=120)
    plain = peak_size(burst, PROFILE, SETTINGS)
    assert plain.prefix_reuse == 0.0 and "prefix" not in plain.why  # no hash_ids: as before
    unique = [TraceRequest(r.at, r.prompt_tokens, r.output_tokens, (i,), 512) for i, r in enumerate(burst)]
    size = peak_size(unique, PROFILE, SETTINGS)
    assert (size.replicas, size.window_start_s, size.prefix_reuse) == (
        plain.replicas,
        plain.window_start_s,
        0.0,
    )
    assert size.why.startswith(plain.why) and "with 0.0% of its prompt tokens from prefix caches" in size.why


def test_heavy_prefix_reuse_sizes_fewer_replicas_at_a_self_consistent_count() -> None:
    trace = families(2.0, 120) + families(12.0, 120, start=120)
    off = peak_size(trace, PROFILE, SETTINGS, prefix_caching=False)
    plain = peak_size(
        [TraceRequest(r.at, r.prompt_tokens, r.output_tokens) for r in trace], PROFILE, SETTINGS
    )
    assert off.replicas == plain.replicas and "no prefix reuse assumed" in off.why
    on = peak_size(trace, PROFILE, SETTINGS)
    assert 1 <= on.replicas < plain.replicas
    assert 0.6 < on.prefix_reuse <= 0.75 and f"LRU of {on.replicas} replicas' KV" in on.why
    # The reuse assumed is what an LRU of exactly that fleet's KV gives in the busiest window.
    blocks = PROFILE.kv_capacity_tokens // 512 * on.replicas
    hits = cached_prefixes(trace, blocks)
    window = [i for i, r in enumerate(trace) if on.window_start_s <= r.at < on.window_start_s + 60]
    reuse = sum(hits[i] for i in window) / sum(trace[i].prompt_tokens for i in window)
    assert on.prefix_reuse == pytest.approx(reuse)


def test_prefix_reuse_sizing_stays_within_min_and_max_replicas() -> None:
    trace = families(2.0, 60) + families(60.0, 60, start=60)
    capped = peak_size(trace, PROFILE, SETTINGS.model_copy(update={"max_replicas": 2}))
    assert capped.replicas == 2 and "capped" in capped.why
    floor = peak_size(families(0.5, 120), PROFILE, SETTINGS.model_copy(update={"min_replicas": 4}))
    assert floor.replicas == 4 and floor.why.startswith("min_replicas 4 (every window fits")
