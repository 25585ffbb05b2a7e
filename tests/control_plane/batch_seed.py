"""Batch and async records written straight into a real nats-server's batch store (as
gateways would), for the control plane's batch tests to read back."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import nats

from fleet_base.batch.config import BatchConfig
from fleet_base.batch.models import AsyncRecord, BatchRecord, RequestCounts
from fleet_base.batch.names import new_async_id, new_batch_id
from fleet_base.batch.nats_store import open_batch_store
from fleet_base.batch.resources import ensure_batch_resources
from fleet_base.jetstream_budget import JetStreamBudget

T = TypeVar("T")


def with_store(url: str, use: Callable[[Any], Awaitable[T]]) -> T:
    async def run() -> T:
        nc = await nats.connect(url)
        try:
            return await use(await open_batch_store(nc, BatchConfig()))
        finally:
            await nc.close()

    return asyncio.run(run())


def ensure_resources(url: str) -> None:
    """The buckets and streams, as the control plane and `fleetctl up` create them."""

    async def run() -> None:
        nc = await nats.connect(url)
        try:
            await ensure_batch_resources(nc.jetstream(), JetStreamBudget.from_env())
        finally:
            await nc.close()

    asyncio.run(run())


def batch_record(
    key_id: str, *, created_at: int, status: str = "in_progress", counts: tuple[int, int, int] = (0, 0, 10)
) -> BatchRecord:
    """(completed, failed, total) lines."""
    done, failed, total = counts
    return BatchRecord(
        id=new_batch_id(),
        endpoint="/v1/chat/completions",
        input_file_id="file-input",
        status=status,  # type: ignore[arg-type]
        created_at=created_at,
        expires_at=created_at + 24 * 3600,
        request_counts=RequestCounts(total=total, completed=done, failed=failed),
        key_id=key_id,
        cluster="east",
    )


def async_record(
    key_id: str, *, created_at: int, status: str = "queued", delivery: str = "pending"
) -> AsyncRecord:
    return AsyncRecord(
        id=new_async_id(),
        endpoint="/v1/chat/completions",
        model="tiny",
        status=status,  # type: ignore[arg-type]
        created_at=created_at,
        max_time_in_queue_s=600,
        webhook_url="https://hooks.example.com/done",
        delivery=delivery,  # type: ignore[arg-type]
        key_id=key_id,
    )


def seed_batches(url: str, records: Sequence[BatchRecord]) -> None:
    async def put(store) -> None:
        for record in records:
            await store.create_batch(record)

    with_store(url, put)


def seed_async(url: str, records: Sequence[AsyncRecord]) -> None:
    async def put(store) -> None:
        for record in records:
            await store.create_async(record)

    with_store(url, put)


def store_batch(url: str, batch_id: str) -> BatchRecord:
    async def get(store) -> BatchRecord:
        return (await store.batch(batch_id)).value

    return with_store(url, get)
