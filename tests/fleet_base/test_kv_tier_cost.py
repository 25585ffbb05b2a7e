"""The one scoring of a cached prefix by tier (live plan and simulator alike)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet_base.kv_tier_cost import (
    PendingPrefills,
    PrefillTiming,
    PrefixHit,
    expected_ttft_s,
    host_token_value,
    long_prefill_timing,
    prefix_hit,
    profile_host_token_value,
    profile_timing,
    queue_wait_s,
)
from fleet_base.profile import DEFAULT_H2D_BYTES_PER_S, PerfProfile, list_profiles, load_profile

KIB = 1024


def _profile(**kw: object) -> PerfProfile:
    base: dict[str, object] = dict(
        name="t",
        prefill_tokens=[1024.0, 8192.0],
        prefill_s=[0.1, 0.8],  # 100 us a token at a full batch
        decode_batch=[1.0],
        decode_step_s=[0.03],
        kv_capacity_tokens=100_000,
        max_num_seqs=8,
        max_prefill_tokens=8192,
        kv_bytes_per_token=320 * KIB,
    )
    base.update(kw)
    return PerfProfile.model_validate(base)


@pytest.mark.parametrize(
    ("bytes_per_token", "bw", "prefill_s", "want"),
    [
        (320 * KIB, 200e9, 100e-6, 1 - 320 * KIB / 200e9 / 100e-6),  # load ~1.6 us of 100: ~0.98
        (1000, 1e9, 2e-6, 0.5),  # load costs half the prefill
        (1000, 1e9, 1e-6, 0.0),  # load costs the whole prefill: nothing saved
        (1000, 1e6, 1e-6, 0.0),  # tiny bandwidth: loading is dearer than prefill, never negative
        (0, 1e9, 1e-6, 0.0),  # unknown KV size: no value
        (1000, 0.0, 1e-6, 0.0),  # no bandwidth
        (1000, 1e9, 0.0, 0.0),  # free prefill: nothing to save
    ],
)
def test_host_token_value(bytes_per_token: float, bw: float, prefill_s: float, want: float) -> None:
    assert host_token_value(bytes_per_token, bw, prefill_s) == pytest.approx(want)


@pytest.mark.parametrize(
    ("device_blocks", "host_blocks", "prompt", "want"),
    [
        (0, 0, 100, PrefixHit(0, 0)),
        (2, 0, 100, PrefixHit(32, 0)),
        (2, 3, 100, PrefixHit(32, 48)),
        (0, 4, 100, PrefixHit(0, 64)),
        (4, 4, 100, PrefixHit(64, 35)),  # the last prompt token is always computed
        (7, 2, 100, PrefixHit(99, 0)),  # the device part comes first
        (0, 0, 0, PrefixHit(0, 0)),
    ],
)
def test_prefix_hit(device_blocks: int, host_blocks: int, prompt: int, want: PrefixHit) -> None:
    assert prefix_hit(device_blocks, host_blocks, 16, prompt) == want


T = PrefillTiming(s_per_token=1e-4, step_s=0.03)  # 100 us a token: 1,000 tokens are 0.1 s


def _cost(device: int, host: int, prompt: int, wait: float, value: float) -> float:
    return expected_ttft_s(prefix_hit(device, host, 16, prompt), prompt, wait, value, T)


def test_a_host_hit_is_worth_less_than_a_device_hit_and_more_than_a_miss() -> None:
    prof = _profile(host_kv_bytes=1 << 40, h2d_bytes_per_s=200e9)
    value = profile_host_token_value(prof)
    assert 0.0 < value < 1.0
    device, host, miss = (
        _cost(40, 0, 1000, 0, value),
        _cost(0, 40, 1000, 0, value),
        _cost(0, 0, 1000, 0, value),
    )
    assert device < host < miss


def test_a_tiny_bandwidth_gains_nothing() -> None:
    prof = _profile(host_kv_bytes=1 << 40, h2d_bytes_per_s=1e6)
    value = profile_host_token_value(prof)
    assert value == 0.0
    assert _cost(0, 40, 1000, 0.5, value) == pytest.approx(0.5 + 0.1)  # the wait, then the whole prefill


def test_no_host_tier_is_worth_nothing() -> None:
    prof = _profile()
    assert prof.host_kv_bytes == 0 and prof.host_kv_tokens == 0
    assert prof.h2d_bytes_per_s == DEFAULT_H2D_BYTES_PER_S
    assert profile_host_token_value(prof) == 0.0


@dataclass
class TtftRow:
    name: str
    device: int  # leading blocks of a 1,000-token prompt (16 a block) on the device
    host: int  # then in the host tier
    wait_s: float
    host_value: float
    want_s: float


TTFT_ROWS = [
    TtftRow("an idle replica with nothing cached: the whole prefill", 0, 0, 0.0, 0.0, 0.1),
    TtftRow("a device hit is free: the rest only", 40, 0, 0.0, 0.0, 0.1 - 0.064),
    TtftRow("a host hit costs its load: half of it saved at value 0.5", 0, 40, 0.0, 0.5, 0.1 - 0.032),
    TtftRow("a full hit still computes the last token", 63, 0, 0.0, 0.0, 0.1 - 0.0999),
    TtftRow("queued prefill ahead adds its seconds, one unit with the prefill", 40, 0, 0.2, 0.0, 0.2 + 0.036),
]


@pytest.mark.parametrize("row", TTFT_ROWS, ids=lambda r: r.name)
def test_expected_ttft(row: TtftRow) -> None:
    assert _cost(row.device, row.host, 1000, row.wait_s, row.host_value) == pytest.approx(row.want_s)


def test_a_holder_wins_exactly_while_its_queue_costs_less_than_the_recompute_it_saves() -> None:
    saved_s = 0.064  # 40 blocks of 16 tokens at 100 us
    idle_miss = _cost(0, 0, 1000, 0.0, 0.0)
    assert _cost(40, 0, 1000, saved_s - 0.001, 0.0) < idle_miss
    assert _cost(40, 0, 1000, saved_s + 0.001, 0.0) > idle_miss


@dataclass
class WaitRow:
    name: str
    pending: tuple[tuple[float, int], ...]  # (sent at, new prefill tokens)
    now: float
    want_s: float


WAIT_ROWS = [
    WaitRow("nothing pending: no wait", (), 5.0, 0.0),
    WaitRow("one prefill just sent: all of it", ((5.0, 2000),), 5.0, 0.2),
    WaitRow("a long prefill mostly done: only what is left", ((4.9, 2000),), 5.0, 0.1),
    WaitRow("a prefill that should have ended: none (its first token is late)", ((1.0, 2000),), 5.0, 0.0),
    WaitRow("two sent together run one after the other", ((5.0, 1000), (5.0, 1000)), 5.0, 0.2),
    WaitRow("the second starts when the first ends", ((4.9, 2000), (4.95, 1000)), 5.0, 0.2),
    WaitRow("an idle gap before the second is not waited for", ((1.0, 1000), (4.95, 1000)), 5.0, 0.05),
    WaitRow("the order sent, whatever the order listed", ((4.95, 1000), (4.9, 2000)), 5.0, 0.2),
]


@pytest.mark.parametrize("row", WAIT_ROWS, ids=lambda r: r.name)
def test_queue_wait(row: WaitRow) -> None:
    assert queue_wait_s(row.pending, row.now, T) == pytest.approx(row.want_s)


# A 2,048-token cap: while a long prompt is pending, every step carries 2,048 of its tokens.
LONG = long_prefill_timing(T, 2048, 8192)

SHORT_WAIT_ROWS = [
    WaitRow("a long prefill ahead: only the step its tokens share", ((5.0, 20_000),), 5.0, 0.2048),
    WaitRow(
        "a short one ahead: its step and the prompt's own, each with the long tokens",
        ((5.0, 20_000), (5.0, 1500)),
        5.0,
        0.15 + 2 * 0.2048,
    ),
    WaitRow(
        "three short ones ahead share one step (6,144 tokens of room), then the prompt's own",
        ((5.0, 20_000), (5.0, 100), (5.0, 100), (5.0, 100)),
        5.0,
        0.03 + 2 * 0.2048,
    ),
    WaitRow(
        "7,000 short tokens ahead take two steps of room, then the prompt's own",
        ((5.0, 20_000), (5.0, 2000), (5.0, 2000), (5.0, 1500), (5.0, 1500)),
        5.0,
        0.7 + 3 * 0.2048,
    ),
    WaitRow("short ones alone run as without the cap", ((5.0, 1500), (5.0, 500)), 5.0, 0.2),
    WaitRow("a short one mostly done: only what is left", ((4.9, 1500),), 5.0, 0.05),
]


@pytest.mark.parametrize("row", SHORT_WAIT_ROWS, ids=lambda r: r.name)
def test_a_short_prompt_waits_only_for_short_ones(row: WaitRow) -> None:
    assert queue_wait_s(row.pending, row.now, LONG, short=True) == pytest.approx(row.want_s)


def test_a_long_prompt_waits_for_everything_and_no_cap_means_no_short_lane() -> None:
    pending = ((5.0, 20_000), (5.0, 1500))
    assert queue_wait_s(pending, 5.0, LONG) == pytest.approx(2.15)
    assert queue_wait_s(pending, 5.0, T, short=True) == pytest.approx(2.15)  # T has no cap
    assert LONG.is_short(2048) and not LONG.is_short(2049) and not T.is_short(1)
    assert long_prefill_timing(T, 8192, 8192).long_threshold == 0  # a cap of the whole step caps nothing


# One step of a replica's prefill queue: a prefill sent now or a little after, one sent
# earlier than the last (out of order), the oldest done, any one done (by key or by size),
# or an ask at a later instant.
QUEUE_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.floats(0.0, 1.0), st.integers(0, 30_000)),
        st.tuples(st.just("late"), st.floats(0.001, 0.5), st.integers(0, 30_000)),
        st.tuples(st.just("oldest"), st.just(0.0), st.just(0)),
        st.tuples(st.just("pop"), st.floats(0.0, 60.0), st.just(0)),
        st.tuples(st.just("release"), st.just(0.0), st.integers(0, 30_000)),
        st.tuples(st.just("ask"), st.floats(0.0, 3.0), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=400)
@given(QUEUE_OPS, st.sampled_from(["T", "LONG"]))
def test_the_kept_queue_waits_exactly_as_folding_it_again(
    ops: list[tuple[str, float, int]], name: str
) -> None:
    """Whatever the order of sends, completions and asks, the kept end answers what a fresh
    pass over the same prefills answers (asked at one timing throughout, as a replica is)."""
    timing = {"T": T, "LONG": LONG}[name]
    queue, now, keys = PendingPrefills(), 0.0, []
    for op, x, tokens in ops:
        if op == "add":
            now += x
            keys.append(queue.add(now, tokens))
        elif op == "late":
            keys.append(queue.add(now - x, tokens))
        elif op == "oldest":  # the first sent still here
            next((k for k in keys if queue.pop(k) is not None), None)
        elif op == "pop" and keys:
            queue.pop(keys[int(x) % len(keys)])
        elif op == "release":
            queue.release(tokens)
        else:
            now += x
        for short in (False, True):
            want = queue_wait_s(queue.items(), now, timing, short=short)
            assert queue.wait_s(now, timing, short=short) == pytest.approx(want, rel=1e-9, abs=1e-9)
    assert len(queue) == len(queue.items())
    other = LONG if timing is T else T  # another timing folds afresh
    want = queue_wait_s(queue.items(), now, other, short=True)
    assert queue.wait_s(now, other, short=True) == pytest.approx(want, rel=1e-9, abs=1e-9)


def test_a_release_by_size_takes_the_oldest_of_that_size_else_the_oldest() -> None:
    queue = PendingPrefills()
    for at, tokens in ((1.0, 500), (2.0, 800), (3.0, 500)):
        queue.add(at, tokens)
    queue.release(500)
    assert queue.items() == ((2.0, 800), (3.0, 500))
    queue.release(123)
    assert queue.items() == ((3.0, 500),)


def test_profile_timing_is_the_full_batch_rate_and_one_step() -> None:
    t = profile_timing(_profile())
    assert t.s_per_token == pytest.approx(0.8 / 8192) and t.step_s == pytest.approx(0.03)


def test_a_host_tier_needs_the_token_size() -> None:
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        _profile(host_kv_bytes=1 << 30, kv_bytes_per_token=0)
    assert _profile(host_kv_bytes=1 << 30).host_kv_tokens == (1 << 30) // (320 * KIB)


@pytest.mark.parametrize("name", list_profiles())
def test_shipped_profiles_load_with_no_host_tier(name: str) -> None:
    prof = load_profile(name)
    assert prof.host_kv_bytes == 0 and prof.kv_bytes_per_token > 0 and prof.h2d_bytes_per_s > 0
    with_tier = prof.model_copy(
        update={"host_kv_bytes": 4 * prof.kv_capacity_tokens * prof.kv_bytes_per_token}
    )
    assert 0.0 < profile_host_token_value(with_tier) <= 1.0
