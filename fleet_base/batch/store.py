"""The store behind batch and async inference, as the gateways and the control plane see
it. One implementation runs on NATS JetStream (KV buckets, a work-queue stream, and file
contents in a `BlobStore`: JetStream's object store, or S3 by setting); see `names` for
the resources.

Guarantees the callers build on:
- records are updated by compare-and-set on the revision read (`Conflict` otherwise), so
  two gateways driving one batch cannot both move it;
- `put_result` stores a line's result at most once (create-if-absent): the first run of a
  line wins, a re-run after a crash is answered `False` and must not be booked again;
- `enqueue` is idempotent per `WorkItem.id` within the stream's duplicate window, and a
  work item leaves the queue only when its `Delivery` is acknowledged, which a worker does
  after `put_result` returned.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from fleet_base.batch.models import AsyncRecord, BatchRecord, FileRecord, StoredResult, WorkItem


class Conflict(Exception):
    """A compare-and-set lost: someone else updated the record since it was read."""


class NotFound(Exception):
    pass


class Delivery(Protocol):
    """One work item handed to a worker; it stays on the queue (invisible for the ack wait)
    until acknowledged, and comes back to some worker when not."""

    item: WorkItem
    attempt: int  # 1 on the first delivery

    async def ack(self) -> None: ...
    async def nak(self, delay_s: float = 0.0) -> None: ...
    async def in_progress(self) -> None:
        """Extend the ack wait while a long request runs."""
        ...


T = TypeVar("T")


@dataclass(frozen=True)
class Versioned(Generic[T]):
    value: T
    revision: int


class BlobStore(Protocol):
    async def put(self, name: str, data: bytes) -> None: ...
    async def get(self, name: str) -> bytes: ...
    async def delete(self, name: str) -> None: ...


class BatchStore(Protocol):
    # files
    async def put_file(self, record: FileRecord, data: bytes) -> FileRecord: ...
    async def file(self, file_id: str) -> FileRecord: ...  # NotFound
    async def file_content(self, record: FileRecord) -> bytes: ...
    async def delete_file(self, file_id: str) -> None: ...
    async def files(self, key_id: str | None = None) -> list[FileRecord]: ...

    # batches
    async def create_batch(self, record: BatchRecord) -> Versioned[BatchRecord]: ...
    async def batch(self, batch_id: str) -> Versioned[BatchRecord]: ...  # NotFound
    async def update_batch(
        self, record: BatchRecord, revision: int
    ) -> Versioned[BatchRecord]: ...  # Conflict
    async def batches(self, key_id: str | None = None) -> list[BatchRecord]: ...

    # results, once per line
    async def put_result(self, key: str, result: StoredResult) -> bool: ...
    async def result(self, key: str) -> StoredResult | None: ...
    async def results(self, batch_id: str) -> list[tuple[int, StoredResult]]: ...  # (line index, result)
    async def result_count(self, batch_id: str) -> int: ...  # results stored for a batch, none read

    # async requests
    async def create_async(self, record: AsyncRecord) -> Versioned[AsyncRecord]: ...
    async def async_request(self, request_id: str) -> Versioned[AsyncRecord]: ...  # NotFound
    async def update_async(
        self, record: AsyncRecord, revision: int
    ) -> Versioned[AsyncRecord]: ...  # Conflict
    async def async_requests(self, key_id: str | None = None) -> list[AsyncRecord]: ...  # the console's list

    # the work queue
    async def enqueue(self, items: Sequence[WorkItem]) -> None: ...
    async def pull(self, deployment: str, priority: int, batch: int, timeout_s: float) -> list[Delivery]: ...
    async def pending(self, deployment: str) -> int: ...  # items waiting or unacknowledged
    async def pending_for(self, parent_id: str) -> int: ...  # a batch's items still on the queue
    # held by workers (delivered, unacknowledged) on the consumers that carry the parent's
    # items: an upper bound on its own lines in flight, so 0 means none runs
    async def held_with(self, parent_id: str) -> int: ...
    async def purge(self, parent_id: str) -> int: ...  # drops the parent's items, held or not

    # webhook deliveries (a work queue of async request ids)
    async def enqueue_webhook(self, request_id: str) -> None: ...
    def webhook_deliveries(self) -> AsyncIterator[WebhookDelivery]: ...


class WebhookDelivery(Protocol):
    request_id: str
    attempt: int

    async def ack(self) -> None: ...
    async def nak(self, delay_s: float) -> None: ...
