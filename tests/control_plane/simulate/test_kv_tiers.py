"""The simulator's host KV tier (offload on device eviction, LRU, loads paid at the
profile's bandwidth), the two references every routing on a trace with block ids is read
against (ideal reuse, shared-cache bound), and `fleetctl simulate --kv-offloading-size`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from agent.sim.model import ReplicaModel, SimRequest
from agent.sim.prefix_cache import PrefixCacheModel
from control_plane.autoscale import AutoscaleSettings
from control_plane.cli import app
from control_plane.simulate import compare
from control_plane.simulate.bounds import ideal_reuse
from control_plane.simulate.trace import TraceRequest
from fleet_base.kv_tier_cost import load_seconds
from fleet_base.profile import PerfProfile

BLOCK = 256
PROFILE = PerfProfile(
    name="t",
    prefill_tokens=[128.0, 8192.0],
    prefill_s=[0.02, 1.0],
    decode_batch=[1.0, 32.0],
    decode_step_s=[0.02, 0.03],
    kv_capacity_tokens=8 * BLOCK,
    max_num_seqs=8,
    max_prefill_tokens=8192,
    kv_bytes_per_token=100_000,
    h2d_bytes_per_s=1e9,  # 0.1 ms per token: 25.6 ms per block, against ~31 ms of its prefill
)


def tiered(host_blocks: int) -> PerfProfile:
    return PROFILE.model_copy(update={"host_kv_bytes": host_blocks * BLOCK * PROFILE.kv_bytes_per_token})


def test_device_evictions_move_to_the_host_tier_which_evicts_its_least_recently_used() -> None:
    device_ops: list = []
    host_ops: list = []
    cache = PrefixCacheModel(2, device_ops.append, host_blocks=2, on_host_change=host_ops.append)
    cache.insert([1, 2])
    cache.insert([3, 4])  # the device drops 2 then 1 (tail first): both offloaded
    assert device_ops[-1] == [("removed", (2, 1)), ("stored", (4, 3))]
    assert host_ops[-1] == [("removed", ()), ("stored", (2, 1))]
    assert cache.lookup_tiers([1, 2, 9]) == (0, 2)
    assert cache.lookup_tiers([3, 4, 1, 5]) == (2, 1)  # on the device, then on in the host tier
    cache.insert([5, 6])  # 4, 3 offloaded; the host's least recently used (2, 1) dropped
    assert host_ops[-1] == [("removed", (2, 1)), ("stored", (4, 3))]
    assert cache.lookup_tiers([1, 2]) == (0, 0) and cache.lookup_tiers([3, 4]) == (0, 2)
    cache.insert([3, 4])  # loaded back; 6, 5 offloaded, pushing out the host copies of 4, 3
    assert cache.lookup_tiers([3, 4]) == (2, 0) and cache.lookup_tiers([5, 6]) == (0, 2)
    assert not cache.in_host(3) and cache.host_len == 2 and len(cache) == 2
    big = PrefixCacheModel(2, host_blocks=8)
    big.insert([1, 2])
    big.insert([3, 4])
    big.insert([1, 2])  # loaded back, the host copies kept (and used again)
    assert big.lookup_tiers([1, 2]) == (2, 0) and big.in_host(1) and big.in_host(2)


def test_a_lookup_continues_in_the_host_tier_where_the_device_prefix_ends() -> None:
    cache = PrefixCacheModel(2, host_blocks=4)
    cache.insert([1, 2, 3, 4])  # 4 then 3 evicted to the host: 1, 2 on the device
    assert cache.lookup_tiers([1, 2, 3, 4, 5]) == (2, 2)
    assert (cache.hit_blocks, cache.host_hit_blocks) == (4, 2)
    assert cache.lookup([1, 2, 3]) == 3  # both tiers


def test_without_a_host_tier_evictions_are_dropped() -> None:
    cache = PrefixCacheModel(2)
    cache.insert([1, 2, 3])
    assert cache.lookup_tiers([1, 2, 3]) == (2, 0) and cache.host_len == 0


def _ttft(cache: PrefixCacheModel, prof: PerfProfile, hashes: tuple[int, ...], prompt: int) -> SimRequest:
    m = ReplicaModel(prof, 0.0, cache)
    req = SimRequest(0, prompt, 1, 0.0, block_hashes=hashes, block_tokens=BLOCK)
    m.submit(req, 0.0)
    m.advance(math.inf)
    return req


@pytest.mark.parametrize(
    ("where", "device_hit", "host_hit"),
    [
        ("miss", 0, 0),
        ("device", 4, 0),
        ("host", 0, 4),
        ("device then host", 2, 2),
    ],
)
def test_a_host_hit_pays_its_load_instead_of_its_prefill(where: str, device_hit: int, host_hit: int) -> None:
    prof = tiered(8)
    cache = PrefixCacheModel(PROFILE.kv_capacity_tokens // BLOCK, host_blocks=8)
    prefix = (1, 2, 3, 4)
    if device_hit or host_hit:
        cache.insert(prefix)
    if host_hit:  # push the prefix's last `host_hit` blocks (tail first) down to the host tier
        cache.insert(tuple(range(100, 100 + 8 - device_hit)) + prefix[:device_hit])
    assert cache.lookup_tiers(prefix) == (device_hit, host_hit), where
    prompt = 5 * BLOCK
    req = _ttft(cache, prof, (*prefix, 5), prompt)
    cached = (device_hit + host_hit) * BLOCK
    assert (req.cached_tokens, req.host_tokens) == (cached, host_hit * BLOCK)
    want = (
        prof.prefill_time(prompt - cached) + host_hit * BLOCK * prof.kv_bytes_per_token / prof.h2d_bytes_per_s
    )
    assert req.first_token_at == pytest.approx(want)
    assert load_seconds(prof, host_hit * BLOCK) == pytest.approx(host_hit * 0.0256)


def chats(seed: int, n: int) -> list[TraceRequest]:
    """Multi-turn chats on shared system prompts, bursty: a hostile mix for a small cache."""
    import random

    rng = random.Random(seed)
    out: list[TraceRequest] = []
    convs: list[list[int]] = []
    next_id = 1000
    t = 0.0
    for _ in range(n):
        t += rng.choice((0.0, 0.01, 0.05, 0.5, 2.0))  # bursts and lulls
        if convs and rng.random() < 0.6:
            blocks = rng.choice(convs)
        else:
            blocks = list(range(rng.randrange(3) * 10, rng.randrange(3) * 10 + rng.randint(0, 4)))  # system
            convs.append(blocks)
        for _ in range(rng.randint(1, 3)):
            blocks.append(next_id)
            next_id += 1
        out.append(
            TraceRequest(
                t, len(blocks) * BLOCK + rng.randint(1, 50), rng.randint(1, 30), tuple(blocks), BLOCK
            )
        )
    return out


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(5, 60),
    replicas=st.integers(1, 3),
    host=st.sampled_from([0, 4, 16]),
)
def test_no_routing_hits_more_than_the_ideal_reuse_nor_beats_the_shared_cache_bound(
    seed: int, n: int, replicas: int, host: int
) -> None:
    trace = chats(seed, n)
    prof = tiered(host)
    s = AutoscaleSettings(min_replicas=replicas, max_replicas=replicas, target_concurrency=8)
    rep = compare(
        trace,
        prof,
        s,
        policies=("static",),
        routings=("least-load", "prefix"),
        static_replicas=replicas,
        warmup_s=0,
        best_fixed=False,
    )
    bound = rep.shared_cache_bound
    assert rep.ideal_reuse is not None and bound is not None
    assert rep.ideal_reuse == round(ideal_reuse(trace), 4)
    for row in [*rep.policies, bound]:
        assert row.completed == len(trace)
        assert row.cache_hit_rate <= rep.ideal_reuse
    assert bound.cache_hit_rate <= rep.ideal_reuse and bound.host_hit_rate == 0.0


def test_ideal_reuse_counts_leading_blocks_seen_before_after_the_warm_up() -> None:
    trace = [
        TraceRequest(0.0, 2 * BLOCK, 1, (1, 2), BLOCK),
        TraceRequest(1.0, 3 * BLOCK, 1, (1, 2, 3), BLOCK),  # 2 blocks held
        TraceRequest(2.0, 2 * BLOCK, 1, (1, 2), BLOCK),  # all held: the last token is computed
        TraceRequest(3.0, 2 * BLOCK, 1, (9, 2), BLOCK),  # 2 is held, but not as a prefix
    ]
    assert ideal_reuse(trace) == pytest.approx((2 * BLOCK + 2 * BLOCK - 1) / (9 * BLOCK))
    assert ideal_reuse(trace, warmup_s=1.5) == pytest.approx((2 * BLOCK - 1) / (4 * BLOCK))
    assert ideal_reuse([TraceRequest(0.0, 10, 1)]) == 0.0


def test_the_references_need_block_ids() -> None:
    trace = [TraceRequest(i * 0.1, 300, 5) for i in range(20)]
    s = AutoscaleSettings(min_replicas=2, max_replicas=2, target_concurrency=8)
    rep = compare(trace, PROFILE, s, policies=("static",), warmup_s=0, best_fixed=False)
    assert rep.ideal_reuse is None and rep.shared_cache_bound is None
    assert rep.policies[0].hit_rate_vs_ideal is None and rep.policies[0].ttft_p90_vs_bound is None


def test_the_shared_cache_bound_holds_the_fleets_device_and_host_capacity() -> None:
    # Two replicas, each caching 8 blocks on the device and 8 in the host tier: 4 prefixes of
    # 8 blocks, cycled, fit the fleet's 32 only when shared and counting the host tier.
    trace = [
        TraceRequest(i * 1.0, 8 * BLOCK + 10, 1, tuple(range(100 * (i % 4), 100 * (i % 4) + 8)), BLOCK)
        for i in range(40)
    ]
    s = AutoscaleSettings(min_replicas=2, max_replicas=2, target_concurrency=8)
    on = compare(trace, tiered(8), s, policies=("static",), static_replicas=2, warmup_s=0, best_fixed=False)
    off = compare(trace, PROFILE, s, policies=("static",), static_replicas=2, warmup_s=0, best_fixed=False)
    assert on.shared_cache_bound is not None and off.shared_cache_bound is not None
    assert on.shared_cache_bound.cache_hit_rate == on.ideal_reuse  # every prefix fits: all reuse is hit
    assert off.shared_cache_bound.cache_hit_rate < on.shared_cache_bound.cache_hit_rate
    assert on.host_kv_blocks == 8 and off.host_kv_blocks == 0
    row = on.policies[0]
    assert row.hit_rate_vs_ideal == round(row.cache_hit_rate / on.ideal_reuse, 3)
    assert row.ttft_p90_vs_bound == round(row.ttft_p90_s / on.shared_cache_bound.ttft_p90_s, 3)


def _trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "chats.jsonl"
    rows = chats(3, 200)
    path.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": int(r.at * 1000),
                    "input_length": r.prompt_tokens * 2,  # Mooncake's 512-token blocks
                    "output_length": r.output_tokens,
                    "hash_ids": list(r.hash_ids),
                }
            )
            + "\n"
            for r in rows
        )
    )
    return path


def test_fleetctl_simulate_kv_offloading_size_overrides_the_profiles_host_tier(tmp_path: Path) -> None:
    trace = _trace_file(tmp_path)
    prof = tmp_path / "p.json"
    prof.write_text(tiered(0).model_copy(update={"kv_capacity_tokens": 16 * 512}).model_dump_json())
    runner = CliRunner()
    base = [
        "simulate",
        "--trace",
        str(trace),
        "--profile",
        str(prof),
        "--policies",
        "static",
        "--replicas",
        "2",
    ]
    base += ["--routing", "least-load,prefix", "--no-best-fixed", "-o", "json"]

    def run(*extra: str) -> dict:
        out = runner.invoke(app, [*base, *extra])
        assert out.exit_code == 0, out.output
        return json.loads(out.stdout)

    off = run()
    gib = 64 * 512 * PROFILE.kv_bytes_per_token / (1 << 30)  # 64 blocks of 512 tokens
    on = run("--kv-offloading-size", f"{gib!r}")
    assert off["host_kv_blocks"] == 0 and on["host_kv_blocks"] == 64
    assert (off["host_kv_gib"], on["host_kv_gib"]) == (0.0, round(gib, 1))
    assert on["device_kv_gib"] == round(16 * 512 * PROFILE.kv_bytes_per_token / (1 << 30), 1)
    for report in (off, on):
        assert report["ideal_reuse"] > 0 and report["shared_cache_bound"]["routing"] == "least-load"
        assert all(r["hit_rate_vs_ideal"] is not None for r in report["policies"])
    assert all(r["host_hit_rate"] == 0.0 for r in off["policies"])
    assert any(r["host_hit_rate"] > 0.0 for r in on["policies"])
    assert run("--kv-offloading-size", "0")["host_kv_blocks"] == 0
    table = runner.invoke(app, [*base[:-2], "--kv-offloading-size", f"{gib!r}"])
    assert table.exit_code == 0, table.output
    assert "ideal reuse" in table.output and "shared-cache bound" in table.output
    unknown = prof.read_text().replace('"kv_bytes_per_token":100000', '"kv_bytes_per_token":0')
    prof.write_text(unknown)
    bad = runner.invoke(app, [*base, "--kv-offloading-size", "1"])
    assert bad.exit_code != 0 and "kv_bytes_per_token" in bad.output
    neg = runner.invoke(app, [*base, "--kv-offloading-size", "-1"])
    assert neg.exit_code != 0


def test_fleetctl_simulate_long_prefill_token_threshold_reaches_the_replicas(tmp_path: Path) -> None:
    trace = _trace_file(tmp_path)
    prof = tmp_path / "p.json"
    prof.write_text(tiered(0).model_copy(update={"kv_capacity_tokens": 16 * 512}).model_dump_json())
    runner = CliRunner()
    base = ["simulate", "--trace", str(trace), "--profile", str(prof), "--policies", "static"]
    base += ["--replicas", "2", "--routing", "prefix", "--no-best-fixed"]
    runs = {}
    for threshold in ("0", "512"):
        out = runner.invoke(app, [*base, "--long-prefill-token-threshold", threshold, "-o", "json"])
        assert out.exit_code == 0, out.output
        runs[threshold] = json.loads(out.stdout)
    assert runs["512"]["long_prefill_token_threshold"] == 512
    timing = [
        (r["ttft_p50_s"], r["ttft_p90_s"], r["itl_p99_s"])
        for r in (runs["0"]["policies"][0], runs["512"]["policies"][0])
    ]
    assert timing[0] != timing[1]  # the replicas ran with it: their steps changed
    table = runner.invoke(app, [*base, "--long-prefill-token-threshold", "512"])
    assert table.exit_code == 0 and "long-prefill cap 512 tokens" in table.output
    too_big = runner.invoke(app, [*base, "--long-prefill-token-threshold", str(PROFILE.max_prefill_tokens)])
    assert too_big.exit_code != 0 and "long_prefill_token_threshold" in too_big.output


@pytest.mark.parametrize("host", [0, 16])
def test_on_a_busy_fleet_the_shared_cache_bound_beats_both_routings(host: int) -> None:
    trace = chats(7, 600)
    s = AutoscaleSettings(min_replicas=3, max_replicas=3, target_concurrency=8)
    rep = compare(
        trace,
        tiered(host),
        s,
        policies=("static",),
        routings=("least-load", "prefix"),
        static_replicas=3,
        warmup_s=0,
        best_fixed=False,
    )
    bound = rep.shared_cache_bound
    assert bound is not None and rep.ideal_reuse is not None
    for row in rep.policies:
        assert row.cache_hit_rate <= bound.cache_hit_rate <= rep.ideal_reuse
        assert row.ttft_p90_s >= bound.ttft_p90_s and row.throughput_tok_s <= bound.throughput_tok_s
        assert row.ttft_p90_vs_bound is not None and row.ttft_p90_vs_bound >= 1.0
