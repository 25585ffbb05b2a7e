"""The stream ledger: token ids recorded and stripped before the client, the first leg's
identity kept across legs, in-band errors turned into migrations, the continuation body."""

from __future__ import annotations

import json

import pytest

from agent.gateway.errors import GatewayError
from agent.gateway.inputs import parse_request
from agent.gateway.migration import MidstreamFailure, StreamLedger
from fleet_base.openai_contract.continuation import RESUME_FIELD, TOKEN_IDS_FIELD


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _chunk(stream_id: str, text: str, ids: list[int], finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "finish_reason": finish, TOKEN_IDS_FIELD: ids}
    return _event({"id": stream_id, "created": 7 if stream_id == "a" else 9, "choices": [choice]})


def _payload(event: bytes) -> dict:
    return json.loads(event[len(b"data: ") :])


def test_ids_are_recorded_and_stripped_and_later_legs_keep_the_first_identity() -> None:
    ledger = StreamLedger()
    first = _payload(ledger.take(_chunk("a", "Hel", [1, 2]), migrating=True))
    assert TOKEN_IDS_FIELD not in first["choices"][0] and first["choices"][0]["text"] == "Hel"
    later = _payload(ledger.take(_chunk("b", "lo", [3], finish="stop"), migrating=True))
    assert (later["id"], later["created"]) == ("a", 7)
    assert ledger.token_ids == [1, 2, 3] and ledger.finished
    assert ledger.take(b"data: [DONE]\n\n", migrating=True) == b"data: [DONE]\n\n"


def test_a_peer_gateway_gets_the_ids() -> None:
    ledger = StreamLedger(keep_ids=True)
    out = _payload(ledger.take(_chunk("a", "x", [5]), migrating=True))
    assert out["choices"][0][TOKEN_IDS_FIELD] == [5] and ledger.token_ids == [5]


def test_an_in_band_error_migrates_only_when_the_stream_can() -> None:
    error = _event({"error": {"message": "engine died", "code": "request_failed"}})
    with pytest.raises(MidstreamFailure) as info:
        StreamLedger().take(error, migrating=True)
    assert info.value.reason == "error_event"
    assert StreamLedger().take(error, migrating=False) == error


def test_the_continuation_body_carries_the_ids() -> None:
    ledger = StreamLedger(token_ids=[4, 5])
    body = json.loads(ledger.continuation(b'{"model": "m", "prompt": "hi", "stream": true}'))
    assert body == {"model": "m", "prompt": "hi", "stream": True, RESUME_FIELD: [4, 5]}


def test_a_forwarded_continuation_starts_from_its_resumed_ids() -> None:
    body = {"model": "m", "prompt": "hi", "stream": True, RESUME_FIELD: [1, 2]}
    ledger = StreamLedger.of(parse_request(json.dumps(body).encode(), "completions"), keep_ids=True)
    ledger.take(_chunk("a", "x", [3]), migrating=True)
    assert json.loads(ledger.continuation(json.dumps(body).encode()))[RESUME_FIELD] == [1, 2, 3]


@pytest.mark.parametrize(
    ("body", "endpoint", "expected"),
    [
        ({"model": "m", "prompt": "hi", "stream": True}, "completions", True),
        ({"model": "m", "prompt": "hi", "stream": False}, "completions", False),
        ({"model": "m", "prompt": ["a", "b"], "stream": True}, "completions", False),
        ({"model": "m", "prompt": "hi", "stream": True, "n": 2}, "completions", False),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}, "chat", True),
    ],
)
def test_what_can_migrate(body: dict, endpoint: str, expected: bool) -> None:
    assert parse_request(json.dumps(body).encode(), endpoint).migratable is expected


def test_a_client_cannot_send_a_continuation() -> None:
    body = {"model": "m", "prompt": "hi", RESUME_FIELD: [1]}
    info = parse_request(json.dumps(body).encode(), "completions")
    with pytest.raises(GatewayError) as err:
        info.refuse_client_resume(forwarded=False)
    assert err.value.status == 400
    info.refuse_client_resume(forwarded=True)  # a peer gateway's is fine


def test_a_stream_whose_chunks_carry_no_ids_is_not_continuable() -> None:
    """A foreign engine's replica ignores the ids header: text without ids cannot be resumed
    (the continuation would repeat what the client already has)."""
    ledger = StreamLedger()
    ledger.take(_event({"id": "a", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}), True)
    assert not ledger.untracked  # a role-only chunk carries no output
    ledger.take(_event({"id": "a", "choices": [{"index": 0, "delta": {"content": "Hi"}}]}), True)
    assert ledger.untracked and ledger.token_ids == []
    tracked = StreamLedger()
    tracked.take(_chunk("a", "Hi", [7]), True)
    assert not tracked.untracked
