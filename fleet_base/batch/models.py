"""The shapes of batch and async inference: what the OpenAI SDK sends and reads (files,
batches, output lines: exactly OpenAI's), and the records the store keeps behind them
(the same shapes plus the owner key and the driver's claim).

A `*Record` is what the store holds; `.public()` is what a client is shown. A key sees only
records whose `key_id` is its own (checked by the gateway, never by the client's word).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from fleet_base.bounds import Timestamp

BatchEndpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]
BATCH_ENDPOINTS: tuple[str, ...] = BatchEndpoint.__args__  # type: ignore[attr-defined]
BatchStatus = Literal[
    "validating", "in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled"
]
TERMINAL: frozenset[str] = frozenset({"completed", "failed", "expired", "cancelled"})
CANCELLABLE: frozenset[str] = frozenset({"validating", "in_progress"})  # a cancel moves these to cancelling
AsyncStatus = Literal["queued", "in_progress", "succeeded", "failed", "expired", "cancelled"]
ASYNC_TERMINAL: frozenset[str] = frozenset({"succeeded", "failed", "expired", "cancelled"})
DeliveryStatus = Literal["none", "pending", "delivered", "failed"]

CustomId = Annotated[str, StringConstraints(min_length=1, max_length=512)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]
MAX_METADATA_PAIRS = 16
COMPLETION_WINDOWS = {"24h": 24 * 3600.0}  # OpenAI accepts "24h" only


def now() -> float:
    return time.time()


class _Shape(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---------------------------------------------------------------- files


class FileObject(_Shape):
    id: str
    object: Literal["file"] = "file"
    bytes: int = Field(ge=0)
    created_at: int
    filename: str
    purpose: str  # "batch" (input), "batch_output" (output and error files)
    status: str = "processed"
    status_details: str | None = None
    expires_at: int | None = None


class FileRecord(FileObject):
    key_id: str  # owner
    sha256: str = ""
    blob: str = ""  # where the content lives in the blob store (object name or s3 key)

    def public(self) -> FileObject:
        return FileObject.model_validate(self.model_dump(include=set(FileObject.model_fields)))


# ---------------------------------------------------------------- batches


class BatchError(_Shape):
    code: str
    message: str
    param: str | None = None
    line: int | None = None  # 1-based, as OpenAI reports it


class BatchErrors(_Shape):
    object: Literal["list"] = "list"
    data: list[BatchError] = Field(default_factory=list)


class RequestCounts(_Shape):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchUsage(_Shape):
    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0


class BatchObject(_Shape):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: BatchEndpoint
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str = "24h"
    status: BatchStatus = "validating"
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    usage: BatchUsage | None = None
    metadata: dict[str, MetadataValue] | None = None


class DriverClaim(_Shape):
    """Which gateway drives a batch's lifecycle (validate, enqueue, count, finalize) and
    until when: another gateway takes over a claim that lapsed (its holder died)."""

    holder: str  # "<cluster>/<gateway instance>"
    until: Timestamp


class BatchRecord(BatchObject):
    key_id: str  # owner
    claim: DriverClaim | None = None
    enqueued: int = 0  # a file line index: every line below it was queued (or answered) by its driver
    cluster: str = ""  # where it was created

    def public(self) -> BatchObject:
        return BatchObject.model_validate(self.model_dump(include=set(BatchObject.model_fields)))

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


# ---------------------------------------------------------------- lines and results


class BatchInputLine(_Shape):
    """One line of an input file (OpenAI's request input object)."""

    model_config = ConfigDict(extra="forbid")

    custom_id: CustomId
    method: Literal["POST"]
    url: BatchEndpoint
    body: dict[str, Any]


class LineResponse(_Shape):
    status_code: int
    request_id: str
    body: Any


class LineError(_Shape):
    code: str
    message: str


class LineResult(_Shape):
    """One output (or error) file line, exactly OpenAI's shape; a line whose response is not
    2xx, or that has an `error`, goes to the error file. Also the stored result of an async
    request (its `custom_id` is the request id)."""

    id: str
    custom_id: str
    response: LineResponse | None = None
    error: LineError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.response is not None and 200 <= self.response.status_code < 300


class StoredResult(_Shape):
    """What the results bucket holds per line: the line, the tokens booked for it (the
    batch's `usage`), and where and when it ran."""

    line: LineResult
    prompt_tokens: int = Field(0, ge=0)
    completion_tokens: int = Field(0, ge=0)
    cluster: str = ""
    finished_at: Timestamp = Field(default_factory=now)


# ---------------------------------------------------------------- the work queue


class WorkItem(_Shape):
    """One request to run: a batch line or an async request. Its `id` is the message id the
    work stream de-duplicates on, so enqueueing the same line twice queues it once."""

    id: str  # result_key(parent_id, index)
    kind: Literal["batch", "async"]
    parent_id: str  # batch id, or the async request id
    index: int | None = None  # the line's 0-based index in the input file (batch only)
    custom_id: str
    endpoint: BatchEndpoint
    body: dict[str, Any]
    key_id: str
    deployment: str
    priority: int = Field(ge=0, le=2)
    enqueued_at: Timestamp
    not_after: Timestamp  # dispatching after this expires it (batch window, async max time in queue)


# ---------------------------------------------------------------- async requests


class AsyncRequestObject(_Shape):
    """What `GET /v1/async/requests/{id}` answers."""

    id: str
    object: Literal["async.request"] = "async.request"
    endpoint: BatchEndpoint
    model: str
    status: AsyncStatus = "queued"
    priority: int = Field(1, ge=0, le=2)
    created_at: int
    started_at: int | None = None
    finished_at: int | None = None
    max_time_in_queue_s: float
    webhook_url: str | None = None
    delivery: DeliveryStatus = "none"
    delivery_attempts: int = 0
    delivered_at: int | None = None
    result_expires_at: int | None = None
    result: LineResult | None = None


class AsyncRecord(AsyncRequestObject):
    key_id: str
    cluster: str = ""

    def public(self, result: LineResult | None = None) -> AsyncRequestObject:
        data = self.model_dump(include=set(AsyncRequestObject.model_fields))
        data["result"] = result
        return AsyncRequestObject.model_validate(data)
