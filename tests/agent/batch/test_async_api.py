"""The async endpoints on a gateway (in process, its state files written as the agent
would): 202 with the request object and one work item queued; the interactive path's
refusals; the webhook URL's SSRF refusal as a 400 that says why; a key sees only its own."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from starlette.applications import Starlette

from agent.gateway.batch.async_api import expire_queued_async
from agent.gateway.batch.service import BatchService, gateway_hooks
from agent.gateway.gateway import Gateway
from fleet_base.batch.config import BatchConfig
from fleet_base.batch.models import LineResponse, LineResult, StoredResult
from fleet_base.batch.names import RESULT_TTL_S, result_key
from fleet_base.batch.webhook_signing import new_master
from fleet_base.cluster_config import ClusterConfig, GatewayConfig
from fleet_base.domain import Coordinates
from tests.agent.batch.webhook_store import WebhookStore
from tests.agent.gateway.harness import DEPLOYMENT, ClusterFiles, make_key, replica

OWNER, OWNER_KEY = make_key("a0a0a0")
OTHER, OTHER_KEY = make_key("b1b1b1")
LIMITED, LIMITED_KEY = make_key("c2c2c2", deployments=["elsewhere"])
CONFIG = BatchConfig(webhook_allow=["10.9.0.0/16"])
CHAT = {"model": DEPLOYMENT, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
NOW = 1_800_000_000.0


async def resolve(host: str, port: int) -> Sequence[str]:
    return {"hooks.example.com": ["93.184.216.34"], "internal.example.com": ["10.0.0.3"]}[host]


class Api:
    def __init__(self, tmp_path: Path, *, can_sign: bool = True) -> None:
        config = ClusterConfig(
            cluster="east",
            region="east",
            coordinates=Coordinates(lat=0, lon=0),
            state_dir=tmp_path,
            gateway=GatewayConfig(key_state_max_age_s=3600),
        )
        ClusterFiles(tmp_path, "east").write(
            replicas=[replica("r1", "http://r1")], keys=[OWNER_KEY, OTHER_KEY, LIMITED_KEY], routes=[]
        )
        self.gw = Gateway(config, nats=False)
        self.store = WebhookStore()
        self.clock = NOW
        hooks = replace(
            gateway_hooks(self.gw), resolve=resolve, webhook_master=new_master() if can_sign else None
        )
        self.service = BatchService(CONFIG, hooks, store=self.store, clock=lambda: self.clock)  # type: ignore[arg-type]
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=Starlette(routes=self.service.routes())), base_url="http://gw"
        )

    async def post(self, path: str, body: Any, key: str | None = OWNER) -> httpx.Response:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return await self.client.post(f"/v1/async/{path}", json=body, headers=headers)

    async def get(self, request_id: str, key: str = OWNER) -> httpx.Response:
        return await self.client.get(
            f"/v1/async/requests/{request_id}", headers={"authorization": f"Bearer {key}"}
        )


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    a = Api(tmp_path)
    yield a
    await a.client.aclose()


async def test_accepted_and_queued(api: Api) -> None:
    body = {**CHAT, "webhook_url": "https://hooks.example.com/in", "priority": 0, "max_time_in_queue_s": 30}
    r = await api.post("chat/completions", body)
    assert r.status_code == 202, r.text
    out = r.json()
    assert out["object"] == "async.request" and out["id"].startswith("async_")
    assert (out["status"], out["priority"], out["delivery"], out["model"]) == (
        "queued",
        0,
        "pending",
        DEPLOYMENT,
    )
    assert out["endpoint"] == "/v1/chat/completions" and out["max_time_in_queue_s"] == 30
    assert "key_id" not in out
    [item] = api.store.queued
    assert (item.kind, item.parent_id, item.index, item.priority) == ("async", out["id"], None, 0)
    assert item.id == result_key(out["id"], None) and item.key_id == OWNER_KEY.key_id
    assert item.deployment == DEPLOYMENT and item.not_after == NOW + 30
    assert item.body == CHAT  # the request as the worker runs it: the async fields taken out
    assert api.store.records[out["id"]].value.key_id == OWNER_KEY.key_id


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("completions", {"model": DEPLOYMENT, "prompt": "hi", "max_tokens": 4}),
        ("embeddings", {"model": DEPLOYMENT, "input": "hi"}),
        ("responses", {"model": DEPLOYMENT, "input": "hi"}),
    ],
)
async def test_every_endpoint(api: Api, path: str, body: dict[str, Any]) -> None:
    r = await api.post(path, body)
    assert r.status_code == 202, r.text
    assert r.json()["endpoint"] == f"/v1/{path}"
    assert (r.json()["priority"], r.json()["max_time_in_queue_s"]) == (1, CONFIG.async_queue_default_s)
    assert r.json()["delivery"] == "none"


@pytest.mark.parametrize(
    ("body", "key", "status", "param", "message"),
    [
        ({**CHAT, "priority": 3}, OWNER, 400, "priority", "priority must be"),
        ({**CHAT, "priority": "1"}, OWNER, 400, "priority", "priority must be"),
        ({**CHAT, "priority": True}, OWNER, 400, "priority", "priority must be"),
        ({**CHAT, "max_time_in_queue_s": 0}, OWNER, 400, "max_time_in_queue_s", "above 0"),
        ({**CHAT, "max_time_in_queue_s": 1e9}, OWNER, 400, "max_time_in_queue_s", "at most 259200"),
        ({**CHAT, "webhook_url": 5}, OWNER, 400, "webhook_url", "non-empty string"),
        ({**CHAT, "webhook_url": "http://127.0.0.1:9/x"}, OWNER, 400, "webhook_url", "loopback"),
        ({**CHAT, "webhook_url": "http://169.254.169.254/"}, OWNER, 400, "webhook_url", "metadata"),
        ({**CHAT, "webhook_url": "https://internal.example.com/"}, OWNER, 400, "webhook_url", "10.0.0.3, a private"),
        ({**CHAT, "webhook_url": "https://u:p@hooks.example.com/"}, OWNER, 400, "webhook_url", "credentials"),
        ({**CHAT, "webhook_url": "gopher://hooks.example.com/"}, OWNER, 400, "webhook_url", "http:// or https://"),
        ({**CHAT, "stream": True}, OWNER, 400, "stream", "cannot stream"),
        ({"model": DEPLOYMENT}, OWNER, 400, "messages", "messages"),
        ({**CHAT, "model": "nope"}, OWNER, 404, "model", "does not exist"),
        (CHAT, LIMITED, 403, "model", "not allowed"),
        (CHAT, None, 401, None, "Missing API key"),
        ([1, 2], OWNER, 400, None, "JSON object"),
    ],
)  # fmt: skip
async def test_refusals(
    api: Api, body: Any, key: str | None, status: int, param: str | None, message: str
) -> None:
    r = await api.post("chat/completions", body, key)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == param
    assert not api.store.queued and not api.store.records


async def test_allow_listed_private_webhook(api: Api) -> None:
    r = await api.post("chat/completions", {**CHAT, "webhook_url": "http://10.9.4.4:8080/in"})
    assert r.status_code == 202, r.text


async def test_no_master_secret_no_webhooks(tmp_path: Path) -> None:
    api = Api(tmp_path, can_sign=False)
    r = await api.post("chat/completions", {**CHAT, "webhook_url": "https://hooks.example.com/in"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "webhooks_unavailable"
    assert (await api.post("chat/completions", CHAT)).status_code == 202  # polling still works
    await api.client.aclose()


async def test_status_and_result_for_the_owner_only(api: Api) -> None:
    request_id = (await api.post("chat/completions", CHAT)).json()["id"]
    r = await api.get(request_id)
    assert r.status_code == 200 and r.json()["status"] == "queued" and r.json()["result"] is None
    for key, rid in ((OTHER, request_id), (OWNER, "async_000000000000000000000000")):
        r = await api.get(rid, key)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    # the worker's part: result stored, record finished
    line = LineResult(
        id="r", custom_id=request_id, response=LineResponse(status_code=200, request_id="q", body={"ok": 1})
    )
    await api.store.put_result(result_key(request_id, None), StoredResult(line=line))
    current = api.store.records[request_id]
    finished = current.value.model_copy(
        update={"status": "succeeded", "finished_at": int(NOW), "result_expires_at": int(NOW + 60)}
    )
    await api.store.update_async(finished, current.revision)
    r = await api.get(request_id)
    assert r.json()["status"] == "succeeded" and r.json()["result"]["response"]["body"] == {"ok": 1}
    api.clock = NOW + 61  # past result_retention_s
    r = await api.get(request_id)
    assert r.status_code == 200 and r.json()["result"] is None


async def test_store_down_is_503(api: Api) -> None:
    api.store.down = True
    r = await api.post("chat/completions", CHAT)
    assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"
    assert (await api.get("async_x")).status_code == 503


async def test_store_not_bound_yet_is_503(api: Api) -> None:
    api.service.store = None  # the gateway's NATS is not up yet
    r = await api.post("chat/completions", CHAT)
    assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"


def test_the_webhook_loop_runs_only_where_it_can_sign(tmp_path: Path) -> None:
    assert Api(tmp_path / "a").service.loops and not Api(tmp_path / "b", can_sign=False).service.loops


async def test_a_request_not_queued_is_failed_not_left_queued(api: Api) -> None:
    api.store.enqueue_down = True
    r = await api.post("chat/completions", CHAT)
    assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"
    [record] = [v.value for v in api.store.records.values()]
    assert record.status == "failed" and record.finished_at is not None


async def test_a_request_nobody_pulls_is_expired_by_the_sweep(api: Api) -> None:
    body = {**CHAT, "webhook_url": "https://hooks.example.com/in", "max_time_in_queue_s": 30}
    r = await api.post("chat/completions", body)
    request_id = r.json()["id"]
    assert await expire_queued_async(api.store, CONFIG, NOW + 29) == 0
    assert api.store.records[request_id].value.status == "queued"
    assert await expire_queued_async(api.store, CONFIG, NOW + 32) == 1
    record = api.store.records[request_id].value
    assert record.status == "expired" and record.finished_at == int(NOW + 32)
    stored = api.store.results[result_key(request_id, None)]
    assert stored.line.error is not None and stored.line.error.code == "expired"
    assert api.store.webhooks.qsize() == 1  # its webhook fires
    assert await expire_queued_async(api.store, CONFIG, NOW + 40) == 0  # once


def test_a_retention_longer_than_the_results_bucket_keeps_is_refused() -> None:
    assert BatchConfig(result_retention_s=RESULT_TTL_S).result_retention_s == RESULT_TTL_S
    with pytest.raises(ValidationError):
        BatchConfig(result_retention_s=RESULT_TTL_S + 1)
