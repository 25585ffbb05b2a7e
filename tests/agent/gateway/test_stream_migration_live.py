"""Streams survive a replica kill (real processes, real SmolLM2 replicas): 12 concurrent
greedy chat streams through the gateway; one of the two replicas is SIGKILLed while every
stream is mid-flight. Each stream completes with no error event, its text identical to
the same request on the healthy fleet, its usage counted once, and the gateway's
migration metrics show the hand-overs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.stream_migration import LiveFleet, prompts, run_streams
from tests.agent.gateway.harness import make_key, sample, scrape

pytestmark = pytest.mark.slow

STREAMS = 12
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def fleet(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveFleet]:
    fleet = LiveFleet(tmp_path_factory.mktemp("migration"), make_key("migration")).up()
    try:
        yield fleet
    finally:
        fleet.down()


def test_a_replica_killed_mid_stream_loses_no_stream(fleet: LiveFleet) -> None:
    texts = prompts(STREAMS)
    url, key = fleet.gateway.url, fleet.secret
    healthy, _ = asyncio.run(run_streams(url, key, texts, MAX_TOKENS))
    assert all(r.done and r.error is None for r in healthy)
    killed, at = asyncio.run(
        run_streams(url, key, texts, MAX_TOKENS, kill=lambda: fleet.kill(0), kill_after_chunks=4)
    )
    assert at is not None, "the kill never ran"
    assert fleet.replicas[0].proc is not None and fleet.replicas[0].proc.poll() is not None
    for i, (h, k) in enumerate(zip(healthy, killed, strict=True)):
        assert k.error is None and k.done, (i, k.error)
        assert k.text == h.text, i
        for field in ("prompt_tokens", "completion_tokens", "total_tokens"):  # the whole request, once
            assert k.usage[field] == h.usage[field], (i, field)
    metrics = scrape(url)
    migrated = sum(
        sample(metrics, "fleet_gateway_stream_migrations_total", deployment="smollm2", reason=reason)
        for reason in ("reset", "timeout", "closed", "error_event", "drain")
    )
    assert migrated >= 1  # the killed replica had streams (least-load spreads 12 over 2)
    assert sample(metrics, "fleet_gateway_migration_gap_seconds_count", deployment="smollm2") == migrated
    assert sample(metrics, "fleet_gateway_migration_reprefill_tokens_total", deployment="smollm2") > 0
    assert sample(metrics, "fleet_gateway_stream_migrations_failed_total", deployment="smollm2") == 0
    gaps = sorted(k.max_gap(after=at) for k in killed)
    print(
        f"\nlargest inter-chunk delay after the kill: p50 {gaps[len(gaps) // 2]:.3f} s, max {gaps[-1]:.3f} s"
    )
