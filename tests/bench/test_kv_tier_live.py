"""bench.kv_tier_live without a fleet: the workload plan, the arms' engine args, the chat
each turn sends, the engine counters it reads and the table it prints."""

from __future__ import annotations

import asyncio
import itertools
import math
from pathlib import Path

import pytest

from bench import kv_tier_live
from bench.kv_tier_live import (
    ARMS,
    LEAST_LOAD,
    PREFIX,
    Q_DEVICE,
    Q_GENERATED,
    Q_HITS,
    Q_HOST,
    Q_PROMPT,
    Q_QUERIES,
    TIER_OFF,
    TIER_ON,
    ArmResult,
    Shape,
    Texts,
    arm_row,
    engine_args,
    max_model_len,
    messages_for,
    plan_workload,
    print_results,
)
from bench.prefix_routing import Fleet, Turn, counters_from_metrics
from fleet_base.cluster_config import ClusterConfig
from fleet_base.profile import load_profile


def test_the_four_arms_cross_tier_and_routing_with_the_baseline_first() -> None:
    assert {(a.deployment, a.routing) for a in ARMS} == {
        (d, r) for d in (TIER_OFF, TIER_ON) for r in (LEAST_LOAD, PREFIX)
    }
    assert ARMS[0].deployment == TIER_OFF and ARMS[0].routing == LEAST_LOAD
    # least-load runs before prefix on each deployment
    for d in (TIER_OFF, TIER_ON):
        order = [a.routing for a in ARMS if a.deployment == d]
        assert order == [LEAST_LOAD, PREFIX]


def test_the_default_workload_is_several_times_the_fleets_device_kv_and_hostile() -> None:
    shape = Shape()
    w = plan_workload(shape)
    assert w == plan_workload(shape)  # one plan for every arm
    assert w.distinct_tokens() >= 3 * 3 * 2048
    prompts = w.prompt_tokens()
    assert max(prompts) <= shape.max_context
    counts = [len(c.turns) for c in w.conversations]
    assert min(counts) == 1 and max(counts) >= 4  # heavy tail: many single turns, a few long chats
    assert max(counts) <= shape.max_turns
    starts = [c.start_s for c in w.conversations]
    gaps = sorted(b - a for a, b in itertools.pairwise(starts))
    assert gaps[len(gaps) // 10] < gaps[len(gaps) // 2] / 3  # bursts: many starts packed together
    for c in w.conversations:
        kept = [t.first_kept for t in c.turns]
        assert kept == sorted(kept) and all(f <= k for k, f in enumerate(kept))
        assert c.turns[0].think_s == 0 and all(0 <= t.think_s <= shape.max_think_s for t in c.turns)


def test_a_long_chat_drops_its_oldest_turns_to_stay_within_its_context() -> None:
    w = plan_workload(Shape(seed=3, max_context=500, message_tokens=150, max_turns=8, seconds=60))
    assert any(t.first_kept > 0 for c in w.conversations for t in c.turns)
    assert max(w.prompt_tokens()) <= 500


def test_both_deployments_get_the_same_device_kv_and_one_a_host_tier_4x_it() -> None:
    args = engine_args(2048, 4.0, 8)
    off, on = args[TIER_OFF], args[TIER_ON]
    assert (
        off["kv_cache_memory"]
        == on["kv_cache_memory"]
        == 2048 * load_profile("smollm2-135m-cpu").kv_bytes_per_token
    )
    assert "kv_offloading_size" not in off
    assert math.isclose(on["kv_offloading_size"] * (1 << 30), 4 * on["kv_cache_memory"])
    assert max_model_len(Shape().max_context, Shape().reply_tokens) <= 2048  # one request fits the device


def test_a_turn_sends_the_tagged_system_prompt_the_kept_history_and_its_message() -> None:
    texts = Texts(list(range(1000)), lambda ids: " ".join(map(str, ids)))
    w = plan_workload(Shape(seed=3, max_context=500, message_tokens=150, max_turns=8, seconds=60))
    c = next(c for c in w.conversations if c.turns[-1].first_kept > 0)
    k = len(c.turns) - 1
    replies = [f"reply {j}" for j in range(k)]
    msgs = messages_for(w, c, k, replies, "[run 2]", texts)
    assert msgs[0]["role"] == "system" and msgs[0]["content"].startswith("[run 2] ")
    kept = range(c.turns[k].first_kept, k)
    assert [m["content"] for m in msgs if m["role"] == "assistant"] == [replies[j] for j in kept]
    assert msgs[-1] == {"role": "user", "content": texts(c.turns[k].user_tokens, "user", c.conversation, k)}
    assert len(msgs[-1]["content"].split()) == c.turns[k].user_tokens
    again = messages_for(w, c, k, replies, "[run 3]", texts)
    assert again[1:] == msgs[1:] and again[0] != msgs[0]  # same text, another arm's prefixes


METRICS = """\
# HELP fleet_engine_kv_tier_hits_total Prefix blocks found at admission.
# TYPE fleet_engine_kv_tier_hits_total counter
fleet_engine_kv_tier_hits_total{model="m",tier="device"} 10.0
fleet_engine_kv_tier_hits_total{model="m",tier="host"} 5.0
# HELP fleet_engine_prefix_cache_queries_total Prompt tokens looked up.
# TYPE fleet_engine_prefix_cache_queries_total counter
fleet_engine_prefix_cache_queries_total{model="m"} 1000.0
# HELP fleet_engine_requests_running Running.
# TYPE fleet_engine_requests_running gauge
fleet_engine_requests_running{model="m"} 2.0
"""


def test_engine_counters_are_read_per_tier_and_gauges_left_out() -> None:
    c = counters_from_metrics(METRICS)
    assert c[Q_DEVICE] == 10 and c[Q_HOST] == 5 and c[Q_QUERIES] == 1000
    assert not any("running" in k for k in c)


def _result(arm_index: int, ttfts: list[float], counters: dict[str, float], wall: float) -> ArmResult:
    turns = [Turn(i, 0, [], "x", t, True) for i, t in enumerate(ttfts)]
    return ArmResult(ARMS[arm_index], turns, counters, wall)


def test_the_table_gives_hit_rates_per_tier_and_ratios_to_the_baseline(
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = _result(
        0, [1.0, 2.0, 4.0], {Q_QUERIES: 1600, Q_DEVICE: 20, Q_HITS: 320, Q_PROMPT: 1600, Q_GENERATED: 48}, 8
    )
    tier = _result(3, [0.5, 1.0, 1.0], {Q_QUERIES: 1600, Q_DEVICE: 20, Q_HOST: 50, Q_HITS: 1120, Q_PROMPT: 1600, Q_GENERATED: 48}, 4)  # fmt: skip
    row = arm_row(tier, base)
    assert row[0] == "tier on, prefix" and row[1] == "3/3"
    assert row[4:7] == ["20.0%", "50.0%", "70.0%"]
    assert row[-3:] == [0.5, 0.25, 2.0]
    assert arm_row(base, base)[-3:] == [1.0, 1.0, 1.0]
    print_results([base, tier], "title", "caption")
    out = capsys.readouterr().out
    assert "hit host" in out and "tier on, prefix" in out


def _fast_shape() -> Shape:
    return Shape(
        seed=1, seconds=0.3, rate=20, burst_s=0.05, burst_every_s=0.2, think_s=0.001, max_think_s=0.005
    )


def test_an_arm_sends_every_planned_turn_with_the_replies_in_the_history(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent: list[Turn] = []

    async def fake_ask(client, url, key, turn, max_tokens, model) -> None:
        assert model == TIER_ON and max_tokens == Shape().reply_tokens
        sent.append(turn)
        turn.text, turn.ttft_s, turn.ok = f"reply {turn.conversation}.{turn.turn}", 0.01, True

    monkeypatch.setattr(kv_tier_live, "ask", fake_ask)
    w = plan_workload(_fast_shape())
    texts = Texts(list(range(5000)), lambda ids: " ".join(map(str, ids)))
    result = ArmResult(ARMS[3])
    asyncio.run(kv_tier_live.run_arm(ARMS[3], "[run 4]", "http://x", "k", w, texts, result))
    assert len(result.turns) == w.requests and all(t.ok for t in result.turns) and not result.cut
    for t in sent:
        c = w.conversations[t.conversation]
        kept = range(c.turns[t.turn].first_kept, t.turn)
        assistant = [m["content"] for m in t.messages if m["role"] == "assistant"]
        assert assistant == [f"reply {t.conversation}.{j}" for j in kept]


def test_an_arm_past_its_limit_is_cut_not_hung(monkeypatch: pytest.MonkeyPatch) -> None:
    async def slow_ask(client, url, key, turn, max_tokens, model) -> None:
        await asyncio.sleep(10)

    monkeypatch.setattr(kv_tier_live, "ask", slow_ask)
    result = ArmResult(ARMS[0])
    texts = Texts(list(range(5000)), str)
    asyncio.run(
        kv_tier_live.run_arm(ARMS[0], "t", "http://x", "k", plan_workload(_fast_shape()), texts, result, 0.2)
    )
    assert result.cut and result.turns == [] and result.wall_s < 5
    assert arm_row(result, result)[0].endswith("(cut)")


def test_an_arms_failures_are_shown_by_their_text_most_common_first() -> None:
    r = ArmResult(ARMS[2])
    r.turns = [
        Turn(0, 0, [], "HTTP 503: b'gone'"),
        Turn(1, 0, [], "HTTP 503: b'gone'"),
        Turn(2, 0, [], "ok", 0.1, True),
    ]
    r.turns.append(Turn(3, 0, [], "ConnectError: refused"))
    assert kv_tier_live.failures(r) == ["2x HTTP 503: b'gone'", "1x ConnectError: refused"]


def test_the_fleets_gateways_keep_their_key_set_fresh_for_the_whole_run(tmp_path: Path) -> None:
    """No control plane renews the key set's lease in the local fleet: a gateway first used
    after the default 180 s (the prefix arms) must still admit the bench's key."""
    fleet = Fleet(tmp_path, 3, 2048, engine_args(2048, 4.0, 8))
    for routing in (LEAST_LOAD, PREFIX):
        cfg = ClusterConfig.load(fleet._config(routing, 18000))
        assert cfg.gateway.routing == routing
        assert cfg.gateway.key_state_max_age_s >= 3600
        assert cfg.cpu_slots == 6  # both deployments' replicas
