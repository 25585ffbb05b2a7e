"""Shadow traffic through real processes: a gateway, a real nats-server and simulated
replicas of two versions (the shadow one answers differently from its token 3 on). The
client gets only the original's answer; each copy leaves a usage record marked shadow
with the original's record id and the greedy comparison; a busy shadow replica drops the
copy (never queued); a shadow replica killed mid-copy costs the client nothing."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats as nats_py
import pytest

from agent.sim.server import placeholder
from control_plane.local.nats_server import NatsServer
from fleet_base.openai_contract.continuation import TOKEN_IDS_FIELD
from fleet_base.protocol import ShadowTarget, UsageRecord, VersionWeight, usage_subject
from tests.agent.gateway.conftest import EAST
from tests.agent.gateway.harness import (
    DEPLOYMENT,
    GatewayProcess,
    make_key,
    peer,
    replica,
    route,
    scrape,
    sse_events,
    start_sim,
)
from tests.polling import eventually, wait_for

ROOT = Path(__file__).resolve().parents[3]
DIVERGE_AT = 3
SHADOW = "fleet_gateway_shadow_requests_total"


@pytest.fixture
def sims() -> Iterator[list[tuple[subprocess.Popen[bytes], str]]]:
    """The version in service (v1) and the shadow version (v2, diverging at token 3)."""
    procs = [start_sim(), start_sim("--text-diverge-at", str(DIVERGE_AT))]
    try:
        for _, url in procs:
            wait_for(lambda u=url: httpx.get(f"{u}/health", timeout=1).status_code == 200, 30, "a sim", 0.1,
                     retry_errors=httpx.TransportError)  # fmt: skip
        yield procs
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def shadow_count(url: str, outcome: str) -> float:
    return scrape(url).get((SHADOW, (("deployment", DEPLOYMENT), ("outcome", outcome))), 0.0)


async def test_shadow_copies_are_measured_never_seen_and_dropped_when_busy(
    sims: list[tuple[subprocess.Popen[bytes], str]], nats: NatsServer, tmp_path: Path
) -> None:
    (_v1, v1_url), (v2, v2_url) = sims
    secret, record = make_key("shadowed")
    # one slot per replica: the service version twice (two slots for users), the shadow once
    gw = GatewayProcess(tmp_path / "gw", "east", nats_url=nats.url, concurrency_targets={DEPLOYMENT: 1})
    gw.start()
    try:
        table = route(DEPLOYMENT, [peer("east", gw.url, *EAST)], [VersionWeight(version=1, weight=1.0)])
        table.shadow = ShadowTarget(version=2, share=1.0)
        gw.write(
            replicas=[
                replica("r1a", v1_url, version=1),
                replica("r1b", v1_url, version=1),
                replica("s2", v2_url, version=2),
            ],
            keys=[record],
            routes=[table],
        )
        headers = {"Authorization": f"Bearer {secret}"}
        async with httpx.AsyncClient(base_url=gw.url, timeout=60, headers=headers) as h:
            await eventually(
                lambda: _json(h.get("/health"), "nats_connected"), 10, "the gateway to connect to NATS"
            )
            nc = await nats_py.connect(nats.url)
            try:
                sub = await nc.subscribe(usage_subject("east"))

                def completion(max_tokens: int, stream: bool, **kw: object) -> dict:
                    return {
                        "model": DEPLOYMENT,
                        "prompt": "hi",
                        "max_tokens": max_tokens,
                        "stream": stream,
                        **kw,
                    }

                # 1. a greedy stream: the client's answer is v1's; the copy differs from token 3
                greedy = await h.post("/v1/completions", json=completion(8, True, temperature=0))
                assert greedy.status_code == 200 and greedy.headers["x-fleet-version"] == "1"
                assert stream_text(greedy.text) == placeholder(0, 8)  # v1's words, not v2's
                assert TOKEN_IDS_FIELD not in greedy.text
                wait_for(
                    lambda: shadow_count(gw.url, "completed") == 1, 15, "the greedy copy to complete", 0.05
                )

                # 2. busy: a long stream's copy holds the shadow replica's one slot; another
                # request meanwhile is served at once and its copy dropped, not queued
                async with h.stream("POST", "/v1/completions", json=completion(60, True)) as long:
                    chunks = long.aiter_bytes()
                    await chunks.__anext__()
                    assert shadow_count(gw.url, "sent") == 2
                    short = await h.post("/v1/completions", json=completion(2, False))
                    assert short.status_code == 200 and short.headers["x-fleet-version"] == "1"
                    assert float(short.headers["x-fleet-queue-seconds"]) == 0.0
                    assert shadow_count(gw.url, "dropped_busy") == 1 and shadow_count(gw.url, "sent") == 2
                    async for _ in chunks:
                        pass
                wait_for(
                    lambda: shadow_count(gw.url, "completed") == 2, 15, "the long copy to complete", 0.05
                )

                # 3. the shadow replica dies mid-copy: the client's stream is whole
                async with h.stream("POST", "/v1/completions", json=completion(60, True)) as third:
                    chunks = third.aiter_text()
                    body = [await chunks.__anext__()]
                    wait_for(lambda: shadow_count(gw.url, "sent") == 3, 5, "the third copy", 0.02)
                    os.killpg(v2.pid, signal.SIGKILL)
                    body += [c async for c in chunks]
                assert third.status_code == 200
                text = "".join(body)
                assert (
                    '"finish_reason":"length"' in text.replace(" ", "")
                    and "[DONE]" in text
                    and "error" not in text
                )
                wait_for(lambda: shadow_count(gw.url, "error") == 1, 15, "the broken copy counted", 0.05)

                records: list[UsageRecord] = []
                while len(records) < 7:  # 4 originals, 3 copies (one of them broken)
                    msg = await sub.next_msg(timeout=10)
                    rec = UsageRecord.from_bytes(msg.data)
                    if rec.key_id == "shadowed":
                        records.append(rec)
            finally:
                await nc.close()
    finally:
        gw.stop()

    originals = [r for r in records if not r.shadow]
    copies = [r for r in records if r.shadow]
    assert len(originals) == 4 and len(copies) == 3
    assert {r.version for r in originals} == {1} and {r.version for r in copies} == {2}
    by_id = {r.record_id: r for r in originals}
    assert all(c.shadow_of in by_id for c in copies)  # each copy names its original
    greedy_copy = next(c for c in copies if c.greedy_match is not None)
    assert (greedy_copy.greedy_match, greedy_copy.first_diff_token) == (False, DIVERGE_AT)
    assert greedy_copy.status == 200 and greedy_copy.completion_tokens == 8
    assert greedy_copy.ttft_s is not None and greedy_copy.itl_s is not None
    assert by_id[greedy_copy.shadow_of].completion_tokens == 8
    streamed = [r for r in originals if r.completion_tokens == 60]
    assert len(streamed) == 2 and all(r.itl_s is not None and r.itl_s > 0 for r in streamed)
    (broken,) = [c for c in copies if c.status >= 500]  # the copy whose replica was killed
    assert broken.greedy_match is None and by_id[broken.shadow_of].completion_tokens == 60
    assert all(r.status == 200 for r in originals)


def stream_text(body: str) -> str:
    events = sse_events(body.splitlines())
    return "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices"))


async def _json(response, field: str):
    return (await response).json()[field]
