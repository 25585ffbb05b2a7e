"""The batch driver on an in-memory store with a clock of its own: a batch walks to
completed with its output and error files; a lapsed claim is taken over and enqueueing
resumes where it stopped; a live claim is left alone; expiry and cancel return the
finished part and mark the rest."""

from __future__ import annotations

import asyncio
import json

import pytest

from agent.gateway.batch.driver import CANCEL_SEEN_S, BatchDriver
from agent.gateway.errors import GatewayError
from fleet_base.batch.config import BatchConfig
from fleet_base.batch.models import (
    BatchRecord,
    DriverClaim,
    FileRecord,
    LineResponse,
    LineResult,
    StoredResult,
)
from fleet_base.batch.names import line_request_id, result_key
from tests.agent.batch.memory_store import MemoryBatchStore

T0 = 1_000_000.0
CONFIG = BatchConfig(claim_s=30.0)


class Clock:
    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> float:
        return self.t


def deployment_of(key_id: str, model: str) -> str:
    if model != "tiny":
        raise GatewayError(404, f"The model '{model}' does not exist", code="model_not_found")
    return model


def request(custom_id: str, model: str = "tiny") -> bytes:
    body = {"model": model, "messages": [{"role": "user", "content": custom_id}]}
    line = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
    return json.dumps(line).encode() + b"\n"


async def make_batch(store: MemoryBatchStore, data: bytes, **fields: object) -> BatchRecord:
    file = await store.put_file(
        FileRecord(
            id="file-in",
            bytes=len(data),
            created_at=int(T0),
            filename="in.jsonl",
            purpose="batch",
            key_id="k1",
        ),
        data,
    )
    record = BatchRecord(
        id="batch_b1",
        endpoint="/v1/chat/completions",
        input_file_id=file.id,
        created_at=int(T0),
        key_id="k1",
        **fields,  # type: ignore[arg-type]
    )
    return (await store.create_batch(record)).value


def answer(index: int, custom_id: str) -> StoredResult:
    response = LineResponse(status_code=200, request_id=f"req-{index}", body={"echo": custom_id})
    line = LineResult(id=line_request_id("batch_b1", index), custom_id=custom_id, response=response)
    return StoredResult(line=line, prompt_tokens=5, completion_tokens=2)


def driver(store: MemoryBatchStore, clock: Clock, holder: str = "east/gw-1", **kw: object) -> BatchDriver:
    return BatchDriver(store, CONFIG, deployment_of, holder=holder, clock=clock, **kw)  # type: ignore[arg-type]


async def settle(d: BatchDriver, batch_id: str = "batch_b1") -> str:
    step = "again"
    for _ in range(20):
        step = await d.step(batch_id)
        if step != "again":
            return step
    return step


async def content(store: MemoryBatchStore, file_id: str | None) -> list[dict]:
    assert file_id is not None
    record = await store.file(file_id)
    assert record.purpose == "batch_output" and record.key_id == "k1"
    return [json.loads(r) for r in (await store.file_content(record)).splitlines()]


async def test_a_batch_runs_to_completed_with_its_files() -> None:
    store, clock = MemoryBatchStore(), Clock()
    await make_batch(store, request("a") + request("b") + request("c", model="ghost") + request("d"))
    d = driver(store, clock)
    assert await settle(d) == "wait"
    rec = (await store.batch("batch_b1")).value
    assert rec.status == "in_progress"
    assert rec.in_progress_at == int(T0) and rec.expires_at == int(T0 + 24 * 3600)
    assert rec.request_counts.model_dump() == {"total": 4, "completed": 0, "failed": 1}
    assert rec.claim is not None and rec.claim.holder == "east/gw-1"
    assert [i.custom_id for i in store.queue.values()] == ["a", "b", "d"]
    bad = await store.result(result_key("batch_b1", 2))
    assert bad is not None and bad.line.error is not None and bad.line.error.code == "model_not_found"

    # the worker's part: results stored, items acknowledged
    for item in list(store.queue.values())[:2]:
        await store.put_result(item.id, answer(item.index or 0, item.custom_id))
    clock.t += 1
    assert await settle(d) == "wait"
    rec = (await store.batch("batch_b1")).value
    assert rec.status == "in_progress"
    assert rec.request_counts.model_dump() == {"total": 4, "completed": 2, "failed": 1}

    item = list(store.queue.values())[2]
    await store.put_result(item.id, answer(3, "d"))
    assert await settle(d) == "done"
    rec = (await store.batch("batch_b1")).value
    assert rec.status == "completed" and rec.claim is None
    assert rec.finalizing_at is not None and rec.completed_at is not None
    assert rec.request_counts.model_dump() == {"total": 4, "completed": 3, "failed": 1}
    assert rec.usage is not None and rec.usage.total_tokens == 21
    out = await content(store, rec.output_file_id)
    assert [(r["custom_id"], r["response"]["body"]) for r in out] == [
        ("a", {"echo": "a"}),
        ("b", {"echo": "b"}),
        ("d", {"echo": "d"}),
    ]
    errors = await content(store, rec.error_file_id)
    assert [(r["custom_id"], r["error"]["code"]) for r in errors] == [("c", "model_not_found")]
    assert "Line 3" in errors[0]["error"]["message"]


async def test_a_lapsed_claim_is_taken_over_and_enqueueing_resumes() -> None:
    store, clock = MemoryBatchStore(), Clock()
    data = b"".join(request(c) for c in "abcde")
    dead = DriverClaim(holder="west/gw-dead", until=T0 - 1)
    await make_batch(store, data, claim=dead, enqueued=2)
    await store.put_result(result_key("batch_b1", 3), answer(3, "d"))  # ran before the crash
    d = driver(store, clock)
    await d.scan()
    assert "batch_b1" in d._active
    await d.stop()
    assert await settle(d) == "wait"
    rec = (await store.batch("batch_b1")).value
    assert rec.claim is not None and rec.claim.holder == "east/gw-1"
    assert rec.status == "in_progress" and rec.enqueued == 5
    # every valid line without a result is queued again (the stream drops an id it holds)
    assert [i.custom_id for i in store.queue.values()] == ["a", "b", "c", "e"]
    assert rec.request_counts.completed == 1


async def test_a_live_claim_is_left_alone_until_it_lapses() -> None:
    store, clock = MemoryBatchStore(), Clock()
    live = DriverClaim(holder="west/gw-2", until=T0 + 10)
    await make_batch(store, request("a"), claim=live)
    d = driver(store, clock)
    before = await store.batch("batch_b1")
    await d.scan()
    assert not d._active
    assert await d.step("batch_b1") == "lost"
    assert await store.batch("batch_b1") == before and not store.queue
    clock.t += 10
    assert await settle(d) == "wait"
    assert (await store.batch("batch_b1")).value.claim.holder == "east/gw-1"  # type: ignore[union-attr]


async def test_the_claim_is_renewed_at_a_third_of_its_length() -> None:
    store, clock = MemoryBatchStore(), Clock()
    await make_batch(store, request("a"))
    d = driver(store, clock)
    await settle(d)
    revision = (await store.batch("batch_b1")).revision
    clock.t += CONFIG.claim_s / 3 - 1
    await settle(d)
    assert (await store.batch("batch_b1")).revision == revision  # nothing changed, claim fresh
    clock.t += 2
    await settle(d)
    v = await store.batch("batch_b1")
    assert v.revision > revision and v.value.claim is not None
    assert v.value.claim.until == pytest.approx(clock.t + CONFIG.claim_s)


async def test_expiry_returns_the_finished_part_and_marks_the_rest() -> None:
    store, clock = MemoryBatchStore(), Clock()
    await make_batch(store, b"".join(request(c) for c in "abc"))
    d = driver(store, clock, windows={"24h": 60.0})
    await settle(d)
    assert (await store.batch("batch_b1")).value.expires_at == int(T0 + 60)
    await store.put_result(result_key("batch_b1", 1), answer(1, "b"))
    clock.t += 60
    assert await settle(d) == "done"
    rec = (await store.batch("batch_b1")).value
    assert rec.status == "expired" and rec.expired_at == int(T0 + 60)
    assert store.queue == {}  # its items left on the queue are purged: no demand any more
    assert [r["custom_id"] for r in await content(store, rec.output_file_id)] == ["b"]
    errors = await content(store, rec.error_file_id)
    assert [(r["custom_id"], r["error"]["code"]) for r in errors] == [
        ("a", "batch_expired"),
        ("c", "batch_expired"),
    ]
    assert rec.request_counts.model_dump() == {"total": 3, "completed": 1, "failed": 2}


async def test_cancel_waits_for_the_queue_then_returns_the_finished_part() -> None:
    store, clock = MemoryBatchStore(), Clock()
    await make_batch(store, b"".join(request(c) for c in "abc"))
    d = driver(store, clock)
    await settle(d)
    v = await store.batch("batch_b1")
    await store.update_batch(
        v.value.model_copy(update={"status": "cancelling", "cancelling_at": int(T0)}), v.revision
    )
    first = next(iter(store.queue.values()))
    await store.put_result(first.id, answer(0, "a"))  # in flight when cancelled: it finishes
    assert await settle(d) == "wait"
    assert (await store.batch("batch_b1")).value.status == "cancelling"
    store.queue.clear()  # workers dropped the rest
    assert await settle(d) == "done"
    rec = (await store.batch("batch_b1")).value
    assert rec.status == "cancelled" and rec.cancelled_at is not None
    assert [r["custom_id"] for r in await content(store, rec.output_file_id)] == ["a"]
    errors = await content(store, rec.error_file_id)
    assert {r["error"]["code"] for r in errors} == {"batch_cancelled"} and len(errors) == 2


async def test_a_cancel_nobody_works_on_purges_its_items_once_every_worker_sees_it() -> None:
    """No replica, so no worker drops the items: the driver purges them itself, but only
    once a worker would drop a line it pulls and while none holds one that may be the batch's."""
    store, clock = MemoryBatchStore(), Clock()
    await make_batch(store, b"".join(request(c) for c in "abcd"))
    d = driver(store, clock)
    await settle(d)
    (held,) = await store.pull("tiny", 2, 1, 0.0)  # a worker runs line a
    v = await store.batch("batch_b1")
    await store.update_batch(
        v.value.model_copy(update={"status": "cancelling", "cancelling_at": int(T0)}), v.revision
    )
    assert await settle(d) == "wait" and len(store.queue) == 4  # workers may not have seen it yet
    clock.t += CANCEL_SEEN_S
    assert await settle(d) == "wait" and len(store.queue) == 4  # line a runs: its result may come
    await store.put_result(held.item.id, answer(0, "a"))
    await held.ack()
    assert await settle(d) == "done" and store.queue == {}
    rec = (await store.batch("batch_b1")).value
    assert rec.status == "cancelled"
    assert [r["custom_id"] for r in await content(store, rec.output_file_id)] == ["a"]
    assert len(await content(store, rec.error_file_id)) == 3


async def test_a_cancel_during_validation_wins_over_the_driver() -> None:
    store, clock = MemoryBatchStore(), Clock()
    await make_batch(store, b"".join(request(str(i)) for i in range(600)))
    d = driver(store, clock)
    real_enqueue = store.enqueue

    async def enqueue_then_cancel(items):  # the API's cancel lands between two chunks
        await real_enqueue(items)
        v = await store.batch("batch_b1")
        if v.value.status == "validating":
            await store.update_batch(v.value.model_copy(update={"status": "cancelling"}), v.revision)

    store.enqueue = enqueue_then_cancel  # type: ignore[method-assign]
    assert await d.step("batch_b1") == "again"
    rec = (await store.batch("batch_b1")).value
    assert rec.status == "cancelling" and len(store.queue) == 256
    store.queue.clear()
    assert await settle(d) == "done"
    assert (await store.batch("batch_b1")).value.status == "cancelled"


@pytest.mark.parametrize(("data", "code"), [(b"", "empty_file"), (b"not json\n", "invalid_json_line")])
async def test_a_file_that_is_no_batch_fails_it(data: bytes, code: str) -> None:
    store, clock = MemoryBatchStore(), Clock()
    await make_batch(store, data)
    assert await settle(driver(store, clock)) == "done"
    rec = (await store.batch("batch_b1")).value
    assert rec.status == "failed" and rec.failed_at == int(T0) and rec.claim is None
    assert rec.errors is not None and rec.errors.data[0].code == code


async def test_a_deleted_input_file_fails_the_batch() -> None:
    store, clock = MemoryBatchStore(), Clock()
    await make_batch(store, request("a"))
    await store.delete_file("file-in")
    await settle(driver(store, clock))
    rec = (await store.batch("batch_b1")).value
    assert rec.status == "failed" and rec.errors is not None and rec.errors.data[0].code == "file_not_found"


async def test_a_running_batch_reads_its_results_at_most_every_tally_period() -> None:
    store, clock = MemoryBatchStore(), Clock()
    await make_batch(store, b"".join(request(c) for c in "abcd"))
    d = driver(store, clock, tally_s=10.0)
    await settle(d)
    reads = 0
    real_results = store.results

    async def counted(batch_id: str):
        nonlocal reads
        reads += 1
        return await real_results(batch_id)

    store.results = counted  # type: ignore[method-assign]
    items = list(store.queue.values())
    await store.put_result(items[0].id, answer(0, "a"))
    await settle(d)
    assert (await store.batch("batch_b1")).value.request_counts.completed == 1 and reads == 1
    await store.put_result(items[1].id, answer(1, "b"))
    clock.t += 2
    await settle(d)
    assert (await store.batch("batch_b1")).value.request_counts.completed == 1 and reads == 1  # not yet
    clock.t += 8
    await settle(d)
    assert (await store.batch("batch_b1")).value.request_counts.completed == 2 and reads == 2
    clock.t += 20
    await settle(d)
    assert reads == 2  # nothing new: nothing read
    for index, item in enumerate(items[2:], start=2):
        await store.put_result(item.id, answer(index, item.custom_id))
    assert await settle(d) == "done"  # every line has a result: finalized at once
    assert (await store.batch("batch_b1")).value.status == "completed"


async def test_a_stopping_driver_hands_its_claims_back() -> None:
    store, clock = MemoryBatchStore(), Clock()
    await make_batch(store, request("a"))
    d = driver(store, clock, tick_s=0.01)
    await d.scan()
    assert "batch_b1" in d._active

    async def claimed() -> bool:
        claim = (await store.batch("batch_b1")).value.claim
        return claim is not None and claim.holder == "east/gw-1"

    for _ in range(100):
        if await claimed():
            break
        await asyncio.sleep(0.01)
    assert await claimed()
    await d.stop()
    rec = (await store.batch("batch_b1")).value
    assert rec.claim is None and rec.status == "in_progress"
    assert await settle(driver(store, clock, holder="west/gw-2")) == "wait"  # at once, no lapse waited


async def test_a_takeover_resumes_at_the_file_line_and_answers_no_line_queued_before() -> None:
    """The dead driver served a model this gateway does not, and the file has a blank line:
    lines are counted in the file, not among what this gateway finds valid."""
    store, clock = MemoryBatchStore(), Clock()
    data = request("a") + b"\n" + request("b", model="elsewhere") + request("c") + request("d")
    dead = DriverClaim(holder="west/gw-dead", until=T0 - 1)
    await make_batch(store, data, claim=dead, enqueued=3)  # file lines 0-2 (a, blank, b) queued there
    assert await settle(driver(store, clock)) == "wait"
    rec = (await store.batch("batch_b1")).value
    assert rec.status == "in_progress" and rec.enqueued == 5 and rec.request_counts.total == 4
    assert await store.result(result_key("batch_b1", 2)) is None  # b was queued by its driver
    assert sorted(i.custom_id for i in store.queue.values()) == ["a", "c", "d"]


async def test_expiry_stores_its_placeholders_so_a_line_still_running_loses() -> None:
    store, clock = MemoryBatchStore(), Clock()
    await make_batch(store, b"".join(request(c) for c in "abc"))
    d = driver(store, clock, windows={"24h": 60.0})
    await settle(d)
    await store.put_result(result_key("batch_b1", 1), answer(1, "b"))
    clock.t += 60
    assert await settle(d) == "done"
    rec = (await store.batch("batch_b1")).value
    # line a was in flight: its late result loses the create (and so is not booked)
    assert not await store.put_result(result_key("batch_b1", 0), answer(0, "a"))
    late = await store.result(result_key("batch_b1", 0))
    assert late is not None and late.line.error is not None and late.line.error.code == "batch_expired"
    errors = await content(store, rec.error_file_id)
    assert [(r["custom_id"], r["error"]["code"]) for r in errors] == [
        ("a", "batch_expired"),
        ("c", "batch_expired"),
    ]


async def test_the_counts_of_an_ending_batch_come_from_its_record_not_its_file() -> None:
    store, clock = MemoryBatchStore(), Clock()
    await make_batch(store, b"".join(request(c) for c in "abc"))
    d = driver(store, clock, windows={"24h": 60.0})
    await settle(d)
    await store.put_result(result_key("batch_b1", 1), answer(1, "b"))
    await store.delete_file("file-in")  # gone behind the API's back
    clock.t += 60
    assert await settle(d) == "done"
    rec = (await store.batch("batch_b1")).value
    assert rec.status == "expired"
    assert rec.request_counts.model_dump() == {"total": 3, "completed": 1, "failed": 2}
