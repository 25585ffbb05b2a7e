"""Continuation on a real replica: a stream cut at any chunk and continued with the token
ids it carried (`fleet_resume_token_ids`) yields exactly the rest of the uninterrupted run:
greedy and seeded sampling, a stop string that straddles the hand-over, usage counting
the whole request once."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from engine.continuation import step_seed
from fleet_base.openai_contract.continuation import RESUME_FIELD, TOKEN_IDS_FIELD, TOKEN_IDS_HEADER

PROMPT = "The three most useful things to know about the ocean are"
BASE: dict[str, Any] = {
    "model": "smollm2-135m",
    "prompt": PROMPT,
    "max_tokens": 20,
    "stream": True,
    "stream_options": {"include_usage": True},
    "ignore_eos": True,
}


def _stream(http: httpx.Client, body: dict[str, Any]) -> tuple[list[tuple[str, list[int]]], dict, str | None]:
    """(text, token ids) per content chunk, the usage chunk's usage, the finish reason."""
    chunks: list[tuple[str, list[int]]] = []
    usage: dict = {}
    finish = None
    with http.stream("POST", "/v1/completions", json=body, headers={TOKEN_IDS_HEADER: "1"}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            assert "error" not in payload, payload
            if payload.get("usage"):
                usage = payload["usage"]
            for c in payload["choices"]:
                chunks.append((c["text"], c[TOKEN_IDS_FIELD]))
                finish = c["finish_reason"] or finish
    return chunks, usage, finish


def _check_continuations(
    http: httpx.Client, body: dict[str, Any], cuts: list[int], whole: Any = None
) -> list[tuple[str, list[int]]]:
    whole, usage, finish = whole or _stream(http, body)
    text = "".join(t for t, _ in whole)
    assert usage["completion_tokens"] == len([i for _, ids in whole for i in ids])
    for cut in cuts:
        head = whole[:cut]
        resumed = [i for _, ids in head for i in ids]
        rest, rest_usage, rest_finish = _stream(http, {**body, RESUME_FIELD: resumed})
        assert "".join(t for t, _ in head) + "".join(t for t, _ in rest) == text, f"cut at chunk {cut}"
        assert resumed + [i for _, ids in rest for i in ids] == [i for _, ids in whole for i in ids]
        for k in ("prompt_tokens", "completion_tokens", "total_tokens"):  # the whole request, once
            assert rest_usage[k] == usage[k], k
        assert rest_finish == finish
    return whole


@pytest.fixture(scope="module")
def greedy(http: httpx.Client) -> tuple[list[tuple[str, list[int]]], dict, str | None]:
    return _stream(http, {**BASE, "temperature": 0})


def test_greedy_continuation_equals_the_uninterrupted_run(http: httpx.Client, greedy) -> None:
    whole = _check_continuations(http, {**BASE, "temperature": 0}, cuts=[9], whole=greedy)
    assert len(whole) > 12


def test_seeded_continuation_samples_what_the_original_would_have(http: httpx.Client) -> None:
    body = {**BASE, "temperature": 0.9, "seed": 1234}
    whole = _check_continuations(http, body, cuts=[5])
    other, _, _ = _stream(http, {**body, "seed": 4321})
    assert [ids for _, ids in other] != [ids for _, ids in whole]  # the seed matters


def test_stop_string_across_the_hand_over(http: httpx.Client, greedy) -> None:
    whole = greedy[0]
    text = "".join(t for t, _ in whole)
    # a stop string that spans the tokens of chunks 11..13: the replica holds its first
    # characters back, so a cut inside it must not release (or lose) them
    start = len("".join(t for t, _ in whole[:12])) - 2
    stop = text[start : start + 6]
    assert len(stop.strip()) >= 3 and text.find(stop) == start
    body = {**BASE, "temperature": 0, "stop": [stop], "ignore_eos": False}
    stopped = _stream(http, body)
    # cut at the last chunk before the final one: the replica holds back up to len(stop) - 1
    # characters there, and the stop string completes in the continuation's tokens
    cut = len(stopped[0]) - 1
    assert cut >= 2 and stopped[2] == "stop"
    _check_continuations(http, body, cuts=[cut], whole=stopped)
    assert "".join(t for t, _ in stopped[0]) == text[:start]


def test_a_continuation_the_engine_cannot_honour_is_a_400(http: httpx.Client) -> None:
    r = http.post(
        "/v1/completions", json={**BASE, "stream": False, "stream_options": None, "n": 2, RESUME_FIELD: [1]}
    )
    assert r.status_code == 400 and "n = 1" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={**BASE, "max_tokens": 2, RESUME_FIELD: [1, 2]})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


@pytest.mark.parametrize("seed", [0, 1, 2**63 - 1])
def test_step_seeds_are_distinct_and_in_range(seed: int) -> None:
    seeds = {step_seed(seed, k) for k in range(1000)}
    assert len(seeds) == 1000 and all(0 <= s < 2**63 for s in seeds)
    assert step_seed(seed, 5) == step_seed(seed, 5) != step_seed(seed + 1, 5)
