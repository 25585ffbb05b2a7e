"""The performance model: interpolation, profile validation, and the replica's timing."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.sim.model import ReplicaModel, SimRequest
from agent.sim.splitwise import profile_from_splitwise
from fleet_base.profile import PerfProfile, interpolate, list_profiles, load_profile


def flat(**kw: object) -> PerfProfile:
    base: dict[str, object] = dict(
        name="flat",
        prefill_tokens=[100.0, 1000.0],
        prefill_s=[0.1, 1.0],  # 1 ms a token
        decode_batch=[1.0, 4.0],
        decode_step_s=[0.01, 0.04],  # 10 ms per sequence in the batch
        kv_capacity_tokens=10_000,
        max_num_seqs=4,
    )
    base.update(kw)
    return PerfProfile.model_validate(base)


def run(model: ReplicaModel, reqs: list[SimRequest]) -> None:
    for r in sorted(reqs, key=lambda r: r.arrival):
        model.submit(r, r.arrival)
    while not model.idle():
        model.advance(model.next_event_time())


def test_interpolate_inside_outside_and_floor() -> None:
    assert interpolate([1, 3], [10, 30], 2) == 20
    assert interpolate([1, 3], [10, 30], 5) == 50  # extrapolates along the last segment
    assert interpolate([1, 3], [10, 30], -10) == 0  # never negative
    assert interpolate([2], [7], 100) == 7


def test_profile_rejects_bad_curves() -> None:
    with pytest.raises(ValueError, match="increase"):
        flat(decode_batch=[4.0, 1.0])
    with pytest.raises(ValueError, match="length"):
        flat(prefill_s=[0.1])


def test_single_request_timing_follows_the_profile() -> None:
    m = ReplicaModel(flat())
    r = SimRequest(1, prompt_tokens=500, output_tokens=11, arrival=0.0)
    run(m, [r])
    assert r.first_token_at == pytest.approx(0.5)  # prefill 500 tokens
    assert r.finished_at == pytest.approx(0.5 + 10 * 0.01)  # 10 more decode steps at batch 1
    assert m.generated_tokens == 11 and m.kv_used == 0


def test_batch_slows_steps_and_prefill_pauses_decode() -> None:
    m = ReplicaModel(flat())
    a = SimRequest(1, 100, 101, arrival=0.0)
    b = SimRequest(2, 100, 101, arrival=0.5)
    run(m, [a, b])
    assert a.first_token_at == pytest.approx(0.1)
    assert b.first_token_at == pytest.approx(0.6)  # prefilled at once on arrival
    # a: 40 steps alone (0.1..0.5), paused 0.1 for b's prefill, then batch 2 (20 ms a step)
    assert a.finished_at == pytest.approx(0.6 + 60 * 0.02)
    assert b.finished_at > a.finished_at


def test_batch_limit_and_kv_capacity_bound_concurrency() -> None:
    m = ReplicaModel(flat(max_num_seqs=2))
    reqs = [SimRequest(i, 100, 50, arrival=0.0) for i in range(3)]
    for r in reqs:
        m.submit(r, 0.0)
    m.advance(0.1)  # the first prefill (one request) is done; the next batch is admitted
    assert m.num_running == 2 and m.num_waiting == 1
    m2 = ReplicaModel(flat(kv_capacity_tokens=300))
    for r in [SimRequest(i, 100, 50, arrival=0.0) for i in range(3)]:
        m2.submit(r, 0.0)
    m2.advance(0.1)
    assert m2.num_running == 2 and m2.num_waiting == 1  # 2 x 150 tokens fill the cache
    assert m2.kv_usage == pytest.approx(1.0)
    run(m2, [])
    assert m2.idle() and m2.kv_used == 0


def test_tokens_out_grows_with_the_clock() -> None:
    m = ReplicaModel(flat())
    r = SimRequest(1, 100, 50, arrival=0.0)
    m.submit(r, 0.0)
    assert m.tokens_out(r) == 0
    m.advance(0.1)
    assert m.tokens_out(r) == 1
    m.advance(0.1 + 0.2 + 1e-6)
    assert m.tokens_out(r) == 21
    assert math.isinf(ReplicaModel(flat()).next_event_time())


def test_stored_profiles_load() -> None:
    names = list_profiles()
    assert "llama2-70b-h100-tp4" in names
    p = load_profile("llama2-70b-h100-tp4")
    assert p.gpus_per_replica == 4 and p.max_num_seqs == 64
    assert p.decode_time(64) > p.decode_time(1) > 0
    with pytest.raises(ValueError, match="unknown profile"):
        load_profile("nope")


def test_splitwise_profile_matches_stored(shared_data) -> None:
    p = profile_from_splitwise(shared_data / "splitwise_perf_model.csv", "llama2-70b", "h100-80gb", 4)
    assert p == load_profile("llama2-70b-h100-tp4")
    assert p.prefill_time(1000) == pytest.approx(p.prefill_time(1024), rel=0.05)


def test_a_short_prompt_goes_past_a_long_prefill_in_steps_it_shares() -> None:
    # B = 1000 tokens a step, T = 200; 1 ms a token: the long prompt alone gains 200 tokens
    # every 0.2 s step; beside the short one, 200 in its one 0.3 s step (200 + 100 tokens).
    prof = flat(max_prefill_tokens=1000, long_prefill_token_threshold=200, kv_capacity_tokens=100_000)
    long_first = SimRequest(1, prompt_tokens=5000, output_tokens=1, arrival=0.0)
    short = SimRequest(2, prompt_tokens=100, output_tokens=1, arrival=1.0)
    run(ReplicaModel(prof), [long_first, short])
    assert short.first_token_at == pytest.approx(1.0 + 0.3)
    assert long_first.first_token_at == pytest.approx(1.3 + (5000 - 1000 - 200) / 1000)

    fifo_long = SimRequest(1, prompt_tokens=5000, output_tokens=1, arrival=0.0)
    fifo_short = SimRequest(2, prompt_tokens=100, output_tokens=1, arrival=1.0)
    run(ReplicaModel(flat(max_prefill_tokens=1000, kv_capacity_tokens=100_000)), [fifo_long, fifo_short])
    assert fifo_short.first_token_at == pytest.approx(5.0 + 0.1)  # without: behind the whole prefill


def test_running_sequences_decode_in_the_long_prompts_steps() -> None:
    capped = flat(max_prefill_tokens=1000, long_prefill_token_threshold=200, kv_capacity_tokens=100_000)
    plain = flat(max_prefill_tokens=1000, kv_capacity_tokens=100_000)
    for prof, a_done, long_done in ((capped, 1.2, 5.2), (plain, 5.2, 5.15)):
        a = SimRequest(1, prompt_tokens=100, output_tokens=11, arrival=0.0)  # first token at 0.1
        long = SimRequest(2, prompt_tokens=5000, output_tokens=1, arrival=0.15)
        run(ReplicaModel(prof), [a, long])
        # Capped: 5 of a's 10 decode steps by 0.15, the other 5 in the long prompt's steps of
        # 0.2 s + 0.01 s, which gains 200 tokens in each, then 1,000 tokens a second alone.
        # Plain: the 5 s prefill pauses a's decoding.
        assert a.finished_at == pytest.approx(a_done)
        assert long.first_token_at == pytest.approx(long_done)


def test_a_long_prompt_joins_a_batch_already_in_its_step_after_it() -> None:
    prof = flat(max_prefill_tokens=1000, long_prefill_token_threshold=200, kv_capacity_tokens=100_000)
    short = SimRequest(1, prompt_tokens=200, output_tokens=1, arrival=0.0)  # timed alone: 0.2 s
    long = SimRequest(2, prompt_tokens=5000, output_tokens=1, arrival=0.1)
    run(ReplicaModel(prof), [short, long])
    assert short.first_token_at == pytest.approx(0.2)
    assert long.first_token_at == pytest.approx(0.2 + 5.0)  # no work done before that step ends


def test_long_prompts_take_the_long_lane_one_at_a_time_in_order() -> None:
    prof = flat(max_prefill_tokens=1000, long_prefill_token_threshold=200, kv_capacity_tokens=100_000)
    a = SimRequest(1, 3000, 1, arrival=0.0)
    b = SimRequest(2, 2000, 1, arrival=0.1)
    c = SimRequest(3, 150, 1, arrival=0.2)
    run(ReplicaModel(prof), [a, b, c])
    assert c.first_token_at < a.first_token_at < b.first_token_at  # c went past b, not past a's lane
    assert b.first_token_at == pytest.approx(3.0 + 2.0 + 0.15)  # the work is conserved: all of it done


def test_without_a_threshold_the_model_is_first_come_first_served() -> None:
    prof = flat(max_prefill_tokens=1000, kv_capacity_tokens=100_000)
    a = SimRequest(1, 3000, 1, arrival=0.0)
    c = SimRequest(2, 150, 1, arrival=0.2)
    run(ReplicaModel(prof), [a, c])
    assert c.first_token_at == pytest.approx(3.0 + 0.15)


def test_threshold_must_stay_below_the_batch() -> None:
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        flat(max_prefill_tokens=1000, long_prefill_token_threshold=1000)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0, 20), st.integers(1, 6000), st.integers(1, 40)), min_size=1, max_size=40),
    st.sampled_from([0, 100, 400]),
)
def test_every_request_is_served_once_and_the_kv_is_returned(
    reqs: list[tuple[float, int, int]], threshold: int
) -> None:
    prof = flat(max_prefill_tokens=1000, long_prefill_token_threshold=threshold, kv_capacity_tokens=20_000)
    model = ReplicaModel(prof)
    sim = [SimRequest(i, p, o, arrival=t) for i, (t, p, o) in enumerate(reqs)]
    alone = max(r.kv_tokens for r in sim)  # a request bigger than the cache runs alone
    for r in sorted(sim, key=lambda r: r.arrival):
        model.submit(r, r.arrival)
        assert model.kv_used <= max(prof.kv_capacity_tokens, alone)
    while not model.idle():
        before = model.t
        model.advance(model.next_event_time())
        assert model.t >= before
        assert model.kv_used <= max(prof.kv_capacity_tokens, alone)
    assert model.kv_used == 0 and model.idle()
    assert model.generated_tokens == sum(r.output_tokens for r in sim)
    for r in sim:
        assert r.arrival <= r.admitted_at <= r.first_token_at <= r.finished_at
