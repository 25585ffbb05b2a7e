"""Validating a batch input file: each malformed line is an error line with its reason and
line number, the rest are work items; only an empty, oversized or non-JSONL file fails."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.gateway.batch.validate import validate_file
from agent.gateway.errors import GatewayError
from fleet_base.batch.config import BatchConfig
from fleet_base.batch.models import BatchRecord
from fleet_base.batch.names import BATCH_PRIORITY, result_key

BATCH = BatchRecord(
    id="batch_abc", endpoint="/v1/chat/completions", input_file_id="file-1", created_at=1000, key_id="k1"
)
CONFIG = BatchConfig(max_lines=5)


def deployment_of(model: str) -> str:
    if model == "forbidden":
        raise GatewayError(403, "not allowed that model", code="model_not_allowed")
    if model == "ghost":
        raise GatewayError(404, "no such model", code="model_not_found")
    return model.removesuffix(":lora")  # an adapter resolves to its deployment


def line(custom_id: object = "a", url: str = "/v1/chat/completions", **body: object) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": url,
        "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **body},
    }


def jsonl(*rows: object) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


def run(data: bytes, config: BatchConfig = CONFIG):
    return validate_file(data, BATCH, config, deployment_of, now=1001.0, window_s=60.0)


GOOD = line("ok")

# (second line of a file whose first line is GOOD, expected error code, text in the message)
BAD_LINES = [
    (b"{not json", "invalid_json_line", "not valid JSON"),
    (b"[1, 2]", "invalid_json_line", "not a JSON object"),
    (
        {"method": "POST", "url": "/v1/chat/completions", "body": {"model": "tiny"}},
        "missing_required_parameter",
        "custom_id",
    ),
    (
        {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions"},
        "missing_required_parameter",
        "body",
    ),
    ({**line("b"), "method": "GET"}, "invalid_method", "POST"),
    (line("b", url="/v1/images"), "invalid_url", "url"),
    (line("b", url="/v1/embeddings"), "mismatched_endpoint", "/v1/embeddings"),
    (line("ok"), "duplicate_custom_id", "'ok'"),
    ({**line("b"), "extra": 1}, "unknown_parameter", "extra"),
    (
        {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}},
        "missing_required_parameter",
        "body.model",
    ),
    (line("b", model=7), "invalid_value", "body.model"),
    (line("b", stream=True), "unsupported_value", "stream"),
    (line("b", model="forbidden"), "model_not_allowed", "not allowed"),
    (line("b", model="ghost"), "model_not_found", "no such model"),
    ({**line("b"), "body": "text"}, "invalid_value", "body"),
    (line(""), "invalid_value", "custom_id"),
    (b'{"custom_id": "b", "x": NaN}', "invalid_json_line", "NaN"),
]


@pytest.mark.parametrize(("bad", "code", "reason"), BAD_LINES)
def test_a_bad_line_is_an_error_line_with_its_reason(bad: object, code: str, reason: str) -> None:
    v = run(jsonl(GOOD, bad))
    assert not v.failed
    assert v.total == 2
    assert [i.custom_id for i in v.items] == ["ok"]
    [(index, stored)] = v.rejected
    assert index == 1
    assert stored.line.error is not None and stored.line.response is None
    assert stored.line.error.code == code
    assert stored.line.error.message.startswith("Line 2: ")
    assert reason in stored.line.error.message
    assert stored.line.id == "batch_req_abc_1"
    assert not stored.line.ok


def test_valid_lines_become_work_items() -> None:
    v = run(jsonl(line("a"), line("b", model="tiny:lora"), line("c", stream=False)))
    assert not v.failed and not v.rejected
    assert [(i.index, i.custom_id, i.deployment) for i in v.items] == [
        (0, "a", "tiny"),
        (1, "b", "tiny"),
        (2, "c", "tiny"),
    ]
    first = v.items[0]
    assert first.id == result_key("batch_abc", 0)
    assert first.parent_id == "batch_abc" and first.kind == "batch" and first.key_id == "k1"
    assert first.priority == BATCH_PRIORITY
    assert first.not_after == 1060.0 and first.enqueued_at == 1001.0
    assert v.items[1].body["model"] == "tiny:lora"  # the client's model goes upstream as sent


def test_blank_lines_are_skipped_and_indices_follow_the_file() -> None:
    data = jsonl(line("a")) + b"\n   \r\n" + jsonl(line("b")).replace(b"\n", b"\r\n")
    v = run(data)
    assert v.lines == ((0, "a"), (3, "b"))
    assert [i.index for i in v.items] == [0, 3]


def test_a_malformed_line_keeps_its_custom_id_when_readable() -> None:
    v = run(jsonl(GOOD, line("mine", url="/v1/embeddings")))
    assert v.rejected[0][1].line.custom_id == "mine"
    assert v.lines == ((0, "ok"), (1, "mine"))


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"", "empty_file"),
        (b"\n \n\r\n", "empty_file"),
        (jsonl(*(line(str(i)) for i in range(6))), "too_many_tasks"),
        (b"hello\nworld\n", "invalid_json_line"),
        (b"\x89PNG\r\n\x1a\n\x00\x00", "invalid_json_line"),
    ],
)
def test_a_file_that_is_not_a_batch_fails_it(data: bytes, code: str) -> None:
    v = run(data)
    assert v.failed
    assert {e.code for e in v.errors} == {code}
    assert not v.items and not v.rejected


def test_a_non_jsonl_file_names_its_lines() -> None:
    v = run(b"hello\n\nworld\n")
    assert [e.line for e in v.errors] == [1, 3]
    assert all("not JSONL" in e.message for e in v.errors)


def test_an_oversized_file_or_line_is_refused() -> None:
    big = jsonl(line("a", pad="x" * 2000))
    assert run(big, BatchConfig(max_file_bytes=1024)).errors[0].code == "file_too_large"
    v = validate_file(
        jsonl(GOOD, line("b", pad="x" * 500)),
        BATCH,
        CONFIG,
        deployment_of,
        now=0,
        window_s=1,
        max_line_bytes=300,
    )
    assert v.rejected[0][1].line.error.code == "request_too_large"


@given(
    st.lists(
        st.one_of(st.binary(max_size=40), st.sampled_from([json.dumps(GOOD).encode(), b"{}", b"[]"])),
        max_size=8,
    )
)
def test_every_line_is_accounted_for_exactly_once(rows: list[bytes]) -> None:
    data = b"\n".join(rows)
    v = validate_file(data, BATCH, BatchConfig(max_lines=50), deployment_of, now=0, window_s=1)
    if v.failed:
        assert not v.items and not v.rejected
        return
    indices = [i.index for i in v.items] + [i for i, _ in v.rejected]
    assert sorted(indices) == [i for i, _ in v.lines]
    assert len(set(indices)) == len(indices)
