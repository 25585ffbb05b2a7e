"""Any JSON body sent to the Files, Batches and async endpoints is answered, never with a
5xx: a wrong type anywhere is the client's 4xx."""

from __future__ import annotations

import asyncio
import tempfile
from functools import cache
from pathlib import Path

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.gateway.app import build_app
from agent.gateway.batch.service import BatchService, gateway_hooks
from agent.gateway.gateway import Gateway
from fleet_base.batch.config import BatchConfig
from fleet_base.cluster_config import ClusterConfig
from tests.agent.batch.memory_store import MemoryBatchStore
from tests.agent.gateway.harness import ClusterFiles, make_key, route

KEY = make_key("main")
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
FIELDS = {
    "/v1/batches": ["input_file_id", "endpoint", "completion_window", "metadata"],
    "/v1/async/chat/completions": [
        "model",
        "messages",
        "webhook_url",
        "priority",
        "max_time_in_queue_s",
        "stream",
        "max_tokens",
    ],
    "/v1/async/embeddings": ["model", "input", "priority", "max_time_in_queue_s"],
}
GOOD = {
    "/v1/batches": {
        "input_file_id": "file-x",
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    },
    "/v1/async/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/async/embeddings": {"model": "tiny", "input": "hi"},
}


@cache
def app() -> object:
    state = Path(tempfile.mkdtemp()) / "state"
    config = ClusterConfig.model_validate(
        {
            "cluster": "east",
            "region": "east",
            "coordinates": {"lat": 0, "lon": 0},
            "state_dir": str(state),
            "gateway": {"key_state_max_age_s": 3600, "max_body_bytes": 4096},
            "batch": BatchConfig(max_file_bytes=64 * 1024).model_dump(),
        }
    )
    ClusterFiles(config.state_dir, "east").write(keys=[KEY[1]], routes=[route("tiny", [])])
    gateway = Gateway(config, nats=False)
    gateway.batch = BatchService(config.batch, gateway_hooks(gateway), store=MemoryBatchStore())
    return build_app(config, gateway)


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, object]:
    path = draw(st.sampled_from(sorted(FIELDS)))
    if draw(st.booleans()):
        return path, draw(JSON)
    body = dict(GOOD[path])
    for name in draw(st.lists(st.sampled_from(FIELDS[path]), max_size=3)):
        body[name] = draw(JSON)
    return path, body


async def _post(path: str, body: object) -> int:
    transport = httpx.ASGITransport(app=app())  # type: ignore[arg-type]
    headers = {"Authorization": f"Bearer {KEY[0]}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://gw", headers=headers) as http:
        return (await http.post(path, json=body)).status_code


async def _upload(purpose: object, content: bytes) -> int:
    transport = httpx.ASGITransport(app=app())  # type: ignore[arg-type]
    headers = {"Authorization": f"Bearer {KEY[0]}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://gw", headers=headers) as http:
        files = {"file": ("in.jsonl", content)}
        return (await http.post("/v1/files", data={"purpose": str(purpose)}, files=files)).status_code


@settings(max_examples=60, deadline=None)
@given(requests())
def test_batches_and_async_bodies_never_answer_5xx(request: tuple[str, object]) -> None:
    path, body = request
    assert asyncio.run(_post(path, body)) < 500


@settings(max_examples=20, deadline=None)
@given(
    st.sampled_from(["batch", "fine-tune", "", "batch_output"]) | st.text(max_size=8), st.binary(max_size=64)
)
def test_file_uploads_never_answer_5xx(purpose: object, content: bytes) -> None:
    assert asyncio.run(_upload(purpose, content)) < 500
