"""Quotas and priority queueing through a real gateway process in front of two real engine
replicas of a tiny random Llama.

- a key with 2,000 tokens/minute gets 429 once its budget is spent, within 5% of the
  budget in tokens the engine counted; x-ratelimit-* headers on every response; another
  key is unaffected;
- under saturation (2 slots, many requests) interactive requests queue at least 3x less
  (p90) than batch ones, and no batch request waits beyond the starvation bound; a
  standard request is not starved by an interactive flood beyond the queue age.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.server.process import ServerProcess
from engine.tokenizer import Tokenizer
from fleet_base.api_keys import ApiKeyRecord, Quotas
from fleet_base.local_state import LocalState
from fleet_base.protocol import DesiredState, ReplicaSpec
from tests.agent.gateway.harness import DEPLOYMENT, GatewayProcess, make_key, replica, route, sample, scrape
from tests.polling import eventually

pytestmark = pytest.mark.slow

TPM = 2000
RPM = 1000
PROMPT = "the quick brown fox jumps over the lazy dog and the lazy dog sleeps " * 2
MAX_TOKENS = 4


# every request its own connection at once: a client-side pool wait would count as service
UNPOOLED = httpx.Limits(max_connections=None, max_keepalive_connections=None)


def limited_key(key_id: str, **quotas: object) -> tuple[str, ApiKeyRecord]:
    secret, record = make_key(key_id)
    return secret, record.model_copy(update={"quotas": Quotas(**quotas)})


def desired(state_dir: Path, model: Path) -> None:
    LocalState(state_dir).save_desired(
        DesiredState(
            cluster="quota",
            replicas=[
                ReplicaSpec(replica_id=r, deployment=DEPLOYMENT, version=1, model=str(model))
                for r in ("r1", "r2")
            ],
        )
    )


@pytest.fixture
def gateway(
    request: pytest.FixtureRequest, tmp_path: Path, nats, replicas: list[ServerProcess], gw_model: Path
) -> Iterator[GatewayProcess]:
    gw = GatewayProcess(tmp_path / "gw", "quota", nats_url=nats.url, queue_size=256, queue_timeout_s=30.0)
    gw.config.gateway.concurrency_target = 1  # 2 replicas -> 2 slots: saturation is easy to reach
    gw.config.gateway.max_queue_age_s = getattr(request, "param", 1.5)
    desired(gw.config.state_dir, gw_model)
    gw.start()
    try:
        yield gw
    finally:
        gw.stop()


def parse_reset(text: str) -> float:
    """OpenAI's "1.5s" / "120ms" / "6m0s" back to seconds."""
    if text.endswith("ms"):
        return float(text[:-2]) / 1000
    m = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:([\d.]+)s)?", text)
    assert m and text, text
    h, mi, s = (float(g) if g else 0.0 for g in m.groups())
    return h * 3600 + mi * 60 + s


async def test_a_key_is_stopped_at_its_token_budget(
    gateway: GatewayProcess, replicas: list[ServerProcess], gw_model: Path
) -> None:
    capped = limited_key("capped", tokens_per_minute=TPM, requests_per_minute=RPM)
    other = limited_key("other", tokens_per_minute=100_000)
    gateway.write(
        replicas=[replica("r1", replicas[0].url), replica("r2", replicas[1].url)],
        keys=[capped[1], other[1]],
        routes=[route(DEPLOYMENT, [])],
    )
    prompt_tokens = len(Tokenizer.from_path(gw_model).encode(PROMPT))
    cost = prompt_tokens + MAX_TOKENS
    body = {"model": DEPLOYMENT, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    ok: list[httpx.Response] = []
    streamed: list[httpx.Response] = []
    refused: list[httpx.Response] = []
    stop = asyncio.Event()

    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as h:
        auth = {"Authorization": f"Bearer {capped[0]}"}

        async def worker(stream: bool) -> None:
            while not stop.is_set():
                r = await h.post("/v1/completions", headers=auth, json={**body, "stream": stream})
                if r.status_code == 429:
                    refused.append(r)
                    stop.set()
                else:
                    assert r.status_code == 200, r.text
                    (streamed if stream else ok).append(r)

        # half the clients stream without asking for usage: the gateway asks the replica
        # for it, settles the reservation from it, and strips it again
        started = time.monotonic()
        await asyncio.gather(*(worker(stream=i % 2 == 1) for i in range(8)))
        elapsed = time.monotonic() - started
        bad = await h.post("/v1/completions", headers=auth, json={**body, "max_tokens": "many"})
        # the other key is unaffected
        r_other = await h.post("/v1/completions", headers={"Authorization": f"Bearer {other[0]}"}, json=body)
    assert all(r.json()["usage"]["prompt_tokens"] == prompt_tokens for r in ok)  # the gateway counted right
    assert all(r.json()["usage"]["completion_tokens"] == MAX_TOKENS for r in ok)  # ignore_eos: all of them
    for r in streamed:  # same request, streamed: the engine generated the same; no usage reached the client
        assert r.text.rstrip().endswith("data: [DONE]") and '"usage"' not in r.text
    engine_tokens = sum(r.json()["usage"]["total_tokens"] for r in ok) + cost * len(streamed)
    assert streamed and ok
    refill = TPM / 60 * elapsed
    print(
        f"\nquota live: budget {TPM} tok/min, engine-counted tokens admitted {engine_tokens} "
        f"({100 * (engine_tokens - TPM) / TPM:+.1f}%), {len(ok)} + {len(streamed)} streamed requests of {cost} "
        f"tokens in {elapsed:.2f} s "
        f"(refill {refill:.0f} tokens)"
    )
    assert abs(engine_tokens - TPM) <= 0.05 * TPM
    first = refused[0]
    h429 = first.headers
    assert first.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(h429["retry-after"]) >= 1
    assert h429["x-ratelimit-limit-tokens"] == str(TPM)
    assert h429["x-ratelimit-limit-requests"] == str(RPM)
    remaining = int(h429["x-ratelimit-remaining-tokens"])
    assert 0 <= remaining < cost  # refused because the next request no longer fits
    # what is left plus what the engine counted is the budget plus what refilled meanwhile
    assert TPM - cost <= engine_tokens + remaining <= TPM + refill + 1
    reset = parse_reset(h429["x-ratelimit-reset-tokens"])
    assert reset == pytest.approx((TPM - remaining) / (TPM / 60), abs=1.0)
    assert int(h429["x-ratelimit-remaining-requests"]) >= RPM - len(ok) - len(streamed) - 8
    # a refused bad request of the key carries its limits too
    assert bad.status_code == 400 and bad.headers["x-ratelimit-limit-tokens"] == str(TPM)
    # every success carried the headers too, and remaining tokens went down
    for r in ok + streamed:
        for name in (
            "x-ratelimit-limit-requests",
            "x-ratelimit-limit-tokens",
            "x-ratelimit-remaining-requests",
            "x-ratelimit-remaining-tokens",
            "x-ratelimit-reset-requests",
            "x-ratelimit-reset-tokens",
        ):
            assert name in r.headers, name
    assert min(int(r.headers["x-ratelimit-remaining-tokens"]) for r in ok) < cost * 5
    assert r_other.status_code == 200
    assert r_other.headers["x-ratelimit-limit-tokens"] == "100000"
    assert int(r_other.headers["x-ratelimit-remaining-tokens"]) >= 100_000 - cost
    metrics = scrape(gateway.url)
    assert sample(metrics, "fleet_gateway_rate_limited_total", deployment=DEPLOYMENT, limit="tpm") >= 1
    counted = sample(
        metrics, "fleet_gateway_prompt_tokens_counted_total", deployment=DEPLOYMENT, counter="tokenizer"
    )
    assert counted >= prompt_tokens * len(ok)


async def service_time(h: httpx.AsyncClient, secret: str, body: dict) -> float:
    """How long one request takes on an idle replica now (the machine may be busy): arrival
    rates below are set from it, so the test means the same on a fast or a loaded host."""
    took = []
    for _ in range(4):  # the first also loads the tokenizer: not counted
        t0 = time.monotonic()
        r = await h.post("/v1/completions", headers={"Authorization": f"Bearer {secret}"}, json=body)
        assert r.status_code == 200, r.text
        took.append(time.monotonic() - t0)
    return min(took[1:])


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


@pytest.mark.parametrize("gateway", [30.0], indirect=True)  # max_queue_age_s: no aging here
async def test_interactive_queues_less_than_batch_and_batch_is_not_starved(
    gateway: GatewayProcess, replicas: list[ServerProcess]
) -> None:
    inter = limited_key("inter", priority_class="interactive")
    batch = limited_key("batch", priority_class="batch")
    gateway.write(
        replicas=[replica("r1", replicas[0].url), replica("r2", replicas[1].url)],
        keys=[inter[1], batch[1]],
        routes=[route(DEPLOYMENT, [])],
    )
    slots = 2
    body = {"model": DEPLOYMENT, "prompt": "hello world", "max_tokens": 24, "ignore_eos": True}
    waits: dict[str, list[float]] = {"interactive": [], "batch": []}
    service: list[float] = []

    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as h:

        async def one(klass: str, secret: str, delay: float) -> None:
            await asyncio.sleep(delay)
            t0 = time.monotonic()
            r = await h.post("/v1/completions", headers={"Authorization": f"Bearer {secret}"}, json=body)
            assert r.status_code == 200, r.text
            queued = float(r.headers["x-fleet-queue-seconds"])
            waits[klass].append(queued)
            service.append(time.monotonic() - t0 - queued)

        # batch fills the queue first; then interactive arrives at half the 2 slots' capacity
        service_s = await service_time(h, inter[0], body)
        n_batch, n_inter = 16, 10
        tasks = [asyncio.create_task(one("batch", batch[0], 0.0)) for _ in range(n_batch)]

        async def batch_queued() -> bool:  # half is enough: on a loaded box the 2 slots drain while it fills
            return (await h.get("/health")).json()["queue_depth"] >= n_batch // 2

        await eventually(batch_queued, 20, "the batch requests to queue", 0.02)
        tasks += [asyncio.create_task(one("interactive", inter[0], service_s * i)) for i in range(n_inter)]
        await asyncio.gather(*tasks)
        depth = (await h.get("/health")).json()["queue_depth"]
    p_inter, p_batch = p90(waits["interactive"]), p90(waits["batch"])
    # no batch request waits past the queue timeout, nor beyond what the requests ahead
    # of it (all batch and interactive ones, over `slots`) take
    bound = min(
        gateway.config.gateway.queue_timeout_s, (math.ceil((n_batch + n_inter) / slots) + 1) * max(service)
    )
    print(
        f"\npriority: interactive p90 queue {p_inter:.3f} s, batch p90 {p_batch:.3f} s "
        f"(ratio {p_batch / max(p_inter, 1e-9):.1f}x), batch max {max(waits['batch']):.3f} s "
        f"(bound {bound:.2f} s; service {max(service):.3f} s)"
    )
    assert p_batch >= 3 * p_inter
    assert max(waits["batch"]) <= bound
    assert depth == 0
    status = LocalState(gateway.config.state_dir).load_gateway()  # what the agent puts in its heartbeat
    assert status is not None and set(status.by_class) == {"interactive", "standard", "batch"}
    metrics = scrape(gateway.url)
    assert sample(metrics, "fleet_gateway_queue_time_seconds_count", **{"class": "batch"}) >= n_batch
    assert sample(metrics, "fleet_gateway_queue_class_depth", **{"class": "interactive"}) == 0


async def test_an_interactive_flood_does_not_starve_standard_beyond_the_age(
    gateway: GatewayProcess, replicas: list[ServerProcess]
) -> None:
    """Interactive requests alone arrive faster than the 2 slots serve: without aging the
    standard requests would wait until the flood ends; with it they go once overdue. (The
    batch class is exempt from aging: it waits for the flood, `test_fair_queue`.)"""
    inter = limited_key("inter", priority_class="interactive")
    batch = limited_key("standard", priority_class="standard")
    gateway.write(
        replicas=[replica("r1", replicas[0].url), replica("r2", replicas[1].url)],
        keys=[inter[1], batch[1]],
        routes=[route(DEPLOYMENT, [])],
    )
    age = gateway.config.gateway.max_queue_age_s
    body = {"model": DEPLOYMENT, "prompt": "hello world", "max_tokens": 24, "ignore_eos": True}
    batch_waits: list[float] = []
    service: list[float] = []

    async with httpx.AsyncClient(base_url=gateway.url, timeout=60, limits=UNPOOLED) as h:

        async def one(secret: str, delay: float, out: list[float] | None = None) -> None:
            await asyncio.sleep(delay)
            t0 = time.monotonic()
            r = await h.post("/v1/completions", headers={"Authorization": f"Bearer {secret}"}, json=body)
            assert r.status_code == 200, r.text
            queued = float(r.headers["x-fleet-queue-seconds"])
            service.append(time.monotonic() - t0 - queued)
            if out is not None:
                out.append(queued)

        # interactive alone at 1.5x the 2 slots' capacity, for longer than the age
        service_s = await service_time(h, inter[0], body)
        gap = service_s / 3
        n_flood = math.ceil((age + 2.0) / gap)
        # take both slots and queue more interactive work than the age covers, so the queue never
        # drains before the standard requests are overdue even when the replicas speed up
        backlog = min(64, 2 + math.ceil(2 * (age + 1.0) / service_s))  # well inside the queue's 256
        flood = [asyncio.create_task(one(inter[0], 0.0)) for _ in range(backlog)]
        flood += [asyncio.create_task(one(inter[0], 0.03 + gap * i)) for i in range(n_flood)]
        await asyncio.gather(*(one(batch[0], 0.02, batch_waits) for _ in range(2)))
        still_queued = (await h.get("/health")).json()["queue_depth"]
        flood_running = sum(not t.done() for t in flood)  # in flight, queued or yet to arrive
        for task in flood:  # the rest of the flood is not needed: leave (the gateway frees the slots)
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
    bound = age + 2 * max(service)
    print(
        f"\nstarvation: batch waits {[round(w, 3) for w in sorted(batch_waits)]} s with max_queue_age_s {age} "
        f"(bound {bound:.2f} s); {still_queued} interactive requests still queued and {flood_running} "
        "unfinished when they were served"
    )
    assert max(batch_waits) <= bound
    assert max(batch_waits) >= age * 0.9  # they did wait behind the flood until overdue
    assert flood_running > 0  # and went in while the flood still ran
