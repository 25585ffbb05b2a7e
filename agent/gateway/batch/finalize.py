"""A batch's results, turned into what its client downloads: the output file (lines that
succeeded), the error file (the rest), `request_counts` and `usage`.

Pure. A line without a result when the batch ends early (expired, cancelled) goes to the
error file as OpenAI marks it (`batch_expired`, `batch_cancelled`); such lines count as
failed, so `completed + failed == total` once a batch is over.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from fleet_base.batch.models import BatchUsage, LineError, LineResult, RequestCounts, StoredResult
from fleet_base.batch.names import line_request_id

Unfinished = Literal["expired", "cancelled"]
UNFINISHED: dict[str, LineError] = {
    "expired": LineError(
        code="batch_expired",
        message="This request could not be executed before the completion window expired.",
    ),
    "cancelled": LineError(
        code="batch_cancelled", message="This request was not executed because the batch was cancelled."
    ),
}


@dataclass(frozen=True)
class Outcome:
    output: bytes  # JSONL, one line per successful request, in input order
    errors: bytes  # JSONL of failed, expired and cancelled lines, in input order
    request_counts: RequestCounts
    usage: BatchUsage


def tally(results: Iterable[tuple[int, StoredResult]], total: int) -> tuple[RequestCounts, BatchUsage]:
    """Counts and tokens of the results stored so far (what a running batch shows)."""
    completed = failed = prompt = generated = 0
    for _, stored in results:
        if stored.line.ok:
            completed += 1
        else:
            failed += 1
        prompt += stored.prompt_tokens
        generated += stored.completion_tokens
    usage = BatchUsage(input_tokens=prompt, output_tokens=generated, total_tokens=prompt + generated)
    return RequestCounts(total=total, completed=completed, failed=failed), usage


def _jsonl(lines: list[LineResult]) -> bytes:
    return b"".join(
        json.dumps(line.model_dump(mode="json"), ensure_ascii=False).encode() + b"\n" for line in lines
    )


def unfinished_line(batch_id: str, index: int, custom_id: str, unfinished: Unfinished) -> LineResult:
    """The result of a line the batch ended before (`batch_expired`, `batch_cancelled`)."""
    return LineResult(id=line_request_id(batch_id, index), custom_id=custom_id, error=UNFINISHED[unfinished])


def finalize(
    batch_id: str,
    lines: Sequence[tuple[int, str]],
    results: Iterable[tuple[int, StoredResult]],
    unfinished: Unfinished | None = None,
    total: int = 0,
) -> Outcome:
    """`lines`: every line of the input (index, custom_id) in order. With `unfinished`, a
    line without a result is an error line of that kind; without, it is left out (a
    completed batch has a result for every line). `total`: the lines the batch counted
    when it was validated (kept in its record), so the counts hold when the input file
    can no longer be read: a line with no result and no known line counts as failed."""
    by_index = dict(results)
    ok: list[LineResult] = []
    failed: list[LineResult] = []
    order = [i for i, _ in lines] + sorted(set(by_index) - {i for i, _ in lines})
    custom = dict(lines)
    for index in order:
        stored = by_index.get(index)
        if stored is not None:
            (ok if stored.line.ok else failed).append(stored.line)
        elif unfinished is not None:
            failed.append(unfinished_line(batch_id, index, custom.get(index, ""), unfinished))
    counts, usage = tally(by_index.items(), max(total, len(lines), len(by_index)))
    counts = RequestCounts(total=counts.total, completed=len(ok), failed=counts.total - len(ok))
    return Outcome(_jsonl(ok), _jsonl(failed), counts, usage)
