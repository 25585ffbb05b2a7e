"""NatsBatchStore against a real nats-server: the guarantees of `fleet_base.batch.store`
(compare-and-set, results created once, idempotent enqueue, ack after store, redelivery),
the queue counts, both blob stores, and a server restart losing nothing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from nats.js.api import AckPolicy, RetentionPolicy

from control_plane.local.nats_server import NatsServer
from fleet_base.batch import names
from fleet_base.batch.blobs import S3Blobs
from fleet_base.batch.config import BatchConfig
from fleet_base.batch.models import AsyncRecord, BatchRecord, FileRecord, LineResult, StoredResult, WorkItem
from fleet_base.batch.nats_store import CONSUMER_IDLE_S, NatsBatchStore, open_batch_store
from fleet_base.batch.resources import ensure_batch_resources
from fleet_base.batch.store import Conflict, NotFound
from fleet_base.jetstream_budget import JetStreamBudget
from tests.fleet_base.models.conftest import s3, s3_server  # noqa: F401 (fixtures)

BUDGET = JetStreamBudget(store_bytes=256 << 20)


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[NatsServer]:
    s = NatsServer(tmp_path / "nats").start()
    yield s
    s.stop()


async def _open(url: str, config: BatchConfig) -> tuple[nats.NATS, NatsBatchStore]:
    nc = await nats.connect(url)
    return nc, await open_batch_store(nc, config)


@pytest.fixture()
async def store(server: NatsServer) -> AsyncIterator[NatsBatchStore]:
    nc = await nats.connect(server.url)
    await ensure_batch_resources(nc.jetstream(), BUDGET)
    yield await open_batch_store(nc, BatchConfig(ack_wait_s=1.0))
    await nc.close()


def item(parent: str, index: int, deployment: str = "d1", priority: int = 2) -> WorkItem:
    return WorkItem(
        id=names.result_key(parent, index),
        kind="batch",
        parent_id=parent,
        index=index,
        custom_id=f"c{index}",
        endpoint="/v1/chat/completions",
        body={"model": deployment, "messages": [{"role": "user", "content": "hi"}]},
        key_id="k1",
        deployment=deployment,
        priority=priority,
        enqueued_at=time.time(),
        not_after=time.time() + 3600,
    )


def result(custom_id: str) -> StoredResult:
    return StoredResult(line=LineResult(id="r", custom_id=custom_id))


def batch_record(batch_id: str = "batch_1", key_id: str = "k1") -> BatchRecord:
    return BatchRecord(
        id=batch_id, endpoint="/v1/chat/completions", input_file_id="file-1", created_at=1, key_id=key_id
    )


async def test_open_binds_only(server: NatsServer) -> None:
    nc = await nats.connect(server.url)
    with pytest.raises(NotFound):
        await open_batch_store(nc, BatchConfig())
    await nc.close()


async def test_batch_update_is_compare_and_set(store: NatsBatchStore) -> None:
    created = await store.create_batch(batch_record())
    with pytest.raises(Conflict):
        await store.create_batch(batch_record())
    moved = await store.update_batch(
        created.value.model_copy(update={"status": "in_progress"}), created.revision
    )
    with pytest.raises(Conflict):  # a second writer holding the old revision loses
        await store.update_batch(created.value.model_copy(update={"status": "cancelling"}), created.revision)
    got = await store.batch("batch_1")
    assert got.value.status == "in_progress" and got.revision == moved.revision
    await store.create_batch(batch_record("batch_2", key_id="k2"))
    assert {b.id for b in await store.batches("k2")} == {"batch_2"}
    assert {b.id for b in await store.batches()} == {"batch_1", "batch_2"}
    with pytest.raises(NotFound):
        await store.batch("batch_missing")


async def test_async_record_compare_and_set(store: NatsBatchStore) -> None:
    record = AsyncRecord(
        id="async_1",
        endpoint="/v1/chat/completions",
        model="m",
        created_at=1,
        max_time_in_queue_s=60,
        key_id="k",
    )
    created = await store.create_async(record)
    await store.update_async(record.model_copy(update={"status": "in_progress"}), created.revision)
    with pytest.raises(Conflict):
        await store.update_async(record.model_copy(update={"status": "cancelled"}), created.revision)
    assert (await store.async_request("async_1")).value.status == "in_progress"
    other = record.model_copy(update={"id": "async_2", "key_id": "k2"})
    await store.create_async(other)
    assert {r.id for r in await store.async_requests("k2")} == {"async_2"}
    assert {(r.id, r.status) for r in await store.async_requests()} == {
        ("async_1", "in_progress"),
        ("async_2", "queued"),
    }


async def test_put_result_once_under_concurrency(store: NatsBatchStore) -> None:
    outcomes = await asyncio.gather(*(store.put_result("batch_1.7", result(f"run{i}")) for i in range(20)))
    assert outcomes.count(True) == 1
    winner = outcomes.index(True)
    assert (await store.result("batch_1.7")).line.custom_id == f"run{winner}"
    assert await store.result("batch_1.8") is None


async def test_results_lists_one_batch_in_line_order(store: NatsBatchStore) -> None:
    for index in (10, 2, 1):
        await store.put_result(names.result_key("batch_a", index), result(f"a{index}"))
    await store.put_result(names.result_key("batch_ab", 0), result("other"))  # a prefix of another id
    await store.put_result(names.result_key("batch_a", None), result("async"))
    listed = await store.results("batch_a")
    assert [(i, r.line.custom_id) for i, r in listed] == [(1, "a1"), (2, "a2"), (10, "a10")]
    assert await store.results("batch_none") == []


async def test_enqueue_dedupes_and_pending_counts(store: NatsBatchStore) -> None:
    items = [item("batch_1", i) for i in range(5)]
    await store.enqueue(items)
    await store.enqueue(items[:3])  # a driver re-enqueueing after a crash
    await store.enqueue([item("batch_2", 0, priority=0), item("batch_3", 0, deployment="d2")])
    assert await store.pending("d1") == 6
    assert await store.pending("d2") == 1
    assert await store.pending_for("batch_1") == 5
    got = await store.pull("d1", 2, 10, 1.0)
    assert sorted(d.item.index for d in got) == [0, 1, 2, 3, 4]
    assert await store.pending("d1") == 6  # held, not yet acknowledged
    for d in got[:2]:
        await d.ack()
    assert await store.pending("d1") == 4
    assert await store.pending_for("batch_1") == 3
    assert [d.item.parent_id for d in await store.pull("d1", 0, 10, 1.0)] == ["batch_2"]


async def test_purge_drops_one_parents_items_held_or_not(store: NatsBatchStore) -> None:
    await store.enqueue([item("batch_1", i) for i in range(4)] + [item("batch_1", 9, deployment="d2")])
    await store.enqueue([item("batch_2", 0), item("batch_3", 0, deployment="d3")])
    assert await store.held_with("batch_1") == 0  # queued, none delivered
    (held,) = await store.pull("d1", 2, 1, 1.0)
    assert held.item.parent_id == "batch_1"
    assert await store.held_with("batch_1") == 1 and await store.held_with("batch_3") == 0
    assert await store.purge("batch_1") == 5
    assert await store.pending_for("batch_1") == 0 and await store.purge("batch_1") == 0
    await held.ack()  # the worker's ack of a purged item is harmless
    assert (
        await store.pending("d1") == 1 and await store.pending("d2") == 0 and await store.pending("d3") == 1
    )
    assert [d.item.parent_id for d in await store.pull("d1", 2, 10, 1.0)] == ["batch_2"]
    assert await store.held_with("batch_1") == 0


async def test_unacked_item_comes_back_after_ack_wait(store: NatsBatchStore) -> None:
    await store.enqueue([item("batch_1", 0)])
    (first,) = await store.pull("d1", 2, 1, 1.0)
    assert first.attempt == 1
    assert await store.pull("d1", 2, 1, 0.3) == []  # invisible while held
    again = await store.pull("d1", 2, 1, 3.0)  # ack wait is 1 s
    assert [d.attempt for d in again] == [2] and again[0].item == first.item
    await again[0].ack()
    assert await store.pending_for("batch_1") == 0
    assert await store.pull("d1", 2, 1, 1.5) == []


async def test_in_progress_extends_the_hold(store: NatsBatchStore) -> None:
    await store.enqueue([item("batch_1", 0)])
    (held,) = await store.pull("d1", 2, 1, 1.0)
    for _ in range(8):
        await asyncio.sleep(0.25)
        await held.in_progress()
    assert await store.pull("d1", 2, 1, 0.5) == []  # 2.5 s held, ack wait 1 s
    await held.ack()


async def test_nak_with_delay(store: NatsBatchStore) -> None:
    await store.enqueue([item("batch_1", 0)])
    (first,) = await store.pull("d1", 2, 1, 1.0)
    await first.nak(0.6)
    started = time.monotonic()
    assert await store.pull("d1", 2, 1, 0.3) == []
    (again,) = await store.pull("d1", 2, 1, 2.0)
    assert time.monotonic() - started >= 0.5 and again.attempt == 2
    await again.nak()
    (third,) = await store.pull("d1", 2, 1, 0.5)
    assert third.attempt == 3


async def test_webhook_queue(store: NatsBatchStore) -> None:
    await store.enqueue_webhook("async_1")
    await store.enqueue_webhook("async_1")  # the worker's re-run after a crash
    await store.enqueue_webhook("async_2")
    deliveries = store.webhook_deliveries()
    first = await anext(deliveries)
    second = await anext(deliveries)
    assert (first.request_id, second.request_id, first.attempt) == ("async_1", "async_2", 1)
    await first.ack()
    await second.nak(0.2)
    again = await anext(deliveries)
    assert (again.request_id, again.attempt) == ("async_2", 2)
    await again.ack()
    await deliveries.aclose()


async def test_files_round_trip_object_store(store: NatsBatchStore) -> None:
    data = os.urandom(20 * 1024 * 1024)  # chunked by the object store
    record = FileRecord(
        id="file-1", bytes=len(data), created_at=1, filename="in.jsonl", purpose="batch", key_id="k1"
    )
    stored = await store.put_file(record, data)
    assert stored.blob == "file-1"
    assert await store.file_content(await store.file("file-1")) == data
    assert [f.id for f in await store.files("k1")] == ["file-1"]
    assert await store.files("k2") == []
    await store.delete_file("file-1")
    with pytest.raises(NotFound):
        await store.file("file-1")
    with pytest.raises(NotFound):
        await store.file_content(stored)
    assert await store.files() == []


async def test_restart_keeps_everything(server: NatsServer, store: NatsBatchStore) -> None:
    record = FileRecord(id="file-1", bytes=3, created_at=1, filename="in.jsonl", purpose="batch", key_id="k1")
    await store.put_file(record, b"abc")
    created = await store.create_batch(batch_record())
    await store.put_result("batch_1.0", result("c0"))
    await store.enqueue([item("batch_1", 1)])
    server.stop()
    server.start()
    nc, reopened = await _open(server.url, BatchConfig(ack_wait_s=1.0))
    try:
        assert await reopened.file_content(await reopened.file("file-1")) == b"abc"
        assert (await reopened.batch("batch_1")).revision == created.revision
        assert [i for i, _ in await reopened.results("batch_1")] == [0]
        assert not await reopened.put_result("batch_1.0", result("again"))
        (d,) = await reopened.pull("d1", 2, 1, 2.0)
        assert d.item.index == 1
        await d.ack()
        await reopened.enqueue([item("batch_1", 1)])  # still within the duplicate window
        assert await reopened.pending_for("batch_1") == 0
    finally:
        await nc.close()


async def test_resources_are_idempotent_and_follow_the_budget(server: NatsServer) -> None:
    nc = await nats.connect(server.url)
    js = nc.jetstream()
    await ensure_batch_resources(js, BUDGET)
    await ensure_batch_resources(js, BUDGET)
    smaller = JetStreamBudget(store_bytes=128 << 20)
    await ensure_batch_resources(js, smaller)
    for stream in (
        names.STREAM_WORK,
        names.STREAM_WEBHOOKS,
        f"KV_{names.BUCKET_RESULTS}",
        f"OBJ_{names.OBJECT_BUCKET_FILES}",
    ):
        info = await js.stream_info(stream)
        assert info.config.max_bytes == smaller.limits(stream).max_bytes
    work = (await js.stream_info(names.STREAM_WORK)).config
    assert RetentionPolicy(work.retention) == RetentionPolicy.WORK_QUEUE and work.duplicate_window == 3600
    assert (await js.stream_info(f"KV_{names.BUCKET_RESULTS}")).config.max_age == names.RESULT_TTL_S
    assert (await js.stream_info(f"KV_{names.BUCKET_BATCHES}")).config.max_age == 0
    await nc.close()


async def test_s3_blobs(s3) -> None:  # noqa: F811 (the imported fixture)
    s3.client().create_bucket(Bucket="batch")
    blobs = S3Blobs("s3://batch/files/")
    data = os.urandom(3 * 1024 * 1024)
    await blobs.put("file-1", data)
    assert await blobs.get("file-1") == data
    assert [o["Key"] for o in s3.client().list_objects_v2(Bucket="batch")["Contents"]] == ["files/file-1"]
    await blobs.delete("file-1")
    with pytest.raises(NotFound):
        await blobs.get("file-1")
    await blobs.delete("file-1")  # idempotent


async def batch_store_round_trip(store: NatsBatchStore) -> None:
    """Every store operation once, checked: run here and by a gateway's identity on a
    secured server (tests/control_plane/test_nats_permissions.py)."""
    data = os.urandom(5 * 1024 * 1024)  # several chunks, read under flow control
    file = FileRecord(
        id="file-rt", bytes=len(data), created_at=1, filename="in.jsonl", purpose="batch", key_id="k1"
    )
    await store.put_file(file, data)
    assert await store.file_content(await store.file(file.id)) == data
    assert [f.id for f in await store.files("k1")] == [file.id]
    created = await store.create_batch(batch_record("batch_rt"))
    await store.update_batch(created.value.model_copy(update={"status": "in_progress"}), created.revision)
    with pytest.raises(Conflict):
        await store.update_batch(created.value, created.revision)
    assert [b.status for b in await store.batches("k1")] == ["in_progress"]
    request = AsyncRecord(
        id="async_rt",
        endpoint="/v1/chat/completions",
        model="m",
        created_at=1,
        max_time_in_queue_s=60,
        key_id="k1",
    )
    held = await store.create_async(request)
    await store.update_async(request.model_copy(update={"status": "succeeded"}), held.revision)
    assert (await store.async_request(request.id)).value.status == "succeeded"
    assert [r.id for r in await store.async_requests("k1")] == [request.id]
    await store.enqueue([item("batch_rt", i) for i in range(3)])
    await store.enqueue([item("batch_rt", 0)])
    assert await store.pending("d1") == 3 and await store.pending_for("batch_rt") == 3
    deliveries = await store.pull("d1", 2, 3, 2.0)
    assert sorted(d.item.index for d in deliveries) == [0, 1, 2]
    for d in deliveries:
        await d.in_progress()
        assert await store.put_result(d.item.id, result(d.item.custom_id))
        await d.ack()
    assert not await store.put_result(names.result_key("batch_rt", 0), result("again"))
    assert [i for i, _ in await store.results("batch_rt")] == [0, 1, 2]
    assert await store.result_count("batch_rt") == 3
    assert await store.result(names.result_key("batch_rt", 1)) is not None
    assert await store.pending("d1") == 0 and await store.pending_for("batch_rt") == 0
    await store.enqueue([item("batch_cx", i) for i in range(2)])
    assert await store.held_with("batch_cx") == 0 and await store.purge("batch_cx") == 2
    assert await store.pending_for("batch_cx") == 0
    await store.enqueue_webhook(request.id)
    webhooks = store.webhook_deliveries()
    await (await anext(webhooks)).nak(0.1)
    again = await anext(webhooks)
    assert (again.request_id, again.attempt) == (request.id, 2)
    await again.ack()
    await webhooks.aclose()
    await store.delete_file(file.id)
    with pytest.raises(NotFound):
        await store.file(file.id)


async def test_round_trip(store: NatsBatchStore) -> None:
    await batch_store_round_trip(store)


async def _until_jetstream_answers(nc: nats.NATS, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await nc.jetstream(timeout=1.0).stream_info(names.STREAM_WORK)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def test_a_connected_store_rides_out_a_restart(server: NatsServer) -> None:
    """The gateway's own connection reconnects; its bound buckets and pull subscriptions
    keep working without being opened again."""
    nc = await nats.connect(server.url, reconnect_time_wait=0.2)
    try:
        await ensure_batch_resources(nc.jetstream(), BUDGET)
        store = await open_batch_store(nc, BatchConfig(ack_wait_s=1.0))
        await store.enqueue([item("batch_1", 0)])
        (first,) = await store.pull("d1", 2, 1, 1.0)
        await first.ack()
        server.stop()
        server.start()
        await _until_jetstream_answers(nc)
        await store.enqueue([item("batch_1", 1)])
        (second,) = await store.pull("d1", 2, 1, 2.0)
        assert second.item.index == 1
        await second.ack()
        assert await store.put_result("batch_1.1", result("c1"))
    finally:
        await nc.close()


async def test_pull_binds_again_after_its_consumer_is_deleted(store: NatsBatchStore) -> None:
    await store.enqueue([item("batch_1", 0)])
    assert await store.pending("d1") == 1  # creates the consumers
    await store.js.delete_consumer(names.STREAM_WORK, names.work_consumer("d1", 2))
    for _ in range(3):  # the first pull may learn of the loss only by failing
        with contextlib.suppress(nats.js.errors.APIError):
            if got := await store.pull("d1", 2, 1, 1.0):
                break
    assert [d.item.index for d in got] == [0]


async def test_store_with_s3_contents(server: NatsServer, s3) -> None:  # noqa: F811 (the imported fixture)
    s3.client().create_bucket(Bucket="batch")
    nc = await nats.connect(server.url)
    try:
        await ensure_batch_resources(nc.jetstream(), BUDGET)
        store = await open_batch_store(nc, BatchConfig(store_url="s3://batch/fleet"))
        assert isinstance(store.blobs, S3Blobs)
        record = FileRecord(
            id="file-1", bytes=3, created_at=1, filename="in.jsonl", purpose="batch", key_id="k1"
        )
        await store.put_file(record, b"abc")
        assert s3.client().get_object(Bucket="batch", Key="fleet/file-1")["Body"].read() == b"abc"
        assert await store.file_content(await store.file("file-1")) == b"abc"
        await store.delete_file("file-1")
        assert s3.client().list_objects_v2(Bucket="batch").get("KeyCount") == 0
    finally:
        await nc.close()


async def test_work_consumers_are_durable_explicit_and_unbounded(store: NatsBatchStore) -> None:
    await store.pending("d1")
    for priority in names.PRIORITIES:
        config = (await store.js.consumer_info(names.STREAM_WORK, names.work_consumer("d1", priority))).config
        assert config.durable_name == names.work_consumer("d1", priority)
        assert config.filter_subject == names.work_filter("d1", priority)
        assert AckPolicy(config.ack_policy) == AckPolicy.EXPLICIT and config.ack_wait == 1.0
        assert config.max_deliver in (None, -1) and config.inactive_threshold == CONSUMER_IDLE_S
