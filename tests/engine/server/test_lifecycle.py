"""A second, tiny replica (one sequence, a queue of one, an API key): loading, auth,
the full-queue 429, and SIGTERM draining in-flight work before exiting 0."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine.server.process import ServerProcess
from tests.engine.server.conftest import metric, scrape
from tests.polling import wait_for

pytestmark = pytest.mark.slow

MODEL = "smol-small"  # --served-model-name
KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def small(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("engine-server-small") / "server.log"
    proc = ServerProcess(
        "--max-num-seqs", "1", "--max-queue-len", "1", "--max-model-len", "1024",
        "--api-key", KEY, "--served-model-name", MODEL, "--drain-timeout", "120", log_path=log,
    )  # fmt: skip
    with proc:
        yield proc


def test_health_is_503_while_loading_then_200(small: ServerProcess) -> None:
    codes = small.health_codes
    assert codes[-1] == 200
    assert 503 in codes, f"never saw 503 while loading: {codes}"
    assert codes.index(503) < codes.index(200)


def test_api_key_is_required_on_the_api_only(small: ServerProcess) -> None:
    with httpx.Client(base_url=small.url, timeout=30) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = c.get("/v1/models", headers=headers)
            assert r.status_code == 401
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and "API key" in err["message"]
        assert c.post("/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 401
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200
        assert c.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == MODEL
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{small.url}/v1", api_key="wrong", max_retries=0).models.list()
    ok = openai.OpenAI(base_url=f"{small.url}/v1", api_key=KEY, max_retries=0)
    assert ok.completions.create(model=MODEL, prompt="Hi", max_tokens=1).usage.completion_tokens == 1


def _wait_for(c: httpx.Client, name: str, value: float, timeout: float = 60.0) -> None:
    wait_for(lambda: metric(scrape(c), name, model=MODEL) == value, timeout, f"{name} to reach {value}", 0.05)


def test_full_queue_is_429_with_retry_after(small: ServerProcess) -> None:
    long = {
        "model": MODEL,
        "prompt": "Tell me a story.",
        "max_tokens": 800,
        "ignore_eos": True,
        "stream": True,
    }
    queued_result: list[int] = []

    def queued() -> None:  # waits behind the running request
        with httpx.Client(base_url=small.url, headers=AUTH, timeout=300) as c2:
            r = c2.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            queued_result.append(r.status_code)

    with httpx.Client(base_url=small.url, headers=AUTH, timeout=300) as c:
        with c.stream("POST", "/v1/completions", json=long) as running:
            assert running.status_code == 200
            lines = running.iter_lines()  # keep a reference: a collected iterator closes the stream
            next(lines)
            waiter = threading.Thread(target=queued)
            waiter.start()
            _wait_for(c, "fleet_engine_requests_waiting", 1)
            assert metric(scrape(c), "fleet_engine_requests_running", model=MODEL) == 1

            r = c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 429
            assert int(r.headers["Retry-After"]) >= 1
            err = r.json()["error"]
            assert err["code"] == "queue_full" and "queue is full" in err["message"]
            with pytest.raises(openai.RateLimitError):
                openai.OpenAI(base_url=f"{small.url}/v1", api_key=KEY, max_retries=0).chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1
                )
        # leaving the block dropped the running stream: the queued request now runs and succeeds
        waiter.join(120)
        assert queued_result == [200]
        _wait_for(c, "fleet_engine_requests_running", 0)


def test_sigterm_drains_in_flight_then_exits_0(small: ServerProcess) -> None:
    # The server exits once this stream is done (~60 ms a token here): it must outlast signal
    # delivery and the two round trips below even when this process is descheduled for a while.
    body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 24, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=small.url, headers=AUTH, timeout=300) as c:
        with c.stream("POST", "/v1/completions", json=body) as inflight:
            lines = inflight.iter_lines()
            first = next(ln for ln in lines if ln)
            small.terminate()
            # still listening, but refusing new work

            def not_ok() -> httpx.Response | None:
                r = c.get("/health")
                return r if r.status_code != 200 else None

            health = wait_for(not_ok, 10, "/health to stop answering 200", 0.02)
            assert health.status_code == 503 and health.json()["status"] == "draining"
            refused = c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
            assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
            rest = [first, *(ln for ln in lines if ln)]
    assert rest[-1] == "data: [DONE]"
    chunks = [json.loads(ln.removeprefix("data: ")) for ln in rest[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert small.wait(60) == 0
