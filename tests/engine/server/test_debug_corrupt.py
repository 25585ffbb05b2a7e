"""The corrupt test hook (FLEET_ENGINE_TEST_HOOKS=1): a replica answers a greedy request
wrongly until uncorrupted, while /health stays 200 (the fault the correctness probe catches);
without test hooks the route does not exist."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from engine import AsyncLLM
from engine.server.app import build_app, new_state
from engine.server.state import ServerSettings, ServerState

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def engine(smollm2_gguf) -> Iterator[AsyncLLM]:
    engine = AsyncLLM(MODEL, show_progress=False, max_model_len=256)
    yield engine
    engine.shutdown()


def _client(state: ServerState) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=build_app(state)), base_url="http://e", timeout=60
    )


async def _answer(c: httpx.AsyncClient) -> str:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    r = await c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


async def test_corrupt_makes_answers_wrong_until_uncorrupt(engine: AsyncLLM) -> None:
    state = new_state(ServerSettings(served_model_name=MODEL, test_hooks=True), engine)
    async with _client(state) as c:
        good = await _answer(c)
        assert await _answer(c) == good  # greedy: the same tokens every time
        assert (await c.post("/debug/corrupt")).json() == {"corrupt": True}
        wrong = await _answer(c)
        assert wrong != good
        assert (await c.get("/health")).status_code == 200  # looks healthy
        assert (await c.post("/debug/uncorrupt")).json() == {"corrupt": False}
        assert await _answer(c) == good


async def test_no_corrupt_route_without_test_hooks(engine: AsyncLLM) -> None:
    state = new_state(ServerSettings(served_model_name=MODEL), engine)
    async with _client(state) as c:
        assert (await c.post("/debug/corrupt")).status_code in (404, 405)
