"""A `BatchStore` in memory with the protocol's guarantees (CAS revisions, create-once
results, idempotent enqueue, ack removes), for tests of the code above the store."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleet_base.batch.models import AsyncRecord, BatchRecord, FileRecord, StoredResult, WorkItem
from fleet_base.batch.store import Conflict, NotFound, Versioned


@dataclass
class MemoryDelivery:
    store: MemoryBatchStore
    item: WorkItem
    attempt: int = 1

    async def ack(self) -> None:
        self.store.queue.pop(self.item.id, None)
        self.store.leased.discard(self.item.id)

    async def nak(self, delay_s: float = 0.0) -> None:
        self.store.leased.discard(self.item.id)

    async def in_progress(self) -> None:
        pass


@dataclass
class MemoryBatchStore:
    blobs: dict[str, bytes] = field(default_factory=dict)
    file_records: dict[str, FileRecord] = field(default_factory=dict)
    batch_records: dict[str, Versioned[BatchRecord]] = field(default_factory=dict)
    result_values: dict[str, StoredResult] = field(default_factory=dict)
    async_records: dict[str, Versioned[AsyncRecord]] = field(default_factory=dict)
    queue: dict[str, WorkItem] = field(default_factory=dict)  # insertion order = queue order
    leased: set[str] = field(default_factory=set)
    seen: set[str] = field(default_factory=set)  # the stream's duplicate window
    revision: int = 0
    calls: list[str] = field(default_factory=list)

    def _next(self) -> int:
        self.revision += 1
        return self.revision

    # files
    async def put_file(self, record: FileRecord, data: bytes) -> FileRecord:
        record = record.model_copy(
            update={"blob": record.id, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        )
        self.blobs[record.blob] = data
        self.file_records[record.id] = record
        return record

    async def file(self, file_id: str) -> FileRecord:
        if file_id not in self.file_records:
            raise NotFound(file_id)
        return self.file_records[file_id]

    async def file_content(self, record: FileRecord) -> bytes:
        if record.blob not in self.blobs:
            raise NotFound(record.id)
        return self.blobs[record.blob]

    async def delete_file(self, file_id: str) -> None:
        record = self.file_records.pop(file_id, None)
        if record is None:
            raise NotFound(file_id)
        self.blobs.pop(record.blob, None)

    async def files(self, key_id: str | None = None) -> list[FileRecord]:
        return [f for f in self.file_records.values() if key_id is None or f.key_id == key_id]

    # batches
    async def create_batch(self, record: BatchRecord) -> Versioned[BatchRecord]:
        if record.id in self.batch_records:
            raise Conflict(record.id)
        v = self.batch_records[record.id] = Versioned(record, self._next())
        return v

    async def batch(self, batch_id: str) -> Versioned[BatchRecord]:
        if batch_id not in self.batch_records:
            raise NotFound(batch_id)
        return self.batch_records[batch_id]

    async def update_batch(self, record: BatchRecord, revision: int) -> Versioned[BatchRecord]:
        current = self.batch_records.get(record.id)
        if current is None or current.revision != revision:
            raise Conflict(record.id)
        v = self.batch_records[record.id] = Versioned(record, self._next())
        return v

    async def batches(self, key_id: str | None = None) -> list[BatchRecord]:
        return [v.value for v in self.batch_records.values() if key_id is None or v.value.key_id == key_id]

    # results
    async def put_result(self, key: str, result: StoredResult) -> bool:
        if key in self.result_values:
            return False
        self.result_values[key] = result
        return True

    async def result(self, key: str) -> StoredResult | None:
        return self.result_values.get(key)

    async def results(self, batch_id: str) -> list[tuple[int, StoredResult]]:
        prefix = f"{batch_id}."
        return sorted(
            (int(k.removeprefix(prefix)), r) for k, r in self.result_values.items() if k.startswith(prefix)
        )

    async def result_count(self, batch_id: str) -> int:
        return sum(1 for k in self.result_values if k.startswith(f"{batch_id}."))

    # async requests
    async def create_async(self, record: AsyncRecord) -> Versioned[AsyncRecord]:
        v = self.async_records[record.id] = Versioned(record, self._next())
        return v

    async def async_request(self, request_id: str) -> Versioned[AsyncRecord]:
        if request_id not in self.async_records:
            raise NotFound(request_id)
        return self.async_records[request_id]

    async def update_async(self, record: AsyncRecord, revision: int) -> Versioned[AsyncRecord]:
        current = self.async_records.get(record.id)
        if current is None or current.revision != revision:
            raise Conflict(record.id)
        v = self.async_records[record.id] = Versioned(record, self._next())
        return v

    async def async_requests(self, key_id: str | None = None) -> list[AsyncRecord]:
        return [v.value for v in self.async_records.values() if key_id is None or v.value.key_id == key_id]

    # the work queue
    async def enqueue(self, items: Sequence[WorkItem]) -> None:
        self.calls.append(f"enqueue:{len(items)}")
        for item in items:
            if item.id not in self.seen:
                self.seen.add(item.id)
                self.queue[item.id] = item

    async def pull(self, deployment: str, priority: int, batch: int, timeout_s: float) -> list[Any]:
        out = []
        for item in self.queue.values():
            if len(out) >= batch:
                break
            if item.deployment == deployment and item.priority == priority and item.id not in self.leased:
                self.leased.add(item.id)
                out.append(MemoryDelivery(self, item))
        return out

    async def pending(self, deployment: str) -> int:
        return sum(1 for i in self.queue.values() if i.deployment == deployment)

    async def pending_for(self, parent_id: str) -> int:
        return sum(1 for i in self.queue.values() if i.parent_id == parent_id)

    async def held_with(self, parent_id: str) -> int:
        routes = {(i.deployment, i.priority) for i in self.queue.values() if i.parent_id == parent_id}
        return sum(
            1 for i in self.queue.values() if i.id in self.leased and (i.deployment, i.priority) in routes
        )

    async def purge(self, parent_id: str) -> int:
        gone = [key for key, i in self.queue.items() if i.parent_id == parent_id]
        for key in gone:
            self.queue.pop(key)
        return len(gone)

    async def enqueue_webhook(self, request_id: str) -> None:
        pass

    async def webhook_deliveries(self) -> AsyncIterator[Any]:  # pragma: no cover - unused here
        if False:
            yield None
