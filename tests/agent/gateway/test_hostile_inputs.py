"""Hostile inputs at the gateway: refused with a 400 before a replica sees them, or, when
only the replica can judge them, refused there once and never retried on another replica."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from agent.gateway import inputs
from engine.server.process import ServerProcess
from tests.agent.gateway.harness import DEPLOYMENT, GatewayProcess
from tests.agent.gateway.test_auth_and_input import _replica_traffic, assert_openai_error, bearer

M = DEPLOYMENT.encode()
REFUSED_AT_THE_GATEWAY = {
    "lone surrogate, streaming": (
        "/v1/chat/completions",
        b'{"model": "%s", "stream": true, "messages": [{"role": "user", "content": "\\udc00"}]}',
        None,
    ),
    "surrogate in a key": ("/v1/completions", b'{"model": "%s", "prompt": "hi", "\\ud800": 1}', None),
    "deeply nested JSON": ("/v1/completions", b'{"model": "%s", "prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}", None),
    "NaN": ("/v1/completions", b'{"model": "%s", "prompt": "hi", "temperature": NaN}', None),
    "310-digit max_tokens": ("/v1/completions", b'{"model": "%s", "prompt": "hi", "max_tokens": ' + b"9" * 310 + b"}", "max_tokens"),
    "310-digit max_completion_tokens": (
        "/v1/chat/completions",
        b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1' + b"0" * 309 + b"}",
        "max_completion_tokens",
    ),
    "n of 10^6": ("/v1/completions", b'{"model": "%s", "prompt": "hi", "n": 1000000}', "n"),
}  # fmt: skip


def test_hostile_bodies_never_reach_a_replica(
    east: GatewayProcess, secret: str, replicas: list[ServerProcess]
) -> None:
    before = _replica_traffic(replicas)
    with httpx.Client(base_url=east.url, headers=bearer(secret), timeout=30) as h:
        for name, (path, body, param) in REFUSED_AT_THE_GATEWAY.items():
            r = h.post(path, content=body.replace(b"%s", M), headers={"content-type": "application/json"})
            err = assert_openai_error(r, 400)
            assert err["param"] == param, (name, err)
        assert h.get("/health").status_code == 200
    assert _replica_traffic(replicas) == before


def test_a_replica_refusal_is_not_retried_elsewhere(
    east: GatewayProcess, secret: str, replicas: list[ServerProcess]
) -> None:
    """seed 2**64: refused with a 400 by the shared contract (at the gateway, or by one
    replica), never tried on a second replica."""
    before, _ = _replica_traffic(replicas)
    body = {"model": DEPLOYMENT, "prompt": "hi", "max_tokens": 1, "seed": 2**64}
    r = httpx.post(f"{east.url}/v1/completions", json=body, headers=bearer(secret), timeout=30)
    err = assert_openai_error(r, 400)
    assert err["param"] == "seed"
    after, _ = _replica_traffic(replicas)
    assert after - before <= 1
    ok = httpx.post(
        f"{east.url}/v1/completions", json={**body, "seed": 2**63 - 1}, headers=bearer(secret), timeout=30
    )
    assert ok.status_code == 200, ok.text


async def test_large_bodies_are_parsed_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    real = inputs.parse_request

    def spy(raw: bytes, endpoint: inputs.Endpoint) -> inputs.RequestInfo:
        seen.append(threading.current_thread().name)
        return real(raw, endpoint)

    monkeypatch.setattr(inputs, "parse_request", spy)
    small = b'{"model": "m", "prompt": "hi"}'
    big = b'{"model": "m", "prompt": "' + b"word " * (inputs.OFF_LOOP_BYTES // 4) + b'"}'
    assert (await inputs.parse_off_loop(small, "completions")).prompt_tokens > 0
    assert (await inputs.parse_off_loop(big, "completions")).prompt_tokens > inputs.OFF_LOOP_BYTES // 8
    main = threading.current_thread().name
    assert seen[0] == main and seen[1] != main
    assert asyncio.get_running_loop().is_running()
