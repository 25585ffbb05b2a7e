"""Batches on a live gateway (in this process, on a real socket) over a real nats-server and
the JetStream store, through the unmodified OpenAI SDK: a batch reaches completed with its
output and error files (the worker's part played here: results stored, items acked), a
cancelled batch ends with its finished part, a tiny window expires one, and a second
driver takes over a batch whose driver stopped renewing its claim."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import uvicorn
from openai import AsyncOpenAI

from agent.gateway.app import build_app
from agent.gateway.batch.driver import BatchDriver
from agent.gateway.gateway import Gateway
from fleet_base.batch.config import BatchConfig
from fleet_base.batch.models import BatchRecord, FileRecord, LineResponse, LineResult, StoredResult
from fleet_base.batch.names import line_request_id
from fleet_base.batch.nats_store import NatsBatchStore, open_batch_store
from fleet_base.batch.resources import ensure_batch_resources
from fleet_base.cluster_config import ClusterConfig
from fleet_base.ports import free_port
from tests.agent.conftest import cluster_config
from tests.agent.gateway.harness import ClusterFiles, make_key, route
from tests.polling import eventually

SECRET, KEY = make_key("main")


@contextlib.asynccontextmanager
async def gateway_on(
    cfg: ClusterConfig, window_s: float | None = None
) -> AsyncIterator[tuple[Gateway, AsyncOpenAI]]:
    gw = Gateway(cfg)
    assert gw.batch is not None
    gw.batch.tick_s = 0.1
    if window_s is not None:
        gw.batch.windows = {"24h": window_s}  # tests only: the API still takes "24h" alone
    server = uvicorn.Server(
        uvicorn.Config(build_app(cfg, gw), host="127.0.0.1", port=cfg.gateway.port, log_level="warning")
    )
    serve = asyncio.create_task(server.serve())
    client = AsyncOpenAI(api_key=SECRET, base_url=f"http://127.0.0.1:{cfg.gateway.port}/v1", max_retries=0)
    try:
        await eventually(
            lambda: gw.batch is not None and gw.batch.ready.is_set(), 20, "the batch store bound"
        )
        yield gw, client
    finally:
        await client.close()
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(serve, 10)


def config(tmp_path: Path, nats_url: str) -> ClusterConfig:
    cfg = cluster_config(tmp_path, nats_url, gateway={"port": free_port(), "key_state_max_age_s": 3600})
    ClusterFiles(cfg.state_dir, cfg.cluster).write(keys=[KEY], routes=[route("tiny", [])])
    return cfg


def jsonl(custom_ids: list[str], model: str = "tiny") -> io.BytesIO:
    rows = [
        {
            "custom_id": c,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": model if c != "bad" else "ghost", "messages": [{"role": "user", "content": c}]},
        }
        for c in custom_ids
    ]
    return io.BytesIO(b"".join(json.dumps(r).encode() + b"\n" for r in rows))


async def status_is(client: AsyncOpenAI, batch_id: str, status: str) -> None:
    async def check() -> bool:
        return (await client.batches.retrieve(batch_id)).status == status

    await eventually(check, 20, f"batch {batch_id} {status}")


async def run_lines(store: NatsBatchStore, n: int, *, store_result: bool = True) -> list[str]:
    """The worker's part: pull `n` items of the batch lines, store each result, ack."""
    ran: list[str] = []
    while len(ran) < n:
        for d in await store.pull("tiny", 2, n - len(ran), 2.0):
            item = d.item
            if store_result:
                response = LineResponse(
                    status_code=200, request_id=f"req-{item.index}", body={"echo": item.custom_id}
                )
                line = LineResult(
                    id=line_request_id(item.parent_id, item.index or 0),
                    custom_id=item.custom_id,
                    response=response,
                )
                await store.put_result(item.id, StoredResult(line=line, prompt_tokens=3, completion_tokens=1))
            await d.ack()
            ran.append(item.custom_id)
    return ran


async def lines_of(client: AsyncOpenAI, file_id: str | None) -> list[dict]:
    assert file_id is not None
    return [json.loads(r) for r in (await client.files.content(file_id)).content.splitlines()]


async def test_a_batch_completes_and_a_cancelled_one_keeps_its_finished_part(
    tmp_path: Path, nats_server
) -> None:
    cfg = config(tmp_path, nats_server.url)
    async with gateway_on(cfg) as (gw, client):
        store = gw.batch.store  # type: ignore[union-attr]
        assert isinstance(store, NatsBatchStore)
        file = await client.files.create(file=("in.jsonl", jsonl(["a", "b", "bad", "c"])), purpose="batch")
        batch = await client.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        await status_is(client, batch.id, "in_progress")
        assert await store.pending_for(batch.id) == 3
        got = await client.batches.retrieve(batch.id)
        assert got.request_counts is not None and (got.request_counts.total, got.request_counts.failed) == (
            4,
            1,
        )
        assert sorted(await run_lines(store, 3)) == ["a", "b", "c"]
        assert await store.result_count(batch.id) == 4  # three answers and the refused line
        await status_is(client, batch.id, "completed")
        done = await client.batches.retrieve(batch.id)
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (
            4,
            3,
            1,
        )
        assert done.usage is not None and done.usage.input_tokens == 9
        assert [r["custom_id"] for r in await lines_of(client, done.output_file_id)] == ["a", "b", "c"]
        [bad] = await lines_of(client, done.error_file_id)
        assert (
            bad["custom_id"] == "bad"
            and bad["error"]["code"] == "model_not_found"
            and bad["response"] is None
        )
        output = await client.files.retrieve(done.output_file_id or "")
        assert output.purpose == "batch_output"
        assert [b.id for b in (await client.batches.list()).data] == [batch.id]

        # cancel: one line finishes, the workers drop the rest, then cancelled
        file2 = await client.files.create(file=("in2.jsonl", jsonl(["x", "y", "z"])), purpose="batch")
        batch2 = await client.batches.create(
            input_file_id=file2.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        await status_is(client, batch2.id, "in_progress")
        [first] = await run_lines(store, 1)
        assert (await client.batches.cancel(batch2.id)).status == "cancelling"
        await asyncio.sleep(0.3)
        assert (await client.batches.retrieve(batch2.id)).status == "cancelling"  # two items still queued
        await run_lines(store, 2, store_result=False)  # dropped unrun
        await status_is(client, batch2.id, "cancelled")
        cancelled = await client.batches.retrieve(batch2.id)
        assert [r["custom_id"] for r in await lines_of(client, cancelled.output_file_id)] == [first]
        errors = await lines_of(client, cancelled.error_file_id)
        assert {r["error"]["code"] for r in errors} == {"batch_cancelled"} and len(errors) == 2
        metrics = gw.metrics.render().decode()
        assert 'fleet_batch_transitions_total{status="cancelled"} 1.0' in metrics
        assert 'fleet_batch_transitions_total{status="completed"} 1.0' in metrics


async def test_a_tiny_window_expires_the_batch(tmp_path: Path, nats_server) -> None:
    cfg = config(tmp_path, nats_server.url)
    async with gateway_on(cfg, window_s=3.0) as (gw, client):
        store = gw.batch.store  # type: ignore[union-attr]
        file = await client.files.create(file=("in.jsonl", jsonl(["a", "b", "c"])), purpose="batch")
        batch = await client.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        await status_is(client, batch.id, "in_progress")
        [ran] = await run_lines(store, 1)  # type: ignore[arg-type]
        await status_is(client, batch.id, "expired")
        expired = await client.batches.retrieve(batch.id)
        assert expired.expired_at is not None and expired.expired_at >= batch.created_at + 3
        assert [r["custom_id"] for r in await lines_of(client, expired.output_file_id)] == [ran]
        errors = await lines_of(client, expired.error_file_id)
        assert {r["error"]["code"] for r in errors} == {"batch_expired"}
        assert sorted(r["custom_id"] for r in errors) == sorted({"a", "b", "c"} - {ran})


async def test_a_second_driver_takes_over_a_lapsed_claim(tmp_path: Path, nats_server) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        await ensure_batch_resources(nc.jetstream())
        config = BatchConfig(claim_s=1.0)
        store = await open_batch_store(nc, config)
        data = jsonl([f"l{i}" for i in range(5)]).getvalue()
        await store.put_file(
            FileRecord(
                id="file-x", bytes=len(data), created_at=1, filename="x", purpose="batch", key_id="main"
            ),
            data,
        )
        created = int(time.time())
        await store.create_batch(
            BatchRecord(
                id="batch_t",
                endpoint="/v1/chat/completions",
                input_file_id="file-x",
                created_at=created,
                key_id="main",
            )
        )

        def deployment_of(key_id: str, model: str) -> str:
            return model

        first = BatchDriver(store, config, deployment_of, holder="east/one", tick_s=0.05)
        assert await first.step("batch_t") == "again"  # validated and enqueued, then it dies
        v = await store.batch("batch_t")
        assert (
            v.value.status == "in_progress"
            and v.value.claim is not None
            and v.value.claim.holder == "east/one"
        )
        second = BatchDriver(store, config, deployment_of, holder="west/two", tick_s=0.05)
        assert await second.step("batch_t") == "lost"  # the claim is live
        await run_lines(store, 5)
        task = asyncio.create_task(second.run())
        try:

            async def taken_over_and_completed() -> bool:
                return (await store.batch("batch_t")).value.status == "completed"

            await eventually(taken_over_and_completed, 15, "the second driver completed the batch")
        finally:
            task.cancel()
            await second.stop()
        done = (await store.batch("batch_t")).value
        assert done.request_counts.completed == 5 and done.output_file_id is not None
        assert done.finalizing_at is not None and done.finalizing_at >= v.value.claim.until - 1
    finally:
        await nc.close()
