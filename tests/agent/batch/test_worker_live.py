"""The batch worker against a real nats-server and the JetStream store, running lines
through an in-process gateway whose replicas are played by a mock transport: every line
runs once, a line whose result is already stored is neither run nor booked again, a
cancelled batch's items are dropped, an expired item is stored expired, a replica's 500 is
retried and then stored as the line's failure, an async request's record is finished, and
nothing starts while the replicas have no spare capacity."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import nats
import pytest

from agent.gateway.batch.metrics import LineMetrics
from agent.gateway.batch.worker import BatchWorker, expired
from control_plane.local.nats_server import NatsServer
from fleet_base.batch import names
from fleet_base.batch.config import BatchConfig
from fleet_base.batch.models import (
    AsyncRecord,
    BatchRecord,
    LineResponse,
    LineResult,
    StoredResult,
    WorkItem,
    now,
)
from fleet_base.batch.nats_store import NatsBatchStore, open_batch_store
from fleet_base.batch.resources import ensure_batch_resources
from fleet_base.jetstream_budget import JetStreamBudget
from fleet_base.protocol import ReplicaLoad
from tests.agent.gateway.batch_fleet import DEPLOYMENT, Fleet, chat, status

BUDGET = JetStreamBudget(store_bytes=256 << 20)
CONFIG = BatchConfig(ack_wait_s=2.0, line_backoff_s=0.05, line_attempts=3, per_replica=4)
BATCH = "batch_w1"


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[NatsServer]:
    s = NatsServer(tmp_path / "nats").start()
    yield s
    s.stop()


@pytest.fixture()
async def store(server: NatsServer) -> AsyncIterator[NatsBatchStore]:
    nc = await nats.connect(server.url)
    await ensure_batch_resources(nc.jetstream(), BUDGET)
    yield await open_batch_store(nc, CONFIG)
    await nc.close()


def line(index: int, parent: str = BATCH, **kw: object) -> WorkItem:
    fields: dict = {
        "id": names.result_key(parent, index),
        "kind": "batch",
        "parent_id": parent,
        "index": index,
        "custom_id": f"c{index}",
        "endpoint": "/v1/chat/completions",
        "body": chat(f"line {index}"),
        "key_id": "main",
        "deployment": DEPLOYMENT,
        "priority": names.BATCH_PRIORITY,
        "enqueued_at": now(),
        "not_after": now() + 3600,
    }
    return WorkItem(**{**fields, **kw})


async def a_batch(store: NatsBatchStore, status: str = "in_progress", batch_id: str = BATCH) -> None:
    record = BatchRecord(
        id=batch_id,
        endpoint="/v1/chat/completions",
        input_file_id="file-x",
        created_at=int(now()),
        status=status,  # type: ignore[arg-type]
        key_id="main",
    )
    await store.create_batch(record)


class Rig:
    def __init__(self, fleet: Fleet, store: NatsBatchStore) -> None:
        self.fleet = fleet
        self.store = store
        self.metrics = LineMetrics(fleet.gw.metrics.registry)
        self.worker = BatchWorker(CONFIG, fleet.gw.worker_hooks(), self.metrics, tick_s=0.05)

    async def drain(self, timeout_s: float = 15.0) -> None:
        """Run the worker until nothing of the deployment is queued or running."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            started = await self.worker.pull_once(self.store, DEPLOYMENT)
            if not started and not self.worker._tasks and await self.store.pending(DEPLOYMENT) == 0:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the queue did not drain")

    def count(self, metric: str) -> float:
        return getattr(self.metrics, metric).labels(DEPLOYMENT)._value.get()


async def test_every_line_runs_once_and_is_booked_once(tmp_path: Path, store: NatsBatchStore) -> None:
    rig = Rig(Fleet(tmp_path, replicas=2), store)
    await a_batch(store)
    await store.enqueue([line(i) for i in range(10)])
    await store.enqueue([line(i) for i in range(10)])  # a driver's re-enqueue after a crash
    await rig.drain()
    sent = sorted(s.body["messages"][0]["content"] for s in rig.fleet.replicas.sent)
    assert sent == sorted(f"line {i}" for i in range(10))
    results = dict(await store.results(BATCH))
    assert sorted(results) == list(range(10))
    for i, r in results.items():
        assert r.line.ok and r.line.id == names.line_request_id(BATCH, i) and r.line.custom_id == f"c{i}"
        assert r.line.response is not None and r.line.response.body["usage"]["completion_tokens"] == 2
        assert (r.prompt_tokens, r.completion_tokens, r.cluster) == (3, 2, "east")
    records = rig.fleet.records
    assert sorted(r.record_id or "" for r in records) == sorted(
        names.usage_record_id(BATCH, i) for i in range(10)
    )
    assert all(r.batch for r in records)
    assert rig.count("completed") == 10 and rig.count("in_flight") == 0
    assert rig.metrics.queue_s.labels(DEPLOYMENT)._sum.get() >= 0


async def test_a_stored_result_is_not_run_or_booked_again(tmp_path: Path, store: NatsBatchStore) -> None:
    rig = Rig(Fleet(tmp_path), store)
    await a_batch(store)
    earlier = StoredResult(
        line=LineResult(
            id=names.line_request_id(BATCH, 0),
            custom_id="c0",
            response=LineResponse(status_code=200, request_id="req-old", body={"earlier": True}),
        ),
        cluster="west",
    )
    assert await store.put_result(names.result_key(BATCH, 0), earlier)
    await store.enqueue([line(0), line(1)])
    await rig.drain()
    assert [s.body["messages"][0]["content"] for s in rig.fleet.replicas.sent] == ["line 1"]
    assert (await store.result(names.result_key(BATCH, 0))) == earlier
    assert [r.record_id for r in rig.fleet.records] == [names.usage_record_id(BATCH, 1)]


async def test_a_cancelled_batchs_items_are_dropped(tmp_path: Path, store: NatsBatchStore) -> None:
    rig = Rig(Fleet(tmp_path), store)
    await a_batch(store, "cancelling")
    await store.enqueue([line(i) for i in range(5)])
    await rig.drain()
    assert rig.fleet.replicas.sent == [] and await store.results(BATCH) == []
    assert await store.pending_for(BATCH) == 0


async def test_an_item_past_its_deadline_is_stored_expired(tmp_path: Path, store: NatsBatchStore) -> None:
    rig = Rig(Fleet(tmp_path), store)
    await a_batch(store)
    await store.enqueue([line(0, not_after=now() - 1), line(1)])
    await rig.drain()
    results = dict(await store.results(BATCH))
    assert results[0].line.error is not None and results[0].line.error.code == "batch_expired"
    assert results[1].line.ok
    assert len(rig.fleet.replicas.sent) == 1 and rig.count("failed") == 1


async def test_a_replica_500_is_retried_then_stored_as_the_lines_failure(
    tmp_path: Path, store: NatsBatchStore
) -> None:
    rig = Rig(Fleet(tmp_path), store)
    rig.fleet.replicas.behaviour["r1"] = status(500)
    await a_batch(store)
    await store.enqueue([line(0)])
    await rig.drain()
    runs = {s.headers["x-request-id"] for s in rig.fleet.replicas.sent}  # each retried by the gateway too
    assert len(runs) == CONFIG.line_attempts
    result = await store.result(names.result_key(BATCH, 0))
    assert result is not None and not result.line.ok
    assert result.line.response is not None and result.line.response.status_code == 500
    assert rig.count("retried") == CONFIG.line_attempts - 1 and rig.count("failed") == 1
    # the final answer is booked once under the line's id; the tries the worker retried
    # booked nothing (only the gateway's own failed-attempt telemetry, never billed)
    billed = [r.record_id for r in rig.fleet.records if not r.attempt_failed]
    assert billed == [names.usage_record_id(BATCH, 0)]


async def test_a_replica_400_is_the_lines_answer_at_once(tmp_path: Path, store: NatsBatchStore) -> None:
    rig = Rig(Fleet(tmp_path), store)
    rig.fleet.replicas.behaviour["r1"] = status(400)
    await a_batch(store)
    await store.enqueue([line(0)])
    await rig.drain()
    result = await store.result(names.result_key(BATCH, 0))
    assert result is not None and result.line.response is not None and result.line.response.status_code == 400
    assert len(rig.fleet.replicas.sent) == 1 and rig.count("retried") == 0


async def test_an_async_request_finishes_its_record(tmp_path: Path, store: NatsBatchStore) -> None:
    rig = Rig(Fleet(tmp_path), store)
    record = AsyncRecord(
        id="async_1",
        endpoint="/v1/chat/completions",
        model=DEPLOYMENT,
        created_at=int(now()),
        max_time_in_queue_s=600,
        key_id="main",
        priority=0,
    )
    await store.create_async(record)
    item = line(0).model_copy(
        update={"id": names.result_key("async_1", None), "kind": "async", "parent_id": "async_1", "index": None,
                "custom_id": "async_1", "priority": 0},
    )  # fmt: skip
    await store.enqueue([item])
    await rig.drain()
    done = (await store.async_request("async_1")).value
    assert done.status == "succeeded" and done.started_at is not None and done.finished_at is not None
    assert done.result_expires_at == done.finished_at + int(CONFIG.result_retention_s)
    stored = await store.result(names.result_key("async_1", None))
    assert stored is not None and stored.line.ok and stored.line.id == "async_1"
    assert rig.fleet.records[0].record_id == names.usage_record_id("async_1", None)


async def test_nothing_starts_while_a_replica_has_requests_waiting(
    tmp_path: Path, store: NatsBatchStore
) -> None:
    fleet = Fleet(tmp_path, replicas=2, loads={"r2": ReplicaLoad(waiting=1)})
    rig = Rig(fleet, store)
    await a_batch(store)
    await store.enqueue([line(i) for i in range(3)])
    assert await rig.worker.pull_once(store, DEPLOYMENT) == 0
    assert await store.pending(DEPLOYMENT) == 3 and fleet.replicas.sent == []
    fleet.write(2, {"r2": ReplicaLoad(kv_cache_usage=0.5)})  # the engine caught up
    fleet.gw.view.refresh(force=True)
    await rig.drain()
    assert len(fleet.replicas.sent) == 3


async def test_a_run_that_loses_the_create_books_nothing(tmp_path: Path, store: NatsBatchStore) -> None:
    """The driver's `batch_expired` placeholder (or another run) stored the line's result
    while this run was in flight: the line's output is the placeholder, so nothing is booked."""
    rig = Rig(Fleet(tmp_path), store)
    real = rig.fleet.gw.run_work

    async def run_then_expire(item: WorkItem, request_id: str):  # type: ignore[no-untyped-def]
        out = await real(item, request_id)
        await store.put_result(item.id, StoredResult(line=expired(item)))
        return out

    rig.worker.hooks = replace(rig.worker.hooks, run=run_then_expire)
    await a_batch(store)
    await store.enqueue([line(0)])
    await rig.drain()
    result = await store.result(names.result_key(BATCH, 0))
    assert result is not None and result.line.error is not None and result.line.error.code == "batch_expired"
    assert len(rig.fleet.replicas.sent) == 1
    assert [r for r in rig.fleet.records if not r.attempt_failed] == []


async def test_a_line_queued_after_a_cancel_does_not_start(tmp_path: Path, store: NatsBatchStore) -> None:
    rig = Rig(Fleet(tmp_path), store)
    await a_batch(store)
    await store.enqueue([line(0)])
    await rig.drain()
    v = await store.batch(BATCH)
    await store.update_batch(v.value.model_copy(update={"status": "cancelling"}), v.revision)
    await store.enqueue([line(1)])
    await rig.drain()
    assert [s.body["messages"][0]["content"] for s in rig.fleet.replicas.sent] == ["line 0"]
    assert await store.result(names.result_key(BATCH, 1)) is None


async def test_a_redelivered_async_request_stored_expired_is_marked_expired(
    tmp_path: Path, store: NatsBatchStore
) -> None:
    rig = Rig(Fleet(tmp_path), store)
    record = AsyncRecord(
        id="async_2",
        endpoint="/v1/chat/completions",
        model=DEPLOYMENT,
        created_at=int(now()),
        max_time_in_queue_s=600,
        key_id="main",
        priority=0,
    )
    await store.create_async(record)
    item = line(0).model_copy(
        update={"id": names.result_key("async_2", None), "kind": "async", "parent_id": "async_2", "index": None,
                "custom_id": "async_2", "priority": 0},
    )  # fmt: skip
    # its first delivery stored it expired, and its worker died before the record was finished
    assert await store.put_result(item.id, StoredResult(line=expired(item)))
    await store.enqueue([item])
    await rig.drain()
    assert (await store.async_request("async_2")).value.status == "expired"
    assert rig.fleet.replicas.sent == []
