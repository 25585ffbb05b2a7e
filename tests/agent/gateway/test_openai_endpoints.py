"""The gateway's view of /v1/embeddings and /v1/responses: routing facts, accounting, SSE."""

from __future__ import annotations

import json

import pytest

from agent.gateway.contract import accounting_usage
from agent.gateway.errors import GatewayError
from agent.gateway.inputs import parse_request, upstream_body
from agent.gateway.sse import StreamObserver


def test_embeddings_cost_their_prompt_tokens_only() -> None:
    info = parse_request(json.dumps({"model": "d", "input": ["abcdefgh", "abcd"]}).encode(), "embeddings")
    assert (info.prompt_tokens, info.max_tokens, info.sequences) == (3, 0, 2)
    assert info.cost_tokens == 3
    ids = parse_request(json.dumps({"model": "d", "input": [[1, 2, 3], [4]]}).encode(), "embeddings")
    assert ids.prompt_tokens == 4


def test_responses_reserve_max_output_tokens() -> None:
    raw = json.dumps(
        {"model": "d", "input": "abcdefgh", "instructions": "abcd", "max_output_tokens": 9}
    ).encode()
    info = parse_request(raw, "responses")
    assert info.max_tokens == 9 and info.prompt_tokens >= 3
    streamed = parse_request(json.dumps({"model": "d", "input": "x", "stream": True}).encode(), "responses")
    raw2 = json.dumps({"model": "d", "input": "x", "stream": True}).encode()
    assert upstream_body(streamed, raw2) == raw2  # no stream_options: the final event has the usage


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        ("embeddings", {"model": "d", "input": []}, "input"),
        ("responses", {"model": "d", "input": "x", "previous_response_id": "r"}, None),
        (
            "responses",
            {"model": "d", "input": "x", "tools": [{"type": "function", "name": "bad name"}]},
            "tools.0.name",
        ),
    ],
)
def test_contract_refusals_before_any_replica(endpoint: str, body: dict, param: str | None) -> None:
    with pytest.raises(GatewayError) as err:
        parse_request(json.dumps(body).encode(), endpoint)  # type: ignore[arg-type]
    assert err.value.status == 400 and err.value.param == param


def test_accounting_usage_in_chat_terms() -> None:
    assert accounting_usage("responses", {"input_tokens": 5, "output_tokens": 2, "total_tokens": 7}) == {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
    }
    assert accounting_usage("embeddings", {"prompt_tokens": 4, "total_tokens": 4})["completion_tokens"] == 0


def _event(kind: str, **fields: object) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()


def test_stream_observer_reads_responses_events() -> None:
    obs = StreamObserver(strip_usage=True)
    assert obs.observe(_event("response.created", response={"usage": None})) is not None
    assert not obs.first_token and not obs.done
    obs.observe(_event("response.output_text.delta", delta="hi"))
    assert obs.first_token
    usage = {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4}
    out = obs.observe(_event("response.completed", response={"usage": usage}))
    assert out is not None and obs.done and obs.usage == usage  # forwarded untouched
