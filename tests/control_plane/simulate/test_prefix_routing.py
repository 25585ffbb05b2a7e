"""Prefix-cache-aware routing in the simulator: sim replicas' LRU prefix caches, the
gateway's own plan choosing replicas, and `fleetctl simulate --routing`."""

from __future__ import annotations

import json
import random
from pathlib import Path

from typer.testing import CliRunner

from agent.sim.prefix_cache import PrefixCacheModel
from control_plane.autoscale import AutoscaleSettings
from control_plane.cli import app
from control_plane.simulate import compare
from control_plane.simulate.trace import TraceRequest
from fleet_base.cluster_config import GatewayConfig
from fleet_base.profile import PerfProfile

PROFILE = PerfProfile(
    name="t",
    prefill_tokens=[128.0, 8192.0],
    prefill_s=[0.02, 1.0],
    decode_batch=[1.0, 32.0],
    decode_step_s=[0.02, 0.03],
    kv_capacity_tokens=400_000,
    max_num_seqs=32,
    max_prefill_tokens=8192,
)


def conversations(n_conv: int, turns: int, seconds: float, seed: int = 1) -> list[TraceRequest]:
    """Multi-turn chats: every turn's prompt is the previous one plus new blocks."""
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    next_id = 0
    for _ in range(n_conv):
        t = rng.uniform(0, seconds)
        blocks: list[int] = []
        for _ in range(turns):
            for _ in range(rng.randint(2, 8)):
                blocks.append(next_id)
                next_id += 1
            out.append(TraceRequest(t, len(blocks) * 256 + 10, rng.randint(10, 60), tuple(blocks), 256))
            t += rng.uniform(5, 30)
    return sorted(out, key=lambda r: r.at)


def test_lru_prefix_cache_reports_what_it_stores_and_evicts() -> None:
    seen: list = []
    cache = PrefixCacheModel(3, seen.append)
    cache.insert([1, 2])
    assert cache.lookup([1, 2, 3]) == 2
    cache.insert([5, 6])  # another prefix: 1 and 2 are older now, 2 (the tail) the oldest
    assert seen[-1] == [("removed", (2,)), ("stored", (6, 5))]
    assert cache.lookup([1, 2, 3]) == 1  # the head outlives its tail, as the engine frees tail first
    cache.insert([1, 7, 8, 9])  # longer than the cache: its own tail goes first
    assert seen[-1] == [("removed", (6, 5, 9)), ("stored", (8, 7))]
    assert cache.lookup([1, 7, 8, 9]) == 3 and len(cache) == 3


def test_prefix_routing_beats_least_load_on_multi_turn_chat() -> None:
    trace = conversations(300, 6, 600)
    s = AutoscaleSettings(min_replicas=4, max_replicas=4, target_concurrency=16)
    rep = compare(
        trace, PROFILE, s, policies=("static",), routings=("least-load", "prefix"), warmup_s=60, tick_s=5
    )
    by = {p.routing: p for p in rep.policies}
    assert set(by) == {"least-load", "prefix"} and all(p.replicas_max == 4 for p in rep.policies)
    assert by["prefix"].cache_hit_rate > by["least-load"].cache_hit_rate + 0.3
    assert by["prefix"].ttft_p90_s * 2 <= by["least-load"].ttft_p90_s
    assert by["prefix"].completed == by["least-load"].completed == by["prefix"].requests


def test_without_prefix_information_prefix_routing_is_least_load() -> None:
    trace = [TraceRequest(i * 0.2, 500 + 37 * (i % 11), 20) for i in range(600)]
    s = AutoscaleSettings(min_replicas=3, max_replicas=3, target_concurrency=16)
    rep = compare(trace, PROFILE, s, policies=("static",), routings=("least-load", "prefix"), warmup_s=0)
    a, b = (p.model_dump(exclude={"routing"}) for p in rep.policies)
    assert a == b and a["cache_hit_rate"] == 0.0


def test_fleetctl_simulate_routing_rows_on_mooncake(shared_data: Path) -> None:
    runner = CliRunner()
    args = [
        "simulate",
        "--trace",
        str(shared_data / "mooncake_synthetic_trace.jsonl"),
        "--policies",
        "static",
    ]
    out = runner.invoke(
        app, [*args, "--routing", "least-load,prefix", "--replicas", "8", "--limit", "400", "-o", "json"]
    )
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout)
    assert report["static_replicas"] == 8 and report["static_sizing"] == "--replicas"
    rows = report["policies"]
    assert [(r["policy"], r["routing"]) for r in rows] == [("static", "least-load"), ("static", "prefix")]
    ll, px = rows
    assert px["cache_hit_rate"] > ll["cache_hit_rate"] and px["ttft_p90_s"] < ll["ttft_p90_s"]
    assert all(r["replicas_max"] == 8 for r in rows)
    # Without --routing: the live gateway's default (prefix), the same row.
    default = runner.invoke(app, [*args, "--replicas", "8", "--limit", "400", "-o", "json"])
    assert default.exit_code == 0, default.output
    assert GatewayConfig().routing == "prefix"
    keys = ("policy", "routing", "completed", "ttft_p50_s", "ttft_p90_s", "cache_hit_rate", "replicas_max")
    assert [{k: r[k] for k in keys} for r in json.loads(default.stdout)["policies"]] == [
        {k: px[k] for k in keys}
    ]
    bad = runner.invoke(app, [*args, "--routing", "round-robin"])
    assert bad.exit_code != 0 and "unknown routing 'round-robin'" in bad.output
