"""The part of a `BatchStore` async requests and webhooks use, in memory: CAS revisions on
async records, create-once results, the work queue as a list, and the webhook queue with
nak delays (scaled by `time_scale`) and redelivery counts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from fleet_base.batch.models import AsyncRecord, StoredResult, WorkItem
from fleet_base.batch.store import Conflict, NotFound, Versioned


@dataclass
class QueuedWebhook:
    store: WebhookStore
    request_id: str
    attempt: int
    settled: bool = False

    async def ack(self) -> None:
        assert not self.settled
        self.settled = True
        self.store.acked.append(self.request_id)

    async def nak(self, delay_s: float = 0.0) -> None:
        assert not self.settled
        self.settled = True
        self.store.naks.append(delay_s)
        loop = asyncio.get_running_loop()
        again = QueuedWebhook(self.store, self.request_id, self.attempt + 1)
        loop.call_later(delay_s * self.store.time_scale, self.store.webhooks.put_nowait, again)


@dataclass
class WebhookStore:
    time_scale: float = 1.0
    records: dict[str, Versioned[AsyncRecord]] = field(default_factory=dict)
    results: dict[str, StoredResult] = field(default_factory=dict)
    queued: list[WorkItem] = field(default_factory=list)
    webhooks: asyncio.Queue[QueuedWebhook] = field(default_factory=asyncio.Queue)
    acked: list[str] = field(default_factory=list)
    naks: list[float] = field(default_factory=list)
    revision: int = 0
    down: bool = False  # every call raises, as a store whose NATS is gone
    enqueue_down: bool = False  # only enqueueing raises (the work stream full or away)

    def _up(self) -> None:
        if self.down:
            raise ConnectionError("nats: no servers available")

    async def create_async(self, record: AsyncRecord) -> Versioned[AsyncRecord]:
        self._up()
        self.revision += 1
        v = self.records[record.id] = Versioned(record, self.revision)
        return v

    async def async_request(self, request_id: str) -> Versioned[AsyncRecord]:
        self._up()
        if request_id not in self.records:
            raise NotFound(request_id)
        return self.records[request_id]

    async def update_async(self, record: AsyncRecord, revision: int) -> Versioned[AsyncRecord]:
        self._up()
        if self.records[record.id].revision != revision:
            raise Conflict(record.id)
        return await self.create_async(record)

    async def put_result(self, key: str, result: StoredResult) -> bool:
        if key in self.results:
            return False
        self.results[key] = result
        return True

    async def result(self, key: str) -> StoredResult | None:
        self._up()
        return self.results.get(key)

    async def async_requests(self, key_id: str | None = None) -> list[AsyncRecord]:
        self._up()
        return [v.value for v in self.records.values() if key_id is None or v.value.key_id == key_id]

    async def enqueue(self, items: Sequence[WorkItem]) -> None:
        self._up()
        if self.enqueue_down:
            raise ConnectionError("nats: timeout")
        self.queued.extend(i for i in items if i.id not in {q.id for q in self.queued})

    async def enqueue_webhook(self, request_id: str) -> None:
        self.webhooks.put_nowait(QueuedWebhook(self, request_id, 1))

    async def webhook_deliveries(self) -> AsyncIterator[QueuedWebhook]:
        while True:
            yield await self.webhooks.get()
