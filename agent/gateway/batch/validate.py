"""A batch's input file, read line by line into work items and error lines.

Pure: bytes in, decisions out. A line that is not a valid request becomes an error line
with its reason and line number (the batch still runs the rest); only a file that is not
JSONL at all, empty, or past `BatchConfig.max_lines` fails the whole batch. Whether the
batch's key may use a line's model is the gateway's own check, passed in as
`deployment_of` (model -> deployment, raising the gateway's `OpenAIError`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from fleet_base.batch.config import BatchConfig
from fleet_base.batch.models import (
    BatchError,
    BatchInputLine,
    BatchRecord,
    LineError,
    LineResult,
    StoredResult,
    WorkItem,
)
from fleet_base.batch.names import BATCH_PRIORITY, line_request_id, result_key
from fleet_base.bounds import MAX_BODY_BYTES, InputError, load_json
from fleet_base.openai_contract.errors import OpenAIError

DeploymentOf = Callable[[str], str]
MAX_FILE_ERRORS = 10  # a failed file reports its first few bad lines, as OpenAI does


@dataclass(frozen=True)
class LineProblem:
    code: str
    message: str
    param: str | None = None


@dataclass(frozen=True)
class Validation:
    """What a file holds: every line's (index, custom_id) in file order, the work items of
    its valid lines, the error results of the rest; `errors` non-empty: the batch fails."""

    lines: tuple[tuple[int, str], ...] = ()
    items: tuple[WorkItem, ...] = ()
    rejected: tuple[tuple[int, StoredResult], ...] = ()
    errors: tuple[BatchError, ...] = ()

    @property
    def total(self) -> int:
        return len(self.lines)

    @property
    def failed(self) -> bool:
        return bool(self.errors)


def _numbered_lines(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(0-based index, raw line) of every non-blank line; the index is the line's place in
    the file, so error messages and result keys name the line a person sees."""
    for index, raw in enumerate(data.split(b"\n")):
        raw = raw.rstrip(b"\r")
        if raw.strip():
            yield index, raw


def _pydantic_problem(err: ValidationError) -> LineProblem:
    first = err.errors()[0]
    param = ".".join(str(p) for p in first.get("loc", ())) or None
    kind = first.get("type", "")
    if kind == "missing":
        return LineProblem("missing_required_parameter", f"Missing required parameter: '{param}'", param)
    if kind == "extra_forbidden":
        return LineProblem("unknown_parameter", f"Unrecognized request argument supplied: '{param}'", param)
    if param == "url":
        return LineProblem("invalid_url", f"Invalid url: {first.get('msg')}", param)
    if param == "method":
        return LineProblem("invalid_method", "Only the POST method is supported", param)
    return LineProblem("invalid_value", f"Invalid value for '{param}': {first.get('msg')}", param)


def check_line(
    raw: bytes,
    endpoint: str,
    seen: set[str],
    deployment_of: DeploymentOf,
    max_line_bytes: int = MAX_BODY_BYTES,
) -> tuple[str, BatchInputLine | None, str | None, LineProblem | None]:
    """One line: (its custom_id as far as readable, the request, its deployment, or the
    problem). A readable custom_id is added to `seen`, so a later line reusing it is the
    duplicate, whatever else is wrong with the first."""
    if len(raw) > max_line_bytes:
        return (
            "",
            None,
            None,
            LineProblem("request_too_large", f"The line is larger than {max_line_bytes} bytes"),
        )
    try:
        obj: Any = load_json(raw)
    except InputError as err:
        return "", None, None, LineProblem("invalid_json_line", str(err).replace("request body", "line"))
    if not isinstance(obj, dict):
        return "", None, None, LineProblem("invalid_json_line", "The line is not a JSON object")
    custom_id = obj.get("custom_id") if isinstance(obj.get("custom_id"), str) else ""
    try:
        line = BatchInputLine.model_validate(obj)
    except ValidationError as err:
        return custom_id, None, None, _pydantic_problem(err)
    if line.custom_id in seen:
        return (
            custom_id,
            None,
            None,
            LineProblem(
                "duplicate_custom_id",
                f"The custom_id '{line.custom_id}' is used by an earlier line",
                "custom_id",
            ),
        )
    seen.add(line.custom_id)
    if line.url != endpoint:
        return (
            custom_id,
            None,
            None,
            LineProblem(
                "mismatched_endpoint", f"The url '{line.url}' is not the batch's endpoint '{endpoint}'", "url"
            ),
        )
    model = line.body.get("model")
    if model is None:
        return (
            custom_id,
            None,
            None,
            LineProblem(
                "missing_required_parameter", "Missing required parameter: 'body.model'", "body.model"
            ),
        )
    if not isinstance(model, str) or not model.strip():
        return (
            custom_id,
            None,
            None,
            LineProblem(
                "invalid_value", "body.model must be a non-empty string naming a deployment", "body.model"
            ),
        )
    if line.body.get("stream") is True:
        return (
            custom_id,
            None,
            None,
            LineProblem(
                "unsupported_value",
                "Streaming is not supported in a batch: drop 'stream' or set it false",
                "body.stream",
            ),
        )
    try:
        deployment = deployment_of(model)
    except OpenAIError as err:
        return custom_id, None, None, LineProblem(err.code or "invalid_request", err.message, "body.model")
    return custom_id, line, deployment, None


def error_result(batch_id: str, index: int, custom_id: str, problem: LineProblem) -> StoredResult:
    line = LineResult(
        id=line_request_id(batch_id, index),
        custom_id=custom_id,
        error=LineError(code=problem.code, message=f"Line {index + 1}: {problem.message}"),
    )
    return StoredResult(line=line)


def validate_file(
    data: bytes,
    batch: BatchRecord,
    config: BatchConfig,
    deployment_of: DeploymentOf,
    *,
    now: float,
    window_s: float,
    max_line_bytes: int = MAX_BODY_BYTES,
) -> Validation:
    """The batch's work and error lines, or the reasons its file fails it. `now` stamps the
    work items; a work item dispatched after `created_at + window_s` is expired."""
    if len(data) > config.max_file_bytes:
        return Validation(
            errors=(
                BatchError(
                    code="file_too_large",
                    message=f"The input file is larger than the limit of {config.max_file_bytes} bytes",
                ),
            )
        )
    numbered = list(_numbered_lines(data))
    if not numbered:
        return Validation(errors=(BatchError(code="empty_file", message="The input file has no lines"),))
    if len(numbered) > config.max_lines:
        return Validation(
            errors=(
                BatchError(
                    code="too_many_tasks",
                    message=f"The input file has {len(numbered)} lines; a batch may have at most {config.max_lines}",
                ),
            )
        )
    seen: set[str] = set()
    lines: list[tuple[int, str]] = []
    items: list[WorkItem] = []
    rejected: list[tuple[int, StoredResult]] = []
    not_json: list[BatchError] = []
    for index, raw in numbered:
        custom_id, line, deployment, problem = check_line(
            raw, batch.endpoint, seen, deployment_of, max_line_bytes
        )
        lines.append((index, custom_id))
        if problem is not None:
            if problem.code == "invalid_json_line":
                not_json.append(BatchError(code=problem.code, message=problem.message, line=index + 1))
            rejected.append((index, error_result(batch.id, index, custom_id, problem)))
            continue
        assert line is not None and deployment is not None
        items.append(
            WorkItem(
                id=result_key(batch.id, index),
                kind="batch",
                parent_id=batch.id,
                index=index,
                custom_id=line.custom_id,
                endpoint=line.url,
                body=line.body,
                key_id=batch.key_id,
                deployment=deployment,
                priority=BATCH_PRIORITY,
                enqueued_at=now,
                not_after=batch.created_at + window_s,
            )
        )
    if len(not_json) == len(numbered):  # not one line is JSON: not a JSONL file at all
        head = [
            e.model_copy(update={"message": f"The input file is not JSONL: {e.message}"})
            for e in not_json[:MAX_FILE_ERRORS]
        ]
        return Validation(errors=tuple(head))
    return Validation(lines=tuple(lines), items=tuple(items), rejected=tuple(rejected))
