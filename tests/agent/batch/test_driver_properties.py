"""Two drivers, a worker, a client's cancel and a clock, interleaved at random on one
in-memory store: however they interleave, a batch ends in one terminal status and every
line of its input is in exactly one of its output and error files, once."""

from __future__ import annotations

import asyncio
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.gateway.batch.driver import BatchDriver
from fleet_base.batch.config import BatchConfig
from fleet_base.batch.models import TERMINAL, BatchRecord, FileRecord, LineResponse, LineResult, StoredResult
from fleet_base.batch.names import line_request_id
from tests.agent.batch.memory_store import MemoryBatchStore

T0 = 1_000_000.0
CONFIG = BatchConfig(claim_s=30.0)
WINDOW_S = 600.0
IDS = [f"c{i}" for i in range(7)]
OPS = ("step_a", "step_b", "lapse", "run_one", "fail_one", "cancel", "drop_all", "tick", "window")


def deployment_of(key_id: str, model: str) -> str:
    return model


def input_file() -> bytes:
    rows = []
    for i, custom_id in enumerate(IDS):
        body = {"model": "tiny" if i != 3 else 5, "messages": [{"role": "user", "content": custom_id}]}
        rows.append({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


class Scenario:
    def __init__(self) -> None:
        self.store = MemoryBatchStore()
        self.clock = T0
        self.drivers = {
            name: BatchDriver(
                self.store,
                CONFIG,
                deployment_of,
                holder=name,
                windows={"24h": WINDOW_S},
                clock=lambda: self.clock,
                tally_s=0,
            )
            for name in ("a", "b")
        }

    async def setup(self) -> None:
        data = input_file()
        file = FileRecord(
            id="file-in", bytes=len(data), created_at=int(T0), filename="in", purpose="batch", key_id="k"
        )
        await self.store.put_file(file, data)
        batch = BatchRecord(
            id="batch_p",
            endpoint="/v1/chat/completions",
            input_file_id="file-in",
            created_at=int(T0),
            key_id="k",
        )
        await self.store.create_batch(batch)

    async def status(self) -> str:
        return (await self.store.batch("batch_p")).value.status

    async def run_one(self, ok: bool) -> None:
        """A worker: the first queued item runs, its result is stored, then it is acked."""
        for item in list(self.store.queue.values()):
            response = LineResponse(
                status_code=200 if ok else 500, request_id="r", body={"echo": item.custom_id}
            )
            line = LineResult(
                id=line_request_id("batch_p", item.index or 0), custom_id=item.custom_id, response=response
            )
            await self.store.put_result(item.id, StoredResult(line=line))
            self.store.queue.pop(item.id)
            return

    async def do(self, op: str) -> None:
        if op in ("step_a", "step_b"):
            await self.drivers[op[-1]].step("batch_p")
        elif op == "lapse":
            self.clock += CONFIG.claim_s + 1
        elif op == "tick":
            self.clock += 5
        elif op == "window":
            self.clock += WINDOW_S
        elif op in ("run_one", "fail_one"):
            await self.run_one(op == "run_one")
        elif op == "cancel":
            v = await self.store.batch("batch_p")
            if v.value.status in ("validating", "in_progress"):
                await self.store.update_batch(v.value.model_copy(update={"status": "cancelling"}), v.revision)
        elif op == "drop_all" and await self.status() == "cancelling":
            self.store.queue.clear()

    async def end(self) -> BatchRecord:
        """Workers run what is queued and a driver steps, until the batch is over (the
        window passes if it must)."""
        for turn in range(50):
            if await self.status() in TERMINAL:
                break
            await self.run_one(True)
            self.clock += CONFIG.claim_s + 1 + (WINDOW_S if turn > 20 else 0)
            await self.drivers["b"].step("batch_p")
        return (await self.store.batch("batch_p")).value

    async def delivered(self, record: BatchRecord) -> list[str]:
        seen: list[str] = []
        for file_id in (record.output_file_id, record.error_file_id):
            if file_id is not None:
                content = await self.store.file_content(await self.store.file(file_id))
                seen += [json.loads(r)["custom_id"] for r in content.splitlines()]
        return seen


async def scenario(ops: list[str]) -> str:
    s = Scenario()
    await s.setup()
    for op in ops:
        await s.do(op)
    record = await s.end()
    assert record.status in TERMINAL and record.status != "failed", record.status
    assert record.claim is None
    assert sorted(await s.delivered(record)) == sorted(IDS)  # every line once: none lost, none twice
    counts = record.request_counts
    assert counts.total == len(IDS) and counts.completed + counts.failed == counts.total
    outputs = {f.id for f in s.store.file_records.values() if f.purpose == "batch_output"}
    assert outputs == {record.output_file_id, record.error_file_id} - {None}  # no orphan files
    return record.status


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(OPS), max_size=40))
def test_any_interleaving_ends_with_every_line_once(ops: list[str]) -> None:
    asyncio.run(scenario(ops))


def test_the_operations_reach_every_ending() -> None:
    """The property above is not vacuous: its operations end batches completed,
    cancelled and expired."""
    endings = [
        asyncio.run(scenario(ops))
        for ops in (
            ["step_a", "run_one", "lapse", "step_b"],
            ["step_a", "run_one", "cancel", "drop_all", "step_a"],
            ["step_a", "run_one", "window", "step_b"],
        )
    ]
    assert endings == ["completed", "cancelled", "expired"]
