"""The Files and Batches API through the unmodified OpenAI SDK, on the gateway's own app
(auth, errors) with an in-memory store: upload, create, list, get, cancel; refusals in
OpenAI's shape; another key's ids are 404."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from agent.gateway.app import build_app
from agent.gateway.batch.service import BatchService, gateway_hooks
from agent.gateway.gateway import Gateway
from fleet_base.batch.config import BatchConfig
from fleet_base.cluster_config import ClusterConfig
from tests.agent.batch.memory_store import MemoryBatchStore
from tests.agent.gateway.harness import ClusterFiles, make_key, route
from tests.polling import eventually

KEYS = {
    "main": make_key("main"),
    "other": make_key("other"),
    "admin": make_key("admin", scopes=["admin"]),
    "narrow": make_key("narrow", deployments=["elsewhere"]),
}


class Env:
    def __init__(self, gateway: Gateway, store: MemoryBatchStore, app: object) -> None:
        self.gateway = gateway
        self.store = store
        self.app = app

    def client(self, key: str = "main") -> AsyncOpenAI:
        transport = httpx.ASGITransport(app=self.app)  # type: ignore[arg-type]
        http = httpx.AsyncClient(transport=transport, base_url="http://gw")
        return AsyncOpenAI(api_key=KEYS[key][0], base_url="http://gw/v1", http_client=http, max_retries=0)

    def http(self, key: str | None = "main") -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {KEYS[key][0]}"} if key else {}
        transport = httpx.ASGITransport(app=self.app)  # type: ignore[arg-type]
        return httpx.AsyncClient(transport=transport, base_url="http://gw", headers=headers)


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    config = ClusterConfig.model_validate(
        {
            "cluster": "east",
            "region": "east",
            "coordinates": {"lat": 0, "lon": 0},
            "state_dir": str(tmp_path / "state"),
            "gateway": {"key_state_max_age_s": 3600, "max_body_bytes": 4096},
            "batch": BatchConfig(max_file_bytes=64 * 1024).model_dump(),
        }
    )
    ClusterFiles(config.state_dir, "east").write(
        keys=[r for _, r in KEYS.values()], routes=[route("tiny", []), route("elsewhere", [])]
    )
    gateway = Gateway(config, nats=False)
    store = MemoryBatchStore()
    gateway.batch = BatchService(config.batch, gateway_hooks(gateway), store=store, tick_s=0.05)
    yield Env(gateway, store, build_app(config, gateway))
    await gateway.batch.stop()


def jsonl(n: int, url: str = "/v1/chat/completions", model: str = "tiny") -> bytes:
    rows = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": url,
            "body": {"model": model, "messages": [{"role": "user", "content": str(i)}]},
        }
        for i in range(n)
    ]
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


async def test_upload_create_list_get_cancel_with_the_openai_sdk(env: Env) -> None:
    client = env.client()
    data = jsonl(3)
    file = await client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    assert file.id.startswith("file-") and file.bytes == len(data) and file.purpose == "batch"
    assert file.filename == "in.jsonl" and file.object == "file"
    assert (await client.files.retrieve(file.id)).id == file.id
    assert (await client.files.content(file.id)).content == data
    listed = await client.files.list()
    assert [f.id for f in listed.data] == [file.id]

    batch = await client.batches.create(
        input_file_id=file.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "eval"},
    )
    assert batch.status == "validating" and batch.input_file_id == file.id
    assert batch.metadata == {"job": "eval"} and batch.expires_at == batch.created_at + 24 * 3600
    assert batch.request_counts is not None and batch.request_counts.total == 0
    got = await client.batches.retrieve(batch.id)
    assert got.id == batch.id and got.endpoint == "/v1/chat/completions"

    more = [
        await client.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        for _ in range(2)
    ]
    page = await client.batches.list(limit=2)
    ids = {b.id for b in [batch, *more]}
    assert len(page.data) == 2 and page.has_more
    rest = await client.batches.list(limit=2, after=page.data[-1].id)
    assert len(rest.data) == 1 and not rest.has_more
    assert {b.id for b in page.data + rest.data} == ids
    everything = [b.id async for b in client.batches.list(limit=1)]  # the SDK's own paging
    assert sorted(everything) == sorted(ids)

    cancelled = await client.batches.cancel(batch.id)
    assert cancelled.status == "cancelling" and cancelled.cancelling_at is not None
    assert (await client.batches.cancel(batch.id)).status == "cancelling"  # again: as it is

    with pytest.raises(openai.ConflictError) as refused:  # its batches still read it
        await client.files.delete(file.id)
    assert refused.value.code == "file_in_use"
    for b in [batch, *more]:
        v = await env.store.batch(b.id)
        await env.store.update_batch(v.value.model_copy(update={"status": "cancelled"}), v.revision)
    deleted = await client.files.delete(file.id)
    assert deleted.id == file.id and deleted.deleted and deleted.object == "file"
    with pytest.raises(openai.NotFoundError):
        await client.files.retrieve(file.id)


async def test_another_keys_ids_are_not_found(env: Env) -> None:
    mine = env.client("main")
    file = await mine.files.create(file=("in.jsonl", io.BytesIO(jsonl(1))), purpose="batch")
    batch = await mine.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    theirs = env.client("other")
    for call in (
        theirs.files.retrieve(file.id),
        theirs.files.content(file.id),
        theirs.files.delete(file.id),
        theirs.batches.retrieve(batch.id),
        theirs.batches.cancel(batch.id),
        theirs.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError) as err:
            await call
        assert err.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    assert (await theirs.files.list()).data == []
    assert (await theirs.batches.list()).data == []
    assert (await mine.batches.retrieve(batch.id)).status == "validating"


async def test_keys_are_checked_as_for_inference(env: Env) -> None:
    async with env.http(None) as anonymous:
        r = await anonymous.get("/v1/batches")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    async with env.http("admin") as admin:  # an admin key runs no inference
        r = await admin.post("/v1/files", files={"file": ("a.jsonl", b"{}")}, data={"purpose": "batch"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope"


@pytest.mark.parametrize(
    ("form", "status", "code"),
    [
        ({"purpose": "fine-tune"}, 400, "invalid_value"),
        ({}, 400, "missing_required_parameter"),
        ({"purpose": "batch", "big": True}, 413, "file_too_large"),
        ({"purpose": "batch", "no_file": True}, 400, "missing_required_parameter"),
    ],
)
async def test_uploads_are_refused_with_a_reason(env: Env, form: dict, status: int, code: str) -> None:
    data = b"x" * (65 * 1024) if form.pop("big", False) else jsonl(1)
    files = None if form.pop("no_file", False) else {"file": ("a.jsonl", data)}
    async with env.http() as http:
        r = (
            await http.post("/v1/files", files=files, data=form)
            if files
            else await http.post(
                "/v1/files",
                data=form,
                headers={"content-type": "multipart/form-data; boundary=x"},
                content=b"--x--\r\n",
            )
        )
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code


@pytest.mark.parametrize(
    ("change", "code", "param"),
    [
        ({"endpoint": "/v1/images"}, "invalid_value", "endpoint"),
        ({"completion_window": "1h"}, "invalid_value", "completion_window"),
        ({"completion_window": ["24h"]}, "invalid_value", "completion_window"),
        ({"completion_window": {"h": 24}}, "invalid_value", "completion_window"),
        ({"endpoint": ["/v1/chat/completions"]}, "invalid_value", "endpoint"),
        ({"endpoint": {"a": 1}}, "invalid_value", "endpoint"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "invalid_value", "metadata"),
        ({"metadata": {"k": "v" * 513}}, "invalid_value", "metadata"),
        ({"input_file_id": None}, "missing_required_parameter", "input_file_id"),
    ],
)
async def test_batch_creation_is_refused_with_a_reason(env: Env, change: dict, code: str, param: str) -> None:
    client = env.client()
    file = await client.files.create(file=("in.jsonl", io.BytesIO(jsonl(1))), purpose="batch")
    body = {
        "input_file_id": file.id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        **change,
    }
    async with env.http() as http:
        r = await http.post("/v1/batches", json=body)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == (code, param)


async def test_a_batch_of_output_files_or_a_finished_batch_is_refused(env: Env) -> None:
    client = env.client()
    file = await client.files.create(file=("in.jsonl", io.BytesIO(jsonl(1))), purpose="batch")
    record = await env.store.file(file.id)
    out = await env.store.put_file(
        record.model_copy(update={"id": "file-out", "purpose": "batch_output"}), b"{}\n"
    )
    with pytest.raises(openai.BadRequestError):
        await client.batches.create(
            input_file_id=out.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    batch = await client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    v = await env.store.batch(batch.id)
    await env.store.update_batch(v.value.model_copy(update={"status": "completed"}), v.revision)
    with pytest.raises(openai.ConflictError):
        await client.batches.cancel(batch.id)


async def test_the_driver_runs_in_the_service(env: Env) -> None:
    """Started, the service's driver validates a batch with the gateway's own key check: a
    key not allowed the lines' model gets every line back as an error line."""
    assert env.gateway.batch is not None
    await env.gateway.batch.start()
    client = env.client("narrow")
    file = await client.files.create(file=("in.jsonl", io.BytesIO(jsonl(2))), purpose="batch")
    batch = await client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )

    async def done() -> bool:
        return (await client.batches.retrieve(batch.id)).status == "completed"

    await eventually(done, 10, "the batch completed")
    final = await client.batches.retrieve(batch.id)
    assert final.output_file_id is None and final.error_file_id is not None
    assert final.request_counts is not None and final.request_counts.failed == 2
    errors = [json.loads(r) for r in (await client.files.content(final.error_file_id)).content.splitlines()]
    assert {e["error"]["code"] for e in errors} == {"model_not_allowed"}
    assert {e["custom_id"] for e in errors} == {"r0", "r1"}


async def test_the_store_unbound_or_down_is_a_503(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    import nats.errors

    assert env.gateway.batch is not None
    async with env.http() as http:
        env.gateway.batch.store = None
        r = await http.get("/v1/batches")
        assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"
        env.gateway.batch.store = env.store

        async def down(*_: object) -> None:
            raise nats.errors.ConnectionClosedError

        monkeypatch.setattr(env.store, "batches", down)
        r = await http.get("/v1/batches")
        assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("multipart/form-data", b"garbage"),  # no boundary
        ("multipart/form-data; boundary=x", b"--x\r\nContent-Disposition: form-data\r\n\r\nv\r\n--x--\r\n"),
        ("application/json", b'{"purpose": "batch"}'),
    ],
)
async def test_a_malformed_upload_is_a_400(env: Env, content_type: str, body: bytes) -> None:
    async with env.http() as http:
        r = await http.post("/v1/files", content=body, headers={"content-type": content_type})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
