"""Residency through the gateway's whole request path, in-process: a real `Gateway` and its
ASGI app, upstreams (replicas here, peer gateways) played by an httpx mock transport that
records every host the gateway sends to. Each path a request can take (served here,
forwarded, failed over, retried, migrated mid-stream, a peer's forward) keeps inside the
allowed set, and what cannot is refused with an error naming residency."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest

from agent.gateway.app import build_app
from agent.gateway.gateway import Gateway
from agent.gateway.plan import Attempt
from agent.gateway.proxy import AttemptFailed
from fleet_base.api_keys import ApiKeyRecord
from fleet_base.cluster_config import ClusterConfig, GatewayConfig
from fleet_base.domain import Coordinates
from fleet_base.local_state import LocalState
from fleet_base.openai_contract.continuation import RESUME_FIELD, TOKEN_IDS_FIELD
from fleet_base.protocol import ClusterRoute, DesiredState, ReplicaState, UsageRecord
from tests.agent.gateway.harness import ClusterFiles, make_key, peer, replica, route

DEPLOYMENT = "d"
MONTREAL = Coordinates(lat=45.5, lon=-73.6)


def _peer(name: str, lat: float, lon: float, jurisdiction: str, **kw: object) -> ClusterRoute:
    return peer(name, f"http://{name}", lat, lon, **kw).model_copy(update={"jurisdiction": jurisdiction})  # type: ignore[arg-type]


US = _peer("us-1", 42.4, -71.1, "us")  # Boston: the nearest peer, outside `ca`
CA2 = _peer("ca-2", 49.3, -123.1, "ca")  # Vancouver: far, inside `ca`


def _key(name: str, residency: list[str] | None) -> tuple[str, ApiKeyRecord]:
    secret, record = make_key(name)
    return secret, record.model_copy(update={"residency": residency})


KEYS = {"ca": _key("kca", ["ca"]), "us": _key("kus", ["us"]), "any": _key("kany", None)}


def _chunk(text: str, ids: list[int], finish: str | None = None, usage: bool = False) -> bytes:
    choice = {"index": 0, "text": text, "finish_reason": finish, TOKEN_IDS_FIELD: ids}
    payload: dict = {"id": "cmpl-1", "object": "text_completion", "created": 1, "choices": [choice]}
    if usage:
        payload["usage"] = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def _whole_stream() -> AsyncIterator[bytes]:
    yield _chunk("Hel", [1])
    yield _chunk("lo", [2, 3], finish="stop", usage=True)
    yield b"data: [DONE]\n\n"


async def _broken_stream() -> AsyncIterator[bytes]:
    yield _chunk("Hel", [1])
    raise httpx.ReadError("the replica died")


async def _continuation() -> AsyncIterator[bytes]:
    yield _chunk("lo", [2, 3], finish="stop", usage=True)
    yield b"data: [DONE]\n\n"


Behaviour = Callable[[httpx.Request], httpx.Response]


def ok(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    if body.get("stream"):
        stream = _continuation() if RESUME_FIELD in body else _whole_stream()
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream)
    answer = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": DEPLOYMENT,
        "choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }
    return httpx.Response(
        200, headers={"content-type": "application/json"}, content=_once(json.dumps(answer))
    )


async def _once(text: str) -> AsyncIterator[bytes]:
    yield text.encode()


def refused(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def breaks_midstream(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=_broken_stream())


class Upstreams:
    """Every upstream host: what it does, and who was sent what."""

    def __init__(self) -> None:
        self.behaviour: dict[str, Behaviour] = {}
        self.hits: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        self.hits.append(host)
        return self.behaviour.get(host, ok)(request)


class Fleet:
    """One gateway ("east", in `ca`) with a replica r1 here and the peers of its route."""

    def __init__(
        self,
        tmp_path: Path,
        *,
        jurisdiction: str | None = "ca",
        peers: tuple[ClusterRoute, ...] = (US, CA2),
        residency: list[str] | None = None,
        replica_state: ReplicaState | None = ReplicaState.ready,
    ) -> None:
        config = ClusterConfig(
            cluster="east",
            region="east",
            coordinates=MONTREAL,
            state_dir=tmp_path,
            gateway=GatewayConfig(queue_timeout_s=0.3, key_state_max_age_s=3600),
        )
        here = _peer("east", 45.5, -73.6, jurisdiction or "").model_copy(update={"gateway_url": ""})
        table = route(DEPLOYMENT, [here, *peers]).model_copy(update={"residency": residency})
        reps = (
            []
            if replica_state is None
            else [replica("r1", "http://r1", deployment=DEPLOYMENT, state=replica_state)]
        )
        ClusterFiles(tmp_path, "east").write(
            replicas=reps, keys=[record for _, record in KEYS.values()], routes=[table]
        )
        if jurisdiction is not None:
            LocalState(tmp_path).save_desired(DesiredState(cluster="east", jurisdiction=jurisdiction))
        self.gw = Gateway(config, nats=False)
        self.upstreams = Upstreams()
        self.gw.upstreams.client = httpx.AsyncClient(transport=httpx.MockTransport(self.upstreams))
        self.records: list[UsageRecord] = []
        self.gw.usage.submit = self.records.append  # type: ignore[method-assign]
        self.app = build_app(config, self.gw)

    async def post(
        self, key: str, *, stream: bool = False, forwarded_by: str | None = None
    ) -> httpx.Response:
        headers = {"authorization": f"Bearer {KEYS[key][0]}"}
        if forwarded_by is not None:  # a peer's forward on an unsecured network
            headers["X-Fleet-Forwarded"] = forwarded_by
        body = {"model": DEPLOYMENT, "prompt": "hi", "max_tokens": 4, "stream": stream}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://gw") as c:
            return await c.post("/v1/completions", json=body, headers=headers)

    def refused(self, reason: str) -> float:
        return self.gw.residency.refused.labels(reason)._value.get()


def _error(response: httpx.Response) -> dict:
    return response.json()["error"]


# ---------------------------------------------------------------- refusals at the door


async def test_a_key_bound_elsewhere_is_refused_before_any_work(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    r = await fleet.post("us")
    assert r.status_code == 403
    err = _error(r)
    assert err["code"] == "residency_violation" and "residency" in err["message"] and "us" in err["message"]
    assert fleet.upstreams.hits == [] and fleet.refused("key_outside") == 1
    assert (await fleet.post("ca")).status_code == 200 and (await fleet.post("any")).status_code == 200


async def test_a_gateway_that_knows_no_jurisdiction_refuses_every_bound_key(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, jurisdiction=None)  # no desired.json yet
    assert _error(await fleet.post("ca"))["code"] == "residency_violation"
    assert (await fleet.post("any")).status_code == 200  # no policy: served as before


async def test_a_peer_re_checks_a_forward_against_its_own_jurisdiction(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, residency=["us"])  # the deployment may be processed in `us` only
    r = await fleet.post("any", forwarded_by="us-1")
    assert r.status_code == 403 and _error(r)["code"] == "residency_violation"
    assert "forwarded" in _error(r)["message"] and fleet.refused("forward_outside") == 1
    r = await fleet.post("us", forwarded_by="us-1")  # the vouched key is checked too
    assert r.status_code == 403 and fleet.refused("key_outside") == 1
    assert fleet.upstreams.hits == []


# ---------------------------------------------------------------- every stage of the plan


async def test_local_and_forward_stay_inside_the_deployments_residency(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, residency=["us"])  # not served here (ca): forwarded to us-1
    r = await fleet.post("any")
    assert r.status_code == 200 and fleet.upstreams.hits == ["us-1"]
    fleet = Fleet(tmp_path / "b", residency=["ca"])  # served here, though us-1 is nearer
    assert (await fleet.post("any")).status_code == 200 and fleet.upstreams.hits == ["r1"]


async def test_failover_and_its_retries_skip_peers_outside(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    fleet.upstreams.behaviour = {"r1": refused, "ca-2": refused}
    r = await fleet.post("ca")  # r1 fails (retried), then only ca-2, never the nearer us-1
    assert "us-1" not in fleet.upstreams.hits and "ca-2" in fleet.upstreams.hits
    assert r.status_code in (502, 503)
    fleet.upstreams.hits.clear()
    fleet.upstreams.behaviour = {"r1": refused}
    assert (await fleet.post("any")).status_code == 200  # another key fails over anywhere
    assert fleet.upstreams.hits[-1] == "us-1"


async def test_failover_with_only_peers_outside_is_refused_naming_residency(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, peers=(US,))
    fleet.upstreams.behaviour = {"r1": refused}
    r = await fleet.post("ca")
    assert r.status_code == 503 and r.headers["retry-after"]
    err = _error(r)
    assert err["code"] == "residency_unavailable" and "residency" in err["message"]
    assert set(fleet.upstreams.hits) == {"r1"} and fleet.refused("unavailable") == 1


async def test_no_replica_here_and_only_peers_outside(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, peers=(US,), replica_state=ReplicaState.failed)
    r = await fleet.post("ca")  # at once: nothing here will come back by itself
    assert r.status_code == 503 and _error(r)["code"] == "residency_unavailable"
    assert fleet.upstreams.hits == []
    assert (await fleet.post("any")).status_code == 200 and fleet.upstreams.hits == ["us-1"]


async def test_a_wait_for_a_starting_replica_ends_naming_residency(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, peers=(US,), replica_state=ReplicaState.starting)
    r = await fleet.post("ca")  # waits the queue timeout for the replica starting here
    assert r.status_code == 503 and _error(r)["code"] == "residency_unavailable"
    assert fleet.upstreams.hits == []


async def test_a_broken_stream_migrates_only_inside(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    fleet.upstreams.behaviour = {"r1": breaks_midstream}
    r = await fleet.post("ca", stream=True)
    assert r.status_code == 200 and "Hello" in "".join(
        json.loads(line[6:])["choices"][0]["text"]
        for line in r.text.splitlines()
        if line.startswith("data: {")
    )
    assert fleet.upstreams.hits == ["r1", "ca-2"]  # continued in `ca`, the nearer us-1 skipped
    assert fleet.gw.migration_metrics.migrations.labels(DEPLOYMENT, "reset")._value.get() == 1


async def test_a_broken_stream_with_no_permitted_target_ends_in_band(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, peers=(US,))
    fleet.upstreams.behaviour = {"r1": breaks_midstream}
    r = await fleet.post("ca", stream=True)
    assert "residency_unavailable" in r.text and fleet.upstreams.hits == ["r1"]
    fleet.upstreams.hits.clear()
    fleet.upstreams.behaviour["us-1"] = breaks_midstream
    r = await fleet.post("any", stream=True)  # no policy, nothing left: the usual error
    assert "upstream_failed" in r.text and "residency" not in r.text


# ---------------------------------------------------------------- the opener's guard, usage


async def test_the_opener_never_sends_to_a_target_outside(tmp_path: Path) -> None:
    from agent.gateway.exchange import Call
    from agent.gateway.inputs import parse_request

    fleet = Fleet(tmp_path)
    info = parse_request(b'{"model": "d", "prompt": "hi"}', "completions")
    call = Call("id", "kca", info, 0.0, allowed=frozenset({"ca"}))
    target = Attempt("failover", "failover", "us-1", "http://us-1", is_peer=True, jurisdiction="us")
    with pytest.raises(AttemptFailed) as info:
        await fleet.gw.upstreams.open(call, target, b"{}")
    assert info.value.status == 503 and b"residency_unavailable" in info.value.body
    assert fleet.upstreams.hits == [] and fleet.refused("guard") == 1


async def test_usage_records_say_where_the_request_was_processed(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    assert (await fleet.post("ca")).status_code == 200
    assert (await fleet.post("any", stream=True)).status_code == 200
    assert [(u.key_id, u.region, u.jurisdiction) for u in fleet.records] == [
        ("kca", "east", "ca"),
        ("kany", "east", "ca"),
    ]
    fleet = Fleet(tmp_path / "b", residency=["us"])
    assert (await fleet.post("any")).status_code == 200  # served by us-1: recorded there
    assert fleet.records == []
