"""Shadow copies through the gateway's request path, in-process: a real `Gateway` and its
ASGI app, the replicas played by an httpx mock transport that records what each was sent.
The copy never holds up the client, carries the original's body (the key's prefix-cache
salt, its adapter), is bounded in number, and never happens for an answer a peer gave."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from agent.gateway.app import build_app
from agent.gateway.gateway import Gateway
from agent.gateway.tenancy import SALT_FIELD
from fleet_base.cluster_config import ClusterConfig, GatewayConfig
from fleet_base.local_state import LocalState
from fleet_base.protocol import DesiredState, ShadowTarget, UsageRecord, VersionWeight
from tests.agent.gateway.harness import ClusterFiles, make_key, peer, replica, route
from tests.polling import eventually

DEPLOYMENT = "d"
SECRET, KEY = make_key("k")


def _answer(text: str) -> bytes:
    return json.dumps(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1,
            "model": DEPLOYMENT,
            "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        }
    ).encode()


async def _once(data: bytes, gate: asyncio.Event | None = None) -> AsyncIterator[bytes]:
    if gate is not None:
        await gate.wait()
    yield data


class Replicas:
    """Each host's answer text; what each was sent; s2 may be held (a slow shadow)."""

    def __init__(self) -> None:
        self.sent: dict[str, list[dict]] = {}
        self.text = {"r1": "abcdefgh", "s2": "abcdXfgh"}
        self.hold: asyncio.Event | None = None
        self.status: dict[str, int] = {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        self.sent.setdefault(host, []).append(json.loads(request.content))
        gate = self.hold if host == "s2" else None
        if host == "s2" and host in self.status:
            error = json.dumps({"error": {"message": "bad version"}}).encode()
            return httpx.Response(self.status[host], content=_once(error))
        return httpx.Response(200, headers={"content-type": "application/json"},
                              content=_once(_answer(self.text.get(host, "x")), gate))  # fmt: skip


class Shadowed:
    """Gateway "east" (jurisdiction `ca`): r1 serves version 1, s2 is the shadow version 2."""

    def __init__(self, tmp_path: Path, *, local_v1: bool = True, share: float = 1.0) -> None:
        config = ClusterConfig(
            cluster="east",
            region="east",
            state_dir=tmp_path,
            gateway=GatewayConfig(queue_timeout_s=0.3, key_state_max_age_s=3600, concurrency_targets={DEPLOYMENT: 4}),
        )  # fmt: skip
        table = route(
            DEPLOYMENT,
            [peer("east", "", 0, 0), peer("west", "http://west", 1, 1)],
            [VersionWeight(version=1, weight=1.0)],
        ).model_copy(update={"shadow": ShadowTarget(version=2, share=share)})
        table.clusters = [c.model_copy(update={"jurisdiction": "ca"}) for c in table.clusters]
        reps = [replica("s2", "http://s2", deployment=DEPLOYMENT, version=2)]
        if local_v1:
            reps.append(replica("r1", "http://r1", deployment=DEPLOYMENT, version=1))
        ClusterFiles(tmp_path, "east").write(replicas=reps, keys=[KEY], routes=[table])
        LocalState(tmp_path).save_desired(DesiredState(cluster="east", jurisdiction="ca"))
        self.gw = Gateway(config, nats=False)
        self.replicas = Replicas()
        client = httpx.AsyncClient(transport=httpx.MockTransport(self.replicas))
        self.gw.upstreams.client = self.gw.shadow.client = client
        self.records: list[UsageRecord] = []
        self.gw.usage.submit = self.records.append  # type: ignore[method-assign]
        self.app = build_app(config, self.gw)

    async def post(self, **body: object) -> httpx.Response:
        payload = {"model": DEPLOYMENT, "prompt": "hi", "max_tokens": 2, **body}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://gw") as c:
            return await c.post(
                "/v1/completions", json=payload, headers={"authorization": f"Bearer {SECRET}"}
            )

    def count(self, outcome: str) -> float:
        return self.gw.shadow.metrics.requests.labels(DEPLOYMENT, outcome)._value.get()


async def test_the_client_never_waits_for_its_copy(tmp_path: Path) -> None:
    s = Shadowed(tmp_path)
    s.replicas.hold = asyncio.Event()  # the shadow replica answers only when released
    r = await asyncio.wait_for(s.post(temperature=0), 5)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "abcdefgh"  # the original's
    assert r.headers["x-fleet-version"] == "1" and s.count("sent") == 1
    assert [rec.shadow for rec in s.records] == [False]  # the copy still runs
    s.replicas.hold.set()
    await eventually(lambda: len(s.records) == 2, 5, "the copy's record")
    original, copy = s.records
    assert copy.shadow and copy.shadow_of == original.record_id and copy.version == 2
    assert (copy.greedy_match, copy.first_diff_token) == (False, 1)  # from the second 4-character piece
    assert original.itl_s is None and s.count("completed") == 1
    # the copy is the original's body: the same key's prefix-cache salt, the same model
    (sent_original,), (sent_copy,) = s.replicas.sent["r1"], s.replicas.sent["s2"]
    assert sent_copy == sent_original and sent_copy[SALT_FIELD]


async def test_users_never_reach_the_shadow_version_and_a_peer_s_answer_is_not_copied(tmp_path: Path) -> None:
    s = Shadowed(tmp_path, local_v1=False)  # only the shadow version here: users go to the peer
    r = await s.post()
    assert r.status_code == 200 and "s2" not in s.replicas.sent and s.replicas.sent["west"]
    assert s.count("sent") == s.count("dropped_busy") == 0  # the peer that answers copies it


async def test_copies_are_bounded_in_number(tmp_path: Path) -> None:
    s = Shadowed(tmp_path)
    s.gw.shadow.max_copies = 1
    s.replicas.hold = asyncio.Event()
    assert (await s.post()).status_code == 200 and s.count("sent") == 1
    assert (await s.post()).status_code == 200 and s.count("dropped_busy") == 1  # not queued
    s.replicas.hold.set()
    await eventually(lambda: s.count("completed") == 1, 5, "the copy to end")
    assert len(s.replicas.sent["s2"]) == 1 and len(s.replicas.sent["r1"]) == 2
    await s.gw.shadow.close()


async def test_the_share_is_drawn_per_request(tmp_path: Path) -> None:
    s = Shadowed(tmp_path, share=0.5)
    for _ in range(40):
        assert (await s.post()).status_code == 200
    await eventually(lambda: s.count("completed") == s.count("sent"), 5, "the copies to end")
    assert 8 <= s.count("sent") <= 32 and len(s.replicas.sent["r1"]) == 40


async def test_a_failing_version_keeps_getting_copies_and_its_errors_are_counted(tmp_path: Path) -> None:
    s = Shadowed(tmp_path)
    s.replicas.status["s2"] = 500
    for _ in range(3):
        r = await s.post()
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "abcdefgh"
    await eventually(lambda: s.count("error") == 3, 5, "three failed copies")
    assert s.count("sent") == 3 and s.count("dropped_busy") == 0  # a 5xx is measured, not avoided
    copies = [r for r in s.records if r.shadow]
    assert [c.status for c in copies] == [500] * 3 and all(c.greedy_match is None for c in copies)
