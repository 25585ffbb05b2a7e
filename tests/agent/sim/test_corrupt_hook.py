"""The simulated replica's corrupt test hook: with test hooks on, POST /debug/corrupt makes
its greedy answers differ (ids and text) while /health stays 200, until /debug/uncorrupt;
without them the route does not exist."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx

from agent.sim.server import DEFAULT_PROFILE, SimState, build_app, drive
from fleet_base.openai_contract.continuation import TOKEN_IDS_FIELD, TOKEN_IDS_HEADER
from fleet_base.profile import load_profile


@asynccontextmanager
async def sim(test_hooks: bool) -> AsyncIterator[httpx.AsyncClient]:
    state = SimState(load_profile(DEFAULT_PROFILE), "d", cold_start_s=0.0, error_rate=0.0)
    state.test_hooks = test_hooks
    driver = asyncio.create_task(drive(state))
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=build_app(state)), base_url="http://s"
        ) as c:
            yield c
    finally:
        driver.cancel()


async def answer(c: httpx.AsyncClient) -> tuple[list[int], str]:
    body = {"model": "d", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    r = await c.post("/v1/completions", json=body, headers={TOKEN_IDS_HEADER: "1"})
    choice = r.json()["choices"][0]
    return choice[TOKEN_IDS_FIELD], choice["text"]


async def test_corrupt_until_uncorrupt() -> None:
    async with sim(test_hooks=True) as c:
        good = await answer(c)
        assert (await c.post("/debug/corrupt")).json() == {"corrupt": True}
        wrong = await answer(c)
        assert wrong[0] != good[0] and wrong[1] != good[1]
        assert (await c.get("/health")).status_code == 200
        assert (await c.post("/debug/uncorrupt")).json() == {"corrupt": False}
        assert await answer(c) == good


async def test_no_hook_without_test_hooks() -> None:
    async with sim(test_hooks=False) as c:
        assert (await c.post("/debug/corrupt")).status_code in (404, 405)
