"""A batch's results into its output and error files: input order, ok lines in the output,
failed lines and (for an early end) the unfinished ones as OpenAI marks them."""

from __future__ import annotations

import json

import pytest

from agent.gateway.batch.finalize import finalize, tally
from fleet_base.batch.models import LineError, LineResponse, LineResult, StoredResult

LINES = [(0, "a"), (2, "b"), (3, "c"), (5, "d")]


def ok(index: int, custom_id: str, tokens: tuple[int, int] = (3, 4)) -> tuple[int, StoredResult]:
    line = LineResult(
        id=f"batch_req_x_{index}",
        custom_id=custom_id,
        response=LineResponse(status_code=200, request_id=f"req-{index}", body={"n": index}),
    )
    return index, StoredResult(line=line, prompt_tokens=tokens[0], completion_tokens=tokens[1])


def http_error(index: int, custom_id: str) -> tuple[int, StoredResult]:
    line = LineResult(
        id=f"batch_req_x_{index}",
        custom_id=custom_id,
        response=LineResponse(status_code=400, request_id="r", body={"error": {"message": "bad"}}),
    )
    return index, StoredResult(line=line, prompt_tokens=1)


def refused(index: int, custom_id: str) -> tuple[int, StoredResult]:
    line = LineResult(id=f"batch_req_x_{index}", custom_id=custom_id, error=LineError(code="c", message="m"))
    return index, StoredResult(line=line)


def rows(data: bytes) -> list[dict]:
    return [json.loads(r) for r in data.splitlines()]


def test_a_completed_batch_splits_ok_and_failed_lines_in_input_order() -> None:
    results = [http_error(5, "d"), ok(2, "b"), refused(3, "c"), ok(0, "a", (10, 20))]
    out = finalize("batch_x", LINES, results)
    assert [r["custom_id"] for r in rows(out.output)] == ["a", "b"]
    assert [r["custom_id"] for r in rows(out.errors)] == ["c", "d"]
    first = rows(out.output)[0]
    assert first == {
        "id": "batch_req_x_0",
        "custom_id": "a",
        "response": {"status_code": 200, "request_id": "req-0", "body": {"n": 0}},
        "error": None,
    }
    assert out.request_counts.model_dump() == {"total": 4, "completed": 2, "failed": 2}
    assert out.usage.model_dump() == {"input_tokens": 14, "output_tokens": 24, "total_tokens": 38}


@pytest.mark.parametrize(("kind", "code"), [("expired", "batch_expired"), ("cancelled", "batch_cancelled")])
def test_an_early_end_returns_the_finished_part_and_marks_the_rest(kind: str, code: str) -> None:
    out = finalize("batch_x", LINES, [ok(2, "b")], kind)  # type: ignore[arg-type]
    assert [r["custom_id"] for r in rows(out.output)] == ["b"]
    errors = rows(out.errors)
    assert [(r["custom_id"], r["id"], r["error"]["code"], r["response"]) for r in errors] == [
        ("a", "batch_req_x_0", code, None),
        ("c", "batch_req_x_3", code, None),
        ("d", "batch_req_x_5", code, None),
    ]
    assert out.request_counts.model_dump() == {"total": 4, "completed": 1, "failed": 3}


def test_empty_parts_are_empty_files() -> None:
    out = finalize("batch_x", [(0, "a")], [ok(0, "a")])
    assert out.errors == b"" and len(rows(out.output)) == 1


def test_tally_counts_a_running_batch() -> None:
    counts, usage = tally([ok(0, "a"), refused(1, "b"), http_error(2, "c")], total=10)
    assert counts.model_dump() == {"total": 10, "completed": 1, "failed": 2}
    assert usage.input_tokens == 4 and usage.output_tokens == 4
