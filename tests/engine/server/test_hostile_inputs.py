"""The inputs an adversarial client sends, each against the real replica: a clear 400 for
that request, and the replica goes on serving (health 200, the next request answered)."""

from __future__ import annotations

import httpx
import pytest

from fleet_base.bounds import INT64_MAX, INT64_MIN, MAX_TOKENS
from tests.engine.server.conftest import MODEL
from tests.engine.server.test_bad_input import assert_error

pytestmark = pytest.mark.slow

MSGS = [{"role": "user", "content": "hi"}]
CHAT = {"model": MODEL, "messages": MSGS, "max_tokens": 2}

HOSTILE = {
    "seed 2^64": (
        b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "seed": 18446744073709551616}',
        "seed",
    ),
    "seed -2^63-1": (
        b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "seed": -9223372036854775809}',
        "seed",
    ),
    "310-digit max_tokens": (
        b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": '
        + b"9" * 310
        + b"}",
        "max_tokens",
    ),
    "max_tokens beyond the bound": (
        b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": '
        + str(MAX_TOKENS + 1).encode()
        + b"}",
        "max_tokens",
    ),
    "lone surrogate, streaming": (
        b'{"model": "%s", "stream": true, "messages": [{"role": "user", "content": "a\\ud800b"}]}',
        None,
    ),
    "NaN temperature": (
        b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        None,
    ),
    "Infinity top_p": (
        b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}',
        None,
    ),
    "deeply nested JSON": (b'{"model": "%s", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),
    "stop_token_ids out of range": (
        b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [4294967296]}',
        "stop_token_ids.0",
    ),
    "n over the bound": (
        b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "n": 100000}',
        "n",
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_input_is_a_400_and_the_replica_goes_on(http: httpx.Client, name: str) -> None:
    body, param = HOSTILE[name]
    r = http.post(
        "/v1/chat/completions",
        content=body.replace(b"%s", MODEL.encode()),
        headers={"content-type": "application/json"},
    )
    assert_error(r, 400, param=param)
    assert http.get("/health").status_code == 200
    ok = http.post("/v1/chat/completions", json=CHAT)
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("seed", [INT64_MAX, INT64_MIN, 0])
def test_every_int64_seed_is_served(http: httpx.Client, seed: int) -> None:
    r = http.post("/v1/chat/completions", json={**CHAT, "seed": seed, "n": 2, "temperature": 1.0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2


def test_body_over_the_limit_is_a_413_before_parsing(http: httpx.Client) -> None:
    big = b'{"model": "' + MODEL.encode() + b'", "prompt": "' + b"a" * 70_000 + b'"}'
    assert_error(http.post("/v1/completions", content=big), 413, says="larger")
    assert http.get("/health").status_code == 200
