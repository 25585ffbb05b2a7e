"""One key floods a real gateway process with 100 concurrent requests: its `max_concurrent`
holds (429 past it once its share of the queue is full, never more in flight at the
replica), and another key's requests are still admitted promptly (fair queueing).

The replica is a small in-process stand-in that holds each request `HOLD_S` and records,
per tenant (the cache salt the gateway stamps on every body), how many it ran at once.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from agent.gateway.tenancy import cache_salt
from fleet_base.api_keys import Quotas
from fleet_base.ports import free_port
from tests.agent.gateway.conftest import EAST
from tests.agent.gateway.harness import DEPLOYMENT, GatewayProcess, make_key, peer, replica, route
from tests.polling import eventually

HOLD_S = 0.5
SLOTS = 4  # the deployment's concurrency target at this gateway
QUEUE = 16
MAX_CONCURRENT = 2
FLOOD = 100


class HoldingReplica:
    def __init__(self) -> None:
        self.port = free_port()
        self.running: collections.Counter[str] = collections.Counter()
        self.peak: collections.Counter[str] = collections.Counter()
        self.order: list[str] = []  # the tenant of each request, in the order they arrived

    async def completions(self, request: Request) -> JSONResponse:
        salt = json.loads(await request.body()).get("cache_salt", "")
        self.order.append(salt)
        self.running[salt] += 1
        self.peak[salt] = max(self.peak[salt], self.running[salt])
        try:
            await asyncio.sleep(HOLD_S)
        finally:
            self.running[salt] -= 1
        return JSONResponse(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": 0,
                "model": DEPLOYMENT,
                "choices": [{"index": 0, "text": "ok", "finish_reason": "length", "logprobs": None}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/completions", self.completions, methods=["POST"])])


@pytest.fixture
async def stand_in() -> AsyncIterator[HoldingReplica]:
    rep = HoldingReplica()
    server = uvicorn.Server(uvicorn.Config(rep.app(), port=rep.port, log_level="error", lifespan="off"))
    task = asyncio.create_task(server.serve())
    await eventually(lambda: server.started, 10)
    yield rep
    server.should_exit = True
    await task


async def test_a_flooding_key_is_held_to_its_share_and_others_are_served(
    tmp_path: Path, nats, stand_in: HoldingReplica
) -> None:
    flood_secret, flooder = make_key("flooder")
    flooder = flooder.model_copy(update={"quotas": Quotas(max_concurrent=MAX_CONCURRENT)})
    fair_secret, fair = make_key("fair")
    queue = {"queue_size": QUEUE, "queue_timeout_s": 20.0, "concurrency_targets": {DEPLOYMENT: SLOTS}}
    gw = GatewayProcess(tmp_path / "gw", "east", nats_url=nats.url, **queue)  # type: ignore[arg-type]
    await asyncio.to_thread(gw.start)
    try:
        await asyncio.to_thread(
            gw.write,
            replicas=[replica("r1", f"http://127.0.0.1:{stand_in.port}")],
            keys=[flooder, fair],
            routes=[route(DEPLOYMENT, [peer("east", gw.url, *EAST)])],
        )
        body = {"model": DEPLOYMENT, "prompt": "hi", "max_tokens": 1}
        limits = httpx.Limits(max_connections=FLOOD + 10, max_keepalive_connections=FLOOD + 10)
        async with httpx.AsyncClient(base_url=gw.url, timeout=60, limits=limits) as http:

            async def post(secret: str) -> tuple[httpx.Response, float]:
                t0 = time.monotonic()
                r = await http.post(
                    "/v1/completions", json=body, headers={"Authorization": f"Bearer {secret}"}
                )
                return r, time.monotonic() - t0

            flood = [asyncio.create_task(post(flood_secret)) for _ in range(FLOOD)]

            async def flood_queued() -> bool:
                return (await http.get("/health")).json()["queue_depth"] >= 2 or all(t.done() for t in flood)

            await eventually(flood_queued, 20, "the flood to queue", 0.02)
            fair_results = await asyncio.gather(*(post(fair_secret) for _ in range(SLOTS)))
            flood_results = await asyncio.gather(*flood)
    finally:
        await asyncio.to_thread(gw.stop)

    statuses = collections.Counter(r.status_code for r, _ in flood_results)
    waits = [float(r.headers.get("x-fleet-queue-seconds", "nan")) for r, _ in fair_results]
    print(
        f"\nflood of {FLOOD} (max_concurrent {MAX_CONCURRENT}, {SLOTS} slots, queue {QUEUE}): {dict(statuses)}; "
        f"flooder peak in flight {stand_in.peak[cache_salt('flooder')]}; other key queued {waits} s"
    )
    for r, _ in fair_results:
        assert r.status_code == 200, r.text
        # a turn or two of the flooder's, not the ~6 holds its queue takes to drain
        assert float(r.headers["x-fleet-queue-seconds"]) < 3 * HOLD_S
    # counted rather than timed: every request of the other key reached the replica while the
    # flooder still had requests queued (in FIFO order they would all have come after them)
    fair_at = [i for i, salt in enumerate(stand_in.order) if salt == cache_salt("fair")]
    assert len(fair_at) == SLOTS
    assert stand_in.order[fair_at[-1] :].count(cache_salt("flooder")) >= 4, stand_in.order
    assert set(statuses) <= {200, 429}, statuses
    assert statuses[429] >= FLOOD - MAX_CONCURRENT - QUEUE, statuses
    refused = next(r for r, _ in flood_results if r.status_code == 429).json()["error"]
    assert refused["code"] == "rate_limit_exceeded" and "max_concurrent" in refused["message"]
    assert stand_in.peak[cache_salt("flooder")] == MAX_CONCURRENT
    assert stand_in.peak[cache_salt("fair")] >= 1
