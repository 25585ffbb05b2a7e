"""`BatchStore` on NATS JetStream: records in KV buckets (compare-and-set on the revision),
results created once, work items in a work-queue stream with one durable pull consumer per
(deployment, priority) that every gateway serving the deployment shares, file contents in a
`BlobStore`. The resources are created by the control plane (`resources`); this binds.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, ConsumerInfo, DeliverPolicy
from nats.js.errors import APIError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue
from pydantic import BaseModel, ValidationError

from fleet_base.batch import names
from fleet_base.batch.blobs import blob_store
from fleet_base.batch.config import BatchConfig
from fleet_base.batch.models import AsyncRecord, BatchRecord, FileRecord, StoredResult, WorkItem
from fleet_base.batch.store import BlobStore, Conflict, NotFound, Versioned
from fleet_base.nats_io import kv_values

M = TypeVar("M", bound=BaseModel)
MSG_ID = "Nats-Msg-Id"
MAX_ACK_PENDING = 20_000  # items held by all workers together, per consumer
# a consumer nobody pulled from this long (its deployment is gone) is removed by the server;
# its items stay on the stream and a new consumer (DeliverPolicy.ALL) hands them out again
CONSUMER_IDLE_S = 7 * 24 * 3600.0
PUBLISH_WINDOW = 256  # enqueue publishes in flight at once


@dataclass
class NatsDelivery:
    item: WorkItem
    attempt: int
    msg: Msg

    async def ack(self) -> None:
        """Acknowledged once the server confirms: only then is the item off the queue."""
        await self.msg.ack_sync(timeout=5.0)

    async def nak(self, delay_s: float = 0.0) -> None:
        await self.msg.nak(delay=delay_s if delay_s > 0 else None)

    async def in_progress(self) -> None:
        await self.msg.in_progress()


@dataclass
class NatsWebhookDelivery:
    request_id: str
    attempt: int
    msg: Msg

    async def ack(self) -> None:
        await self.msg.ack_sync(timeout=5.0)

    async def nak(self, delay_s: float) -> None:
        await self.msg.nak(delay=delay_s if delay_s > 0 else None)


class NatsBatchStore:
    def __init__(
        self,
        js: JetStreamContext,
        config: BatchConfig,
        blobs: BlobStore,
        buckets: dict[str, KeyValue],
    ) -> None:
        self.js = js
        self.config = config
        self.blobs = blobs
        self._files = buckets[names.BUCKET_FILES]
        self._batches = buckets[names.BUCKET_BATCHES]
        self._results = buckets[names.BUCKET_RESULTS]
        self._async = buckets[names.BUCKET_ASYNC]
        self._subs: dict[str, JetStreamContext.PullSubscription] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    # ------------------------------------------------------------ records

    @staticmethod
    async def _get(kv: KeyValue, key: str, model: type[M]) -> Versioned[M]:
        try:
            entry = await kv.get(key)
        except NotFoundError as err:  # absent or deleted
            raise NotFound(key) from err
        if entry.value is None:
            raise NotFound(key)
        return Versioned(model.model_validate_json(entry.value), entry.revision or 0)

    @staticmethod
    async def _create(kv: KeyValue, key: str, record: M) -> Versioned[M]:
        try:
            revision = await kv.create(key, record.model_dump_json().encode())
        except KeyWrongLastSequenceError as err:
            raise Conflict(key) from err
        return Versioned(record, revision)

    @staticmethod
    async def _update(kv: KeyValue, key: str, record: M, revision: int) -> Versioned[M]:
        try:
            new = await kv.update(key, record.model_dump_json().encode(), last=revision)
        except KeyWrongLastSequenceError as err:
            raise Conflict(key) from err
        return Versioned(record, new)

    async def _values(self, bucket: str, keys: str, model: type[M]) -> list[tuple[str, M]]:
        """Every live (key, value) under the key pattern, read in one pass (`kv_values`)."""
        found = await kv_values(self.js, bucket, keys)
        return [(key, model.model_validate_json(value)) for key, value, _ in found if value]

    # ------------------------------------------------------------ files

    async def put_file(self, record: FileRecord, data: bytes) -> FileRecord:
        record = record.model_copy(update={"blob": record.blob or record.id})
        await self.blobs.put(record.blob, data)
        await self._create(self._files, record.id, record)
        return record

    async def file(self, file_id: str) -> FileRecord:
        return (await self._get(self._files, file_id, FileRecord)).value

    async def file_content(self, record: FileRecord) -> bytes:
        return await self.blobs.get(record.blob or record.id)

    async def delete_file(self, file_id: str) -> None:
        record = await self.file(file_id)
        await self.blobs.delete(record.blob or record.id)
        await self._files.delete(file_id)

    async def files(self, key_id: str | None = None) -> list[FileRecord]:
        records = [r for _, r in await self._values(names.BUCKET_FILES, ">", FileRecord)]
        return [r for r in records if key_id is None or r.key_id == key_id]

    # ------------------------------------------------------------ batches

    async def create_batch(self, record: BatchRecord) -> Versioned[BatchRecord]:
        return await self._create(self._batches, record.id, record)

    async def batch(self, batch_id: str) -> Versioned[BatchRecord]:
        return await self._get(self._batches, batch_id, BatchRecord)

    async def update_batch(self, record: BatchRecord, revision: int) -> Versioned[BatchRecord]:
        return await self._update(self._batches, record.id, record, revision)

    async def batches(self, key_id: str | None = None) -> list[BatchRecord]:
        records = [r for _, r in await self._values(names.BUCKET_BATCHES, ">", BatchRecord)]
        return [r for r in records if key_id is None or r.key_id == key_id]

    # ------------------------------------------------------------ results

    async def put_result(self, key: str, result: StoredResult) -> bool:
        try:
            await self._results.create(key, result.model_dump_json().encode())
        except KeyWrongLastSequenceError:
            return False
        return True

    async def result(self, key: str) -> StoredResult | None:
        try:
            return (await self._get(self._results, key, StoredResult)).value
        except NotFound:
            return None

    async def results(self, batch_id: str) -> list[tuple[int, StoredResult]]:
        found = await self._values(names.BUCKET_RESULTS, f"{batch_id}.*", StoredResult)
        return sorted((int(key.rsplit(".", 1)[1]), result) for key, result in found)

    async def result_count(self, batch_id: str) -> int:
        """How many lines of a batch have a result, counted by the server (one subject per
        stored key) without reading any: what the driver polls while a batch runs."""
        bucket = names.BUCKET_RESULTS
        info = await self.js.stream_info(f"KV_{bucket}", subjects_filter=f"$KV.{bucket}.{batch_id}.*")
        return len(info.state.subjects or {})

    # ------------------------------------------------------------ async requests

    async def create_async(self, record: AsyncRecord) -> Versioned[AsyncRecord]:
        return await self._create(self._async, record.id, record)

    async def async_request(self, request_id: str) -> Versioned[AsyncRecord]:
        return await self._get(self._async, request_id, AsyncRecord)

    async def update_async(self, record: AsyncRecord, revision: int) -> Versioned[AsyncRecord]:
        return await self._update(self._async, record.id, record, revision)

    async def async_requests(self, key_id: str | None = None) -> list[AsyncRecord]:
        records = [r for _, r in await self._values(names.BUCKET_ASYNC, ">", AsyncRecord)]
        return [r for r in records if key_id is None or r.key_id == key_id]

    # ------------------------------------------------------------ the work queue

    async def enqueue(self, items: Sequence[WorkItem]) -> None:
        """Publish each item with its id as the message id: the stream drops a repeat
        within its duplicate window. Waits for every publish's acknowledgement."""
        for start in range(0, len(items), PUBLISH_WINDOW):
            await asyncio.gather(
                *(
                    self.js.publish(
                        names.work_subject(item.deployment, item.priority, item.parent_id),
                        item.model_dump_json().encode(),
                        stream=names.STREAM_WORK,
                        headers={MSG_ID: item.id},
                    )
                    for item in items[start : start + PUBLISH_WINDOW]
                )
            )

    async def _consumer(self, stream: str, name: str, subject: str) -> ConsumerInfo:
        """The durable pull consumer, created if absent; an existing one is left as it is
        (every gateway creates it with the same settings, and the server accepts that)."""
        try:
            return await self.js.consumer_info(stream, name)
        except NotFoundError:
            pass
        return await self.js.add_consumer(
            stream,
            ConsumerConfig(
                name=name,
                durable_name=name,
                filter_subject=subject,
                ack_policy=AckPolicy.EXPLICIT,
                ack_wait=self.config.ack_wait_s,
                max_deliver=-1,
                deliver_policy=DeliverPolicy.ALL,
                max_ack_pending=MAX_ACK_PENDING,
                inactive_threshold=CONSUMER_IDLE_S,
            ),
        )

    async def _subscription(self, stream: str, name: str, subject: str) -> JetStreamContext.PullSubscription:
        sub = self._subs.get(name)
        if sub is None:
            await self._consumer(stream, name, subject)
            sub = await self.js.pull_subscribe_bind(durable=name, stream=stream)
            self._subs[name] = sub
        return sub

    async def _fetch(self, stream: str, name: str, subject: str, batch: int, timeout_s: float) -> list[Msg]:
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:  # one fetch at a time per subscription
            sub = await self._subscription(stream, name, subject)
            try:
                return await sub.fetch(batch, timeout=timeout_s)
            except (NatsTimeout, asyncio.TimeoutError):
                return []
            except APIError:  # the consumer (or stream) went away: bind afresh next time
                self._subs.pop(name, None)
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
                raise

    async def pull(self, deployment: str, priority: int, batch: int, timeout_s: float) -> list[NatsDelivery]:
        msgs = await self._fetch(
            names.STREAM_WORK,
            names.work_consumer(deployment, priority),
            names.work_filter(deployment, priority),
            batch,
            timeout_s,
        )
        out: list[NatsDelivery] = []
        for msg in msgs:
            try:
                item = WorkItem.model_validate_json(msg.data)
            except ValidationError:
                await msg.term()  # never runnable: would otherwise come back forever
                continue
            out.append(NatsDelivery(item, msg.metadata.num_delivered, msg))
        return out

    async def pending(self, deployment: str) -> int:
        """Items of `deployment` waiting or held by a worker, over its priority consumers
        (created here when absent, so a backlog counts before any worker pulled)."""
        total = 0
        for priority in names.PRIORITIES:
            name = names.work_consumer(deployment, priority)
            info = await self._consumer(names.STREAM_WORK, name, names.work_filter(deployment, priority))
            total += (info.num_pending or 0) + (info.num_ack_pending or 0)
        return total

    async def pending_for(self, parent_id: str) -> int:
        """Items of one batch (or async request) still on the queue: a work-queue stream
        holds exactly the unacknowledged ones."""
        info = await self.js.stream_info(names.STREAM_WORK, subjects_filter=names.parent_filter(parent_id))
        return sum((info.state.subjects or {}).values())

    async def _parent_subjects(self, parent_id: str) -> dict[str, int]:
        info = await self.js.stream_info(names.STREAM_WORK, subjects_filter=names.parent_filter(parent_id))
        return dict(info.state.subjects or {})

    async def held_with(self, parent_id: str) -> int:
        """Items held by a worker on each (deployment, priority) consumer that carries one of
        the parent's items: the consumer does not say whose they are."""
        held = 0
        for subject in await self._parent_subjects(parent_id):
            deployment, priority = names.work_route(subject)
            name = names.work_consumer(deployment, priority)
            info = await self._consumer(names.STREAM_WORK, name, names.work_filter(deployment, priority))
            held += info.num_ack_pending or 0
        return held

    async def purge(self, parent_id: str) -> int:
        """Drops the parent's items from the work queue, held ones too (a worker's later ack
        of one is a no-op); returns how many were there."""
        count = sum((await self._parent_subjects(parent_id)).values())
        if count:
            await self.js.purge_stream(names.STREAM_WORK, subject=names.parent_filter(parent_id))
        return count

    # ------------------------------------------------------------ webhooks

    async def enqueue_webhook(self, request_id: str) -> None:
        await self.js.publish(
            names.WEBHOOK_SUBJECT,
            request_id.encode(),
            stream=names.STREAM_WEBHOOKS,
            headers={MSG_ID: f"webhook.{request_id}"},
        )

    async def webhook_deliveries(self) -> AsyncIterator[NatsWebhookDelivery]:
        while True:
            msgs = await self._fetch(
                names.STREAM_WEBHOOKS, names.WEBHOOK_CONSUMER, names.WEBHOOK_SUBJECT, 16, 5.0
            )
            for msg in msgs:
                yield NatsWebhookDelivery(msg.data.decode(), msg.metadata.num_delivered, msg)


async def open_batch_store(nc: NATS, config: BatchConfig) -> NatsBatchStore:
    """Bind the buckets the control plane created (`resources.ensure_batch_resources`);
    raises NotFound naming what is missing, creates nothing."""
    js = nc.jetstream()
    buckets: dict[str, KeyValue] = {}
    for bucket in (names.BUCKET_FILES, names.BUCKET_BATCHES, names.BUCKET_RESULTS, names.BUCKET_ASYNC):
        try:
            buckets[bucket] = await js.key_value(bucket)
        except NotFoundError as err:
            raise NotFound(f"KV bucket {bucket}") from err
    try:
        blobs = await blob_store(js, config)
    except NotFoundError as err:
        raise NotFound(f"object store {names.OBJECT_BUCKET_FILES}") from err
    return NatsBatchStore(js, config, blobs, buckets)
