"""An in-process gateway for batch tests: a real `Gateway`, its ASGI app, and replicas
played by an httpx mock transport that records what each was sent (headers and body) and
answers as each host is told to."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from agent.gateway.app import build_app
from agent.gateway.gateway import Gateway
from fleet_base.api_keys import ApiKeyRecord
from fleet_base.cluster_config import ClusterConfig, GatewayConfig
from fleet_base.domain import Coordinates
from fleet_base.protocol import ReplicaLoad, UsageRecord
from tests.agent.gateway.harness import ClusterFiles, make_key, replica, route

DEPLOYMENT = "d"
HERE = Coordinates(lat=45.5, lon=-73.6)

Behaviour = Callable[[httpx.Request], httpx.Response]


def answer(request: httpx.Request) -> httpx.Response:
    """A replica's non-streamed chat or text completion (usage 3 + 2)."""
    body = json.loads(request.content)
    text = "ok:" + json.dumps(body.get("messages") or body.get("prompt"), sort_keys=True)
    payload = {
        "id": "cmpl-1",
        "object": "chat.completion" if "messages" in body else "text_completion",
        "created": 1,
        "model": body.get("model"),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    return reply(200, payload)


def status(code: int) -> Behaviour:
    def behave(request: httpx.Request) -> httpx.Response:
        return reply(code, {"error": {"message": f"HTTP {code}", "type": "x", "code": None}})

    return behave


def reply(code: int, payload: dict) -> httpx.Response:
    """A response whose body arrives as a stream (the gateway reads it so)."""

    async def once() -> AsyncIterator[bytes]:
        yield json.dumps(payload).encode()

    return httpx.Response(code, headers={"content-type": "application/json"}, content=once())


@dataclass
class Sent:
    host: str
    headers: httpx.Headers
    body: dict


@dataclass
class Replicas:
    behaviour: dict[str, Behaviour] = field(default_factory=dict)
    sent: list[Sent] = field(default_factory=list)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        self.sent.append(Sent(host, request.headers, json.loads(request.content)))
        return self.behaviour.get(host, answer)(request)


class Fleet:
    """One gateway ("east") with ready replicas r1.. of DEPLOYMENT and the given keys."""

    def __init__(
        self,
        tmp_path: Path,
        keys: dict[str, tuple[str, ApiKeyRecord]] | None = None,
        *,
        replicas: int = 1,
        loads: dict[str, ReplicaLoad] | None = None,
        **gateway: object,
    ) -> None:
        self.keys = keys if keys is not None else {"main": make_key("main")}
        self.config = ClusterConfig(
            cluster="east",
            region="east",
            coordinates=HERE,
            state_dir=tmp_path,
            gateway=GatewayConfig(**{"queue_timeout_s": 0.3, "key_state_max_age_s": 3600, **gateway}),
        )
        self.files = ClusterFiles(tmp_path, "east")
        self.write(replicas, loads or {})
        self.gw = Gateway(self.config, nats=False)
        self.replicas = Replicas()
        self.gw.upstreams.client = httpx.AsyncClient(transport=httpx.MockTransport(self.replicas))
        self.records: list[UsageRecord] = []
        self.gw.usage.submit = self.records.append  # type: ignore[method-assign]
        self.app = build_app(self.config, self.gw)

    def write(self, replicas: int, loads: dict[str, ReplicaLoad]) -> None:
        reps = []
        for i in range(1, replicas + 1):
            r = replica(f"r{i}", f"http://r{i}", deployment=DEPLOYMENT)
            reps.append(r.model_copy(update={"load": loads.get(f"r{i}", ReplicaLoad())}))
        here = route(DEPLOYMENT, []).model_copy()
        self.files.write(replicas=reps, keys=[record for _, record in self.keys.values()], routes=[here])

    async def post(self, key: str, body: dict, headers: dict[str, str] | None = None) -> httpx.Response:
        headers = {"authorization": f"Bearer {self.keys[key][0]}", **(headers or {})}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://gw") as c:
            return await c.post("/v1/chat/completions", json=body, headers=headers)


def chat(content: str = "hi", **extra: object) -> dict:
    return {"model": DEPLOYMENT, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}
