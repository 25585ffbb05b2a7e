"""What a deployment's engine cannot serve is refused before routing, and the per-key cache
salt goes only to engines whose prefix cache takes it.

`refusal` is table-tested; the in-process gateway (its ASGI app, the replica played by an
httpx mock transport that records what it was sent: a stand-in, no engine runs) shows that a
refused request never reaches a replica and that the body and the prefix keys follow the
deployment's engine."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from agent.gateway.app import build_app
from agent.gateway.engine_gate import CODE, refusal
from agent.gateway.gateway import Gateway
from agent.gateway.inputs import parse_request
from agent.gateway.prefix import prefix_keys
from agent.gateway.tenancy import SALT_FIELD, body_for, cache_salt
from fleet_base import engines
from fleet_base.cluster_config import ClusterConfig, GatewayConfig
from fleet_base.engines import EngineCapabilities
from fleet_base.local_state import LocalState
from fleet_base.protocol import DesiredState, ReplicaSpec
from tests.agent.gateway.harness import ClusterFiles, make_key, peer, replica, route

DEPLOYMENT = "d"
SECRET, KEY = make_key("k")
SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}


@pytest.mark.parametrize(
    "kind, args, endpoint, body, param",
    [
        # embeddings: only where the deployment serves them
        ("vllm", {}, "embeddings", {"input": "hi"}, "model"),
        ("vllm", {"runner": "pooling"}, "embeddings", {"input": "hi"}, None),
        ("sglang", {}, "embeddings", {"input": "hi"}, "model"),
        ("sglang", {"is_embedding": True}, "embeddings", {"input": "hi"}, None),
        ("llama.cpp", {}, "embeddings", {"input": "hi"}, "model"),
        ("fleet", {}, "embeddings", {"input": "hi"}, None),
        # what every engine serves today
        ("llama.cpp", {}, "chat", {"messages": [], "response_format": SCHEMA}, None),
        ("sglang", {}, "completions", {"prompt": [1, 2, 3]}, None),
        ("vllm", {}, "chat", {"messages": []}, None),
    ],
)
def test_refusal_per_engine(kind, args, endpoint, body, param):
    err = refusal(DEPLOYMENT, kind, args, endpoint, body)
    if param is None:
        assert err is None
    else:
        assert err is not None and (err.status, err.param, err.code) == (400, param, CODE)
        assert f"deployment {DEPLOYMENT!r} runs engine {kind}, which does not serve" in err.message


@pytest.mark.parametrize(
    "endpoint, body, param",
    [
        ("chat", {"messages": [], "response_format": SCHEMA}, "response_format"),
        ("chat", {"messages": [], "response_format": {"type": "json_object"}}, "response_format"),
        ("chat", {"messages": [], "response_format": {"type": "text"}}, None),
        ("responses", {"input": "x", "text": {"format": SCHEMA}}, "text.format"),
        ("responses", {"input": "x", "text": {"format": {"type": "text"}}}, None),
        ("completions", {"prompt": [1, 2]}, "prompt"),
        ("completions", {"prompt": [[1, 2], [3]]}, "prompt"),
        ("completions", {"prompt": ["a", "b"]}, None),
        ("completions", {"prompt": "a"}, None),
        ("embeddings", {"input": [5, 6]}, "input"),
        ("embeddings", {"input": ["a"]}, None),
    ],
)
def test_refusal_of_what_an_engine_lacks(monkeypatch, endpoint, body, param):
    """An engine without structured outputs or token-id prompts (none ships so today: a
    stand-in row in the table)."""
    bare = engines.CAPABILITIES["fleet"].model_copy(
        update={"structured_outputs": False, "prompt_token_ids": False}
    )
    assert isinstance(bare, EngineCapabilities)
    monkeypatch.setitem(engines.CAPABILITIES, "fleet", bare)
    err = refusal(DEPLOYMENT, "fleet", {}, endpoint, body)
    assert (err.param if err else None) == param


@pytest.mark.parametrize("salted", [True, False])
def test_the_body_carries_the_salt_only_for_an_engine_that_takes_it(salted):
    raw = json.dumps({"model": DEPLOYMENT, "prompt": "hi", "max_tokens": 2, SALT_FIELD: "client's"}).encode()
    info = parse_request(raw, "completions")
    sent = json.loads(body_for(info, "k", False, salted))
    assert sent.get(SALT_FIELD) == (cache_salt("k") if salted else None)  # never the client's
    assert json.loads(body_for(info, "k", True, salted))[SALT_FIELD] == "client's"  # a peer salts itself


async def _once(body: dict) -> AsyncIterator[bytes]:
    yield json.dumps(body).encode()


class Served:
    """Gateway "east" with one replica r1 of deployment d on `engine`."""

    def __init__(self, tmp_path: Path, engine: engines.EngineKind, engine_args: dict | None = None) -> None:
        config = ClusterConfig(
            cluster="east",
            region="east",
            state_dir=tmp_path,
            gateway=GatewayConfig(queue_timeout_s=0.3, key_state_max_age_s=3600),
        )
        rep = replica("r1", "http://r1", deployment=DEPLOYMENT).model_copy(update={"engine": engine})
        table = route(DEPLOYMENT, [peer("east", "", 0, 0)])
        ClusterFiles(tmp_path, "east").write(replicas=[rep], keys=[KEY], routes=[table])
        spec = ReplicaSpec(
            replica_id="r1",
            deployment=DEPLOYMENT,
            version=1,
            model="m",
            engine=engine,
            engine_args=engine_args or {},
        )
        LocalState(tmp_path).save_desired(DesiredState(cluster="east", replicas=[spec]))
        self.gw = Gateway(config, nats=False)
        self.sent: list[tuple[str, dict]] = []
        self.gw.upstreams.client = httpx.AsyncClient(transport=httpx.MockTransport(self._replica))
        self.gw.usage.submit = lambda record: None  # type: ignore[method-assign]
        self.app = build_app(config, self.gw)

    def _replica(self, request: httpx.Request) -> httpx.Response:
        self.sent.append((request.url.path, json.loads(request.content)))
        answer = {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1,
            "model": DEPLOYMENT,
            "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
        return httpx.Response(200, headers={"content-type": "application/json"}, content=_once(answer))

    async def post(self, path: str, **body: object) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://gw") as c:
            return await c.post(
                path, json={"model": DEPLOYMENT, **body}, headers={"authorization": f"Bearer {SECRET}"}
            )


async def test_embeddings_on_a_generative_vllm_model_are_a_400_before_routing(tmp_path: Path) -> None:
    s = Served(tmp_path, "vllm")
    r = await s.post("/v1/embeddings", input="hi")
    assert r.status_code == 400 and s.sent == []  # no replica asked, nothing retried
    error = r.json()["error"]
    assert error["code"] == CODE and error["param"] == "model"
    assert error["message"] == f"deployment {DEPLOYMENT!r} runs engine vllm, which does not serve embeddings"


@pytest.mark.parametrize("engine, salted", [("vllm", True), ("sglang", False), ("llama.cpp", False)])
async def test_the_salt_follows_the_deployment_s_engine(tmp_path: Path, engine, salted) -> None:
    s = Served(tmp_path, engine)
    r = await s.post("/v1/completions", prompt="hi", max_tokens=1, **{SALT_FIELD: "client's"})
    assert r.status_code == 200
    ((path, body),) = s.sent
    assert path == "/v1/completions"
    assert body.get(SALT_FIELD) == (cache_salt(KEY.key_id) if salted else None)


def test_prefix_keys_of_an_unsalted_engine_match_its_unsalted_events(tmp_path: Path) -> None:
    s = Served(tmp_path, "sglang")
    assert s.gw.prefix.model.prefix  # prefix routing is the default
    ids = tuple(range(64))
    raw = json.dumps({"model": DEPLOYMENT, "prompt": "x", "max_tokens": 1}).encode()
    info = replace(parse_request(raw, "completions"), prompt_ids=ids)
    size = s.gw.prefix.block_tokens(DEPLOYMENT)
    assert s.gw.prefix.keys(info, "k", salted=False) == prefix_keys(ids, size, None)
    assert s.gw.prefix.keys(info, "k") == prefix_keys(ids, size, cache_salt("k"))
    assert prefix_keys(ids, size, None) != prefix_keys(ids, size, cache_salt("k"))
