"""Async requests on a live gateway (in this process, on a real socket) over a real
nats-server and the JetStream store: accepted with 202, run (the worker's part played
here: result stored, record finished, webhook enqueued, item acked), and POSTed to a
webhook receiver that is down (connection refused) for a while and comes up later:
delivered exactly once, and the Standard Webhooks library verifies it with the key's
secret; a refused webhook address is a 400; GET shows the delivered result."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import uvicorn
from standardwebhooks import Webhook

from agent.gateway.app import build_app
from agent.gateway.batch.async_api import finish_async_record
from agent.gateway.gateway import Gateway
from fleet_base.batch.models import LineResponse, LineResult, StoredResult
from fleet_base.batch.nats_store import NatsBatchStore
from fleet_base.batch.webhook_signing import encode_master, key_secret, new_master, read_master
from fleet_base.cluster_config import ClusterConfig
from fleet_base.ports import free_port
from tests.agent.batch.receiver import Receiver
from tests.agent.conftest import cluster_config
from tests.agent.gateway.harness import ClusterFiles, make_key, route
from tests.polling import eventually

SECRET, KEY = make_key("asyncowner")
OUTAGE_RETRIES = 5  # failed attempts while the receiver is down


@contextlib.asynccontextmanager
async def gateway_on(cfg: ClusterConfig) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient]]:
    gw = Gateway(cfg)
    assert gw.batch is not None
    server = uvicorn.Server(
        uvicorn.Config(build_app(cfg, gw), host="127.0.0.1", port=cfg.gateway.port, log_level="warning")
    )
    serve = asyncio.create_task(server.serve())
    client = httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{cfg.gateway.port}", headers={"authorization": f"Bearer {SECRET}"}
    )
    try:
        await eventually(
            lambda: gw.batch is not None and gw.batch.ready.is_set(), 20, "the batch store bound"
        )
        yield gw, client
    finally:
        await client.aclose()
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(serve, 10)


def config(tmp_path: Path, nats_url: str) -> ClusterConfig:
    master = tmp_path / "bundle" / "webhook-master"
    master.parent.mkdir()
    master.write_bytes(encode_master(new_master()))
    cfg = cluster_config(
        tmp_path,
        nats_url,
        gateway={"port": free_port(), "key_state_max_age_s": 3600},
        security={"webhook_master_file": str(master)},
        batch={"webhook_allow": ["127.0.0.1"], "webhook_backoff_s": 0.2, "webhook_backoff_max_s": 0.5},
    )
    ClusterFiles(cfg.state_dir, cfg.cluster).write(keys=[KEY], routes=[route("tiny", [])])
    return cfg


async def run_async_item(store: NatsBatchStore) -> str:
    """The worker's part for one async request: result stored, record finished, webhook due."""
    while True:
        deliveries = await store.pull("tiny", 0, 1, 2.0)
        if deliveries:
            break
    d = deliveries[0]
    item = d.item
    line = LineResult(
        id="chatcmpl-1",
        custom_id=item.custom_id,
        response=LineResponse(status_code=200, request_id="req-1", body={"echo": item.body["messages"]}),
    )
    await store.put_result(item.id, StoredResult(line=line, prompt_tokens=3, completion_tokens=1))
    await finish_async_record(store, item.parent_id, "succeeded", store.config, time.time())
    await d.ack()
    return item.parent_id


def deliveries(gw: Gateway, outcome: str) -> float:
    value = gw.metrics.registry.get_sample_value("fleet_batch_webhook_deliveries_total", {"outcome": outcome})
    return value or 0.0


async def test_a_webhook_down_for_a_while_is_delivered_once_and_verifies(tmp_path: Path, nats_server) -> None:
    cfg = config(tmp_path, nats_server.url)
    receiver = Receiver()
    async with gateway_on(cfg) as (gw, client):
        store = gw.batch.store  # type: ignore[union-attr]
        assert isinstance(store, NatsBatchStore)
        refused = await client.post(
            "/v1/async/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "x"}],
                "webhook_url": "http://10.1.2.3/",
            },
        )
        assert (
            refused.status_code == 400 and "10.1.2.3, a private address" in refused.json()["error"]["message"]
        )

        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "priority": 0}
        accepted = await client.post("/v1/async/chat/completions", json={**body, "webhook_url": receiver.url})
        assert accepted.status_code == 202, accepted.text
        request_id = accepted.json()["id"]
        assert await run_async_item(store) == request_id
        await eventually(lambda: deliveries(gw, "retried") >= OUTAGE_RETRIES, 30, "attempts while down")
        assert not receiver.received
        await receiver.start()
        try:
            await eventually(lambda: deliveries(gw, "delivered") == 1, 30, "the delivery")
            await asyncio.sleep(1.0)  # nothing more comes
            got = (await client.get(f"/v1/async/requests/{request_id}")).json()
        finally:
            await receiver.stop()
    assert len(receiver.received) == 1
    hook = receiver.received[0]
    secret = key_secret(read_master(cfg.security.webhook_master_file), KEY.key_id, KEY.webhook_secret_version)  # type: ignore[arg-type]
    payload = Webhook(secret).verify(hook.body, hook.headers)
    assert payload["id"] == request_id and payload["result"]["response"]["body"]["echo"] == body["messages"]
    assert payload["delivery_attempts"] > OUTAGE_RETRIES
    assert got["status"] == "succeeded" and got["delivery"] == "delivered" and got["delivered_at"]
    assert (
        got["result"]["custom_id"] == request_id and got["delivery_attempts"] == payload["delivery_attempts"]
    )
