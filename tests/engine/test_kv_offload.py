"""The host KV tier on a real (tiny, random) model: greedy output is token-for-token the
same with the tier on, off, and with no prefix cache at all, when prefixes cycle through a
device pool too small for them and under preemption; the tier's metrics and KV events."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from engine import LLM, SamplingParams
from engine.server.metrics import ServerMetrics
from tests.agent.conftest import TINY_VOCAB, make_tiny_model_dir

BS = 4
NUM_BLOCKS = 20  # 80 token slots: two 40-token prefixes at most
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, float32
CONFIGS = {
    "tier": {"kv_offloading_size_gib": 200 * BLOCK_BYTES / (1 << 30)},
    "off": {},
    "no-cache": {"enable_prefix_caching": False},
}


@pytest.fixture(scope="module")
def llms(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LLM]:
    path = make_tiny_model_dir(tmp_path_factory.mktemp("tiny_offload"), seed=3)
    return {
        name: LLM(
            str(path),
            show_progress=False,
            block_size=BS,
            num_gpu_blocks_override=NUM_BLOCKS,
            max_model_len=NUM_BLOCKS * BS,
            max_num_seqs=8,
            speculative_config=None,
            **extra,
        )
        for name, extra in CONFIGS.items()
    }


def _prefix(i: int) -> list[int]:
    return [(i * 37 + t * 11) % (TINY_VOCAB - 10) + 5 for t in range(40)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_returning_prefixes_load_from_the_host_tier_and_decode_the_same(llms) -> None:
    prompts = [[*_prefix(i), 7 + r] for r in range(2) for i in range(6)]  # six prefixes, twice
    outs = {
        name: [llm.generate([p], _greedy(8), use_tqdm=False)[0].token_ids for p in prompts]
        for name, llm in llms.items()
    }
    assert outs["tier"] == outs["off"] == outs["no-cache"]
    tier, off = llms["tier"].engine.stats(), llms["off"].engine.stats()
    assert tier.kv_tier_hits["host"] >= 6 * 9  # the second round: every full prefix block
    assert off.kv_tier_hits["host"] == 0
    assert tier.prefix_cache_hits > off.prefix_cache_hits
    assert tier.kv_tier_bytes["offload"] > 0
    assert tier.kv_tier_bytes["load"] == tier.kv_tier_hits["host"] * BLOCK_BYTES
    assert tier.kv_tier_load_seconds is not None and tier.kv_tier_load_seconds.count > 0
    assert off.kv_tier_load_seconds is None


def test_preempted_requests_resume_exactly_from_offloaded_blocks(llms) -> None:
    """Six requests of 13 + 50 tokens: four are admitted (four blocks each) and outgrow the
    20-block pool, so they preempt one another; a victim's freed blocks (prompt and
    generated) are evicted to the host tier and loaded back when it resumes."""
    prompts = [[*_prefix(i % 3)[:12], 9 + i] for i in range(6)]
    before = {name: llm.engine.stats() for name, llm in llms.items()}
    outs = {
        name: [o.token_ids for o in llm.generate(prompts, _greedy(50), use_tqdm=False)]
        for name, llm in llms.items()
    }
    assert outs["tier"] == outs["off"] == outs["no-cache"]
    after = llms["tier"].engine.stats()
    assert after.num_preemptions > before["tier"].num_preemptions
    assert after.kv_tier_hits["host"] > before["tier"].kv_tier_hits["host"]
    assert all(len(o) == 50 for o in outs["tier"])


def test_tier_metrics_and_events(llms) -> None:
    engine = llms["tier"].engine
    llms["tier"].generate([[*_prefix(i), 3] for i in (10, 11, 12, 10)], _greedy(2), use_tqdm=False)
    metrics = ServerMetrics("tiny")
    metrics.stats = engine.stats
    text = generate_latest(metrics.registry).decode()
    s = engine.stats()
    assert (
        f'fleet_engine_kv_tier_hits_total{{model="tiny",tier="host"}} {float(s.kv_tier_hits["host"])}' in text
    )
    assert 'fleet_engine_kv_tier_hits_total{model="tiny",tier="device"}' in text
    load = float(s.kv_tier_bytes["load"])
    assert f'fleet_engine_kv_tier_bytes_total{{direction="load",model="tiny"}} {load}' in text
    assert 'fleet_engine_kv_tier_bytes_total{direction="offload",model="tiny"}' in text
    assert "fleet_engine_kv_tier_load_seconds_count" in text and 'le="+Inf"' in text

    snap = engine.kv_events.read(None, None)  # a new reader: every tier's blocks
    tiers = {tier: set(hashes) for kind, hashes, tier in snap.ops if kind == "stored"}
    assert tiers["host"] == set(engine.kv.host.hashes())
    assert tiers["device"] == {h for h, _ in engine.kv.block_pool.cached_items()}
    assert tiers["host"] & tiers["device"]  # loaded back: on the device and still on the host


def test_the_flag_reaches_the_engine_from_a_deployments_engine_args() -> None:
    from agent.runtime.command import engine_flags
    from engine.config import EngineArgs
    from engine.server.launcher import build_parser, engine_kwargs

    argv = ["--model", "m", *engine_flags({"kv_offloading_size": 0.5})]
    assert (
        EngineArgs(model="m", **engine_kwargs(build_parser().parse_args(argv))).kv_offloading_size_gib == 0.5
    )
    default = build_parser().parse_args(["--model", "m"])
    assert EngineArgs(model="m", **engine_kwargs(default)).kv_offloading_size_gib == 0.0
