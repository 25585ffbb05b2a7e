"""The one scoring of a cached prefix by tier (live plan and simulator alike)."""

from __future__ import annotations

import pytest

from fleet_base.kv_tier_cost import (
    PrefixHit,
    host_token_value,
    prefix_cost,
    prefix_hit,
    profile_host_token_value,
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


def test_a_host_hit_is_worth_less_than_a_device_hit_and_more_than_a_miss() -> None:
    prof = _profile(host_kv_bytes=1 << 40, h2d_bytes_per_s=200e9)
    value = profile_host_token_value(prof)
    assert 0.0 < value < 1.0
    prompt = 1000
    device = prefix_cost(prefix_hit(40, 0, 16, prompt), prompt, 0, value)
    host = prefix_cost(prefix_hit(0, 40, 16, prompt), prompt, 0, value)
    miss = prefix_cost(prefix_hit(0, 0, 16, prompt), prompt, 0, value)
    assert device < host < miss


def test_a_tiny_bandwidth_gains_nothing() -> None:
    prof = _profile(host_kv_bytes=1 << 40, h2d_bytes_per_s=1e6)
    value = profile_host_token_value(prof)
    assert value == 0.0
    prompt = 1000
    assert prefix_cost(prefix_hit(0, 40, 16, prompt), prompt, 7, value) == 2 * prompt + 7


def test_no_host_tier_is_worth_nothing_and_device_costs_are_unchanged() -> None:
    prof = _profile()
    assert prof.host_kv_bytes == 0 and prof.host_kv_tokens == 0
    assert prof.h2d_bytes_per_s == DEFAULT_H2D_BYTES_PER_S
    assert profile_host_token_value(prof) == 0.0
    # the device-only cost: the new prefill twice (the wait and the work), plus the queued prefill
    assert prefix_cost(prefix_hit(3, 0, 16, 100), 100, 250, 0.0) == 2 * (100 - 48) + 250


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
