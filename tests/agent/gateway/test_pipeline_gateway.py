"""Pipeline requests through two real in-process gateways ("east", "west") and their ASGI
apps; replicas are played by an httpx mock transport that records every host a gateway
sends to, and east's forwards reach west's app. A pipeline request runs whole in one
cluster: later hops stay with their step's replicas there (never spilled), a pipeline not
ready here moves whole to the peer where it is, the refusals say why, and the usage
records, metrics and spans name the pipeline, the step and the cluster."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.gateway.app import build_app
from agent.gateway.gateway import Gateway
from agent.gateway.pipelines import MintedIds
from fleet_base import tracing
from fleet_base.cluster_config import ClusterConfig, GatewayConfig
from fleet_base.domain import Coordinates
from fleet_base.local_state import LocalState
from fleet_base.pipelines import (
    PIPELINE_HEADER,
    PIPELINE_REQUEST_HEADER,
    PIPELINE_STEP_HEADER,
    PipelineSpec,
    PipelineStep,
)
from fleet_base.protocol import ClusterRoute, DesiredState, ReplicaState, RoutingTable, UsageRecord
from tests.agent.gateway.harness import ClusterFiles, make_key, replica

RAG = PipelineSpec(
    name="rag",
    steps=(PipelineStep(name="embed", deployment="emb"), PipelineStep(name="answer", deployment="chat")),
)
SECRET, KEY = make_key("k1")
OTHER_SECRET, OTHER_KEY = make_key("k2")
JURISDICTION = {"east": "us", "west": "eu"}
WHERE = {"east": (40.7, -74.0), "west": (37.8, -122.4)}

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


async def _body(data: dict | bytes) -> AsyncIterator[bytes]:
    yield data if isinstance(data, bytes) else json.dumps(data).encode()


async def engine(request: httpx.Request) -> httpx.Response:
    """A replica's answer (embeddings or a completion), with usage."""
    body = json.loads(request.content)
    if request.url.path.endswith("/embeddings"):
        answer: dict = {
            "object": "list",
            "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
        }
        answer["usage"] = {"prompt_tokens": 2, "total_tokens": 2}
    else:
        answer = {"id": "c", "object": "text_completion", "created": 1, "model": body["model"]}
        answer["choices"] = [{"index": 0, "text": "hi", "finish_reason": "stop"}]
        answer["usage"] = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    return httpx.Response(200, headers={"content-type": "application/json"}, content=_body(answer))


class Cluster:
    """One gateway and its replicas r-emb-<name>, r-chat-<name> (when up)."""

    def __init__(self, tmp_path: Path, name: str, fleet: Fleet, **gateway: object) -> None:
        self.name = name
        lat, lon = WHERE[name]
        self.config = ClusterConfig(
            cluster=name,
            region=name,
            coordinates=Coordinates(lat=lat, lon=lon),
            state_dir=tmp_path / name,
            gateway=GatewayConfig(queue_timeout_s=2.0, key_state_max_age_s=3600, **gateway),  # type: ignore[arg-type]
        )
        self.files = ClusterFiles(self.config.state_dir, name)
        self.fleet = fleet
        self.gw: Gateway | None = None
        self.records: list[UsageRecord] = []
        self.hits: list[str] = []
        self.behaviour: dict[str, Handler] = {}

    def write(
        self,
        up: dict[str, set[str]],
        zero: frozenset[str] = frozenset(),
        standby: frozenset[str] = frozenset(),
        residency: list[str] | None = None,
    ) -> None:
        """State files: our replicas that are up, and routes naming every cluster's ready counts
        (`zero`: deployments that scale to zero)."""
        mine = up[self.name]
        reps = [
            replica(
                f"r-{d}-{self.name}",
                f"http://r-{d}-{self.name}",
                deployment=d,
                state=ReplicaState.ready if d in mine else ReplicaState.failed,
            )
            for d in ("emb", "chat", "solo")
        ]
        routes = [
            RoutingTable(
                deployment=d,
                clusters=[
                    ClusterRoute(
                        cluster=c,
                        region=c,
                        gateway_url=f"http://{c}",
                        coordinates=Coordinates(lat=WHERE[c][0], lon=WHERE[c][1]),
                        replicas=1 if d in up[c] else 0,
                        standby=c in standby,
                        jurisdiction=JURISDICTION[c],
                    )
                    for c in ("east", "west")
                ],
                pipelines=[RAG] if d in RAG.deployments else [],
                scale_to_zero=d in zero,
                residency=residency,
            )
            for d in ("emb", "chat", "solo")
        ]
        self.files.write(replicas=reps, keys=[KEY, OTHER_KEY], routes=routes)
        LocalState(self.config.state_dir).save_desired(
            DesiredState(cluster=self.name, jurisdiction=JURISDICTION[self.name])
        )

    def start(self) -> Cluster:
        self.gw = Gateway(self.config, nats=False)
        self.gw.upstreams.client = httpx.AsyncClient(transport=httpx.MockTransport(self.route))
        self.gw.usage.submit = self.records.append  # type: ignore[method-assign]
        self.app = build_app(self.config, self.gw)
        return self

    async def route(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        self.hits.append(host)
        if host in self.fleet.clusters and host not in self.behaviour:  # a peer gateway
            peer = self.fleet.clusters[host]
            headers = {
                k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")
            }
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=peer.app), base_url=f"http://{host}"
            ) as c:
                r = await c.post(request.url.path, content=request.content, headers=headers)
            keep = {
                k: v for k, v in r.headers.items() if k.lower() not in ("content-length", "transfer-encoding")
            }
            return httpx.Response(r.status_code, headers=keep, content=_body(r.content))
        return await self.behaviour.get(host, engine)(request)

    async def post(
        self, model: str, headers: dict[str, str] | None = None, secret: str = SECRET
    ) -> httpx.Response:
        path, body = (
            ("/v1/embeddings", {"model": model, "input": "what is fleet?"})
            if model == "emb"
            else ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 4})
        )
        h = {"authorization": f"Bearer {secret}", **(headers or {})}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://gw") as c:
            return await c.post(path, json=body, headers=h, timeout=10)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        assert self.gw is not None
        out = {}
        for family in text_string_to_metric_families(self.gw.metrics.render().decode()):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def sample(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)


class Fleet:
    def __init__(self, tmp_path: Path, up: dict[str, set[str]], **east: object) -> None:
        self.clusters: dict[str, Cluster] = {}
        self.clusters["east"] = Cluster(tmp_path, "east", self, **east)
        self.clusters["west"] = Cluster(tmp_path, "west", self)
        for c in self.clusters.values():
            c.write(up)
            c.start()

    @property
    def east(self) -> Cluster:
        return self.clusters["east"]

    @property
    def west(self) -> Cluster:
        return self.clusters["west"]


ALL = {"emb", "chat", "solo"}
PIPE = {PIPELINE_HEADER: "rag"}


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def _error(r: httpx.Response) -> dict:
    return r.json()["error"]


async def test_a_pipeline_ready_here_runs_here_and_its_hops_carry_the_id(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, {"east": ALL, "west": ALL})
    east = fleet.east
    first = await east.post("emb", PIPE)
    assert first.status_code == 200, first.text
    rid = first.headers[PIPELINE_REQUEST_HEADER]
    assert rid.startswith("east.") and first.headers["X-Fleet-Cluster"] == "east"
    second = await east.post("chat", {**PIPE, PIPELINE_STEP_HEADER: "answer", PIPELINE_REQUEST_HEADER: rid})
    assert second.status_code == 200 and second.headers[PIPELINE_REQUEST_HEADER] == rid
    assert east.hits == ["r-emb-east", "r-chat-east"]
    hops = [(r.cluster, r.deployment, r.pipeline, r.pipeline_step, r.pipeline_request) for r in east.records]
    assert hops == [("east", "emb", "rag", "embed", rid), ("east", "chat", "rag", "answer", rid)]
    assert east.sample("fleet_pipeline_requests_total", pipeline="rag", cluster="east", outcome="local") == 2
    for step in ("embed", "answer"):
        labels = {"pipeline": "rag", "step": step, "cluster": "east"}
        assert east.sample("fleet_pipeline_step_seconds_count", **labels) == 1
    plain = await east.post("chat")  # no header: an ordinary request, no pipeline fields
    assert plain.status_code == 200 and PIPELINE_REQUEST_HEADER not in plain.headers
    assert east.records[-1].pipeline is None


async def test_a_later_hop_queues_here_while_plain_requests_spill(tmp_path: Path) -> None:
    """East's one chat slot is busy and its queue past the spill threshold: a plain request
    goes to west, the pipeline's hop waits for east's replica."""
    fleet = Fleet(
        tmp_path, {"east": ALL, "west": ALL}, concurrency_targets={"chat": 1}, spill_queue_per_replica=0.5
    )
    east = fleet.east
    rid = (await east.post("emb", PIPE)).headers[PIPELINE_REQUEST_HEADER]
    release = asyncio.Event()

    async def busy(request: httpx.Request) -> httpx.Response:
        await release.wait()
        return await engine(request)

    east.behaviour["r-chat-east"] = busy
    hop = {**PIPE, PIPELINE_REQUEST_HEADER: rid}
    holder = asyncio.create_task(east.post("chat", hop))
    await until(lambda: east.hits.count("r-chat-east") >= 1)
    waiter = asyncio.create_task(east.post("chat", hop))  # queues: the slot is held
    assert east.gw is not None
    await until(lambda: east.gw.queue.waiting("chat") >= 1)  # type: ignore[union-attr]
    late = asyncio.create_task(east.post("chat", hop))  # arrives past the spill threshold
    await until(lambda: east.gw.queue.waiting("chat") >= 2)  # type: ignore[union-attr]
    plain = await east.post("chat")
    assert plain.status_code == 200 and plain.headers["X-Fleet-Cluster"] == "west"  # spilled
    release.set()
    for r in await asyncio.gather(holder, waiter, late):
        assert r.status_code == 200 and r.headers["X-Fleet-Cluster"] == "east"
    assert east.hits.count("r-chat-east") == 3 and east.hits.count("west") == 1  # the plain one only
    assert [r.cluster for r in east.records if r.pipeline == "rag"] == ["east"] * 4


async def test_a_pipeline_not_ready_here_moves_whole_to_the_peer(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, {"east": {"emb", "solo"}, "west": ALL})  # east's chat replica is down
    east, west = fleet.east, fleet.west
    first = await east.post("emb", PIPE)  # embed is ready here, but the pipeline is not
    assert first.status_code == 200, first.text
    rid = first.headers[PIPELINE_REQUEST_HEADER]
    assert rid.startswith("west.") and first.headers["X-Fleet-Cluster"] == "west"
    # the client's next hop reaches east again: east sends it to the request's owner
    second = await east.post("chat", {**PIPE, PIPELINE_REQUEST_HEADER: rid})
    assert second.status_code == 200 and second.headers["X-Fleet-Cluster"] == "west"
    assert east.hits == ["west", "west"] and west.hits == ["r-emb-west", "r-chat-west"]
    assert east.records == []  # the serving cluster records the hops
    assert [(r.cluster, r.pipeline_step, r.pipeline_request) for r in west.records] == [
        ("west", "embed", rid),
        ("west", "answer", rid),
    ]
    assert (
        east.sample("fleet_pipeline_requests_total", pipeline="rag", cluster="east", outcome="forwarded") == 2
    )
    assert west.sample("fleet_pipeline_requests_total", pipeline="rag", cluster="west", outcome="local") == 2
    for step in ("embed", "answer"):  # the hop is timed by the cluster that served it only
        assert (
            east.sample("fleet_pipeline_step_seconds_count", pipeline="rag", step=step, cluster="east") == 0
        )
        assert (
            west.sample("fleet_pipeline_step_seconds_count", pipeline="rag", step=step, cluster="west") == 1
        )


async def test_a_failed_forward_keeps_its_record_and_is_not_timed(tmp_path: Path) -> None:
    """East forwards a new pipeline request to west, whose replica fails before any byte:
    east records the failed hop (accounting) but times no hop of its own."""
    fleet = Fleet(tmp_path, {"east": {"emb", "solo"}, "west": ALL})
    east, west = fleet.east, fleet.west

    async def broken(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("down", request=request)

    east.behaviour["west"] = broken  # the forward itself fails
    r = await east.post("emb", PIPE)
    assert r.status_code >= 500
    assert [(x.cluster, x.pipeline_step, x.status >= 500) for x in east.records] == [("east", "embed", True)]
    assert east.sample("fleet_pipeline_step_seconds_count", pipeline="rag", step="embed", cluster="east") == 0
    assert west.records == []


async def test_a_hop_whose_step_went_down_here_is_refused_not_split(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, {"east": ALL, "west": ALL})
    east = fleet.east
    rid = (await east.post("emb", PIPE)).headers[PIPELINE_REQUEST_HEADER]
    east.write({"east": {"emb", "solo"}, "west": ALL})  # east's chat replicas die
    assert east.gw is not None
    east.gw.view.refresh(force=True)
    r = await east.post("chat", {**PIPE, PIPELINE_REQUEST_HEADER: rid})
    assert r.status_code == 503 and r.headers["retry-after"]
    err = _error(r)
    assert (
        err["code"] == "pipeline_step_unavailable"
        and "answer" in err["message"]
        and "restart" in err["message"]
    )
    assert east.hits == ["r-emb-east"]  # nothing sent for the refused hop, not even to west
    assert (
        east.sample("fleet_pipeline_requests_total", pipeline="rag", cluster="east", outcome="refused") == 1
    )
    again = await east.post("emb", PIPE)  # the client restarts: the whole request goes west
    assert again.status_code == 200 and again.headers[PIPELINE_REQUEST_HEADER].startswith("west.")


async def test_a_hop_whose_replica_died_before_the_view_knew_is_refused_not_a_502(tmp_path: Path) -> None:
    """The replica is gone but still listed ready: the connection is refused, nothing ran,
    and the hop may not leave the cluster, so it is the step's 503 the client restarts on."""
    fleet = Fleet(tmp_path, {"east": ALL, "west": ALL})
    east = fleet.east
    rid = (await east.post("emb", PIPE)).headers[PIPELINE_REQUEST_HEADER]

    async def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    east.behaviour["r-chat-east"] = refused
    r = await east.post("chat", {**PIPE, PIPELINE_REQUEST_HEADER: rid})
    assert r.status_code == 503 and r.headers["retry-after"], r.text
    err = _error(r)
    assert err["code"] == "pipeline_step_unavailable" and "restart" in err["message"]
    assert "west" not in east.hits  # never split to the peer


async def test_ready_nowhere_is_a_503_with_the_reason(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, {"east": {"emb"}, "west": {"chat"}})  # each has one step: never split
    r = await fleet.east.post("emb", PIPE)
    assert r.status_code == 503 and _error(r)["code"] == "pipeline_unavailable"
    assert "answer" in _error(r)["message"] and fleet.east.hits == []


async def test_a_pipeline_scaled_to_zero_here_is_served_here_after_its_cold_start(tmp_path: Path) -> None:
    """Ready nowhere, every step placed here at zero replicas: the request queues here, its
    demand is signalled (the autoscaler wakes the step) and it is served once a replica is up."""
    cold = {"east": {"solo"}, "west": {"solo"}}
    fleet = Fleet(tmp_path, cold)
    east = fleet.east
    assert east.gw is not None
    east.write(cold, zero=RAG.deployments)
    east.gw.view.refresh(force=True)
    first = asyncio.create_task(east.post("emb", PIPE))
    await until(lambda: east.gw.demand.queued.get("emb", 0) >= 1)  # type: ignore[union-attr]
    east.write({"east": ALL, "west": {"solo"}}, zero=RAG.deployments)  # the cold start is done
    east.gw.view.refresh(force=True)
    r = await first
    assert r.status_code == 200, r.text
    rid = r.headers[PIPELINE_REQUEST_HEADER]
    assert rid.startswith("east.") and r.headers["X-Fleet-Cluster"] == "east"
    assert [(x.cluster, x.pipeline_step, x.pipeline_request) for x in east.records] == [
        ("east", "embed", rid)
    ]
    east.write(cold, zero=RAG.deployments)  # answer's step is still at zero: its hop waits here too
    east.gw.view.refresh(force=True)
    second = asyncio.create_task(east.post("chat", {**PIPE, PIPELINE_REQUEST_HEADER: rid}))
    await until(lambda: east.gw.demand.queued.get("chat", 0) >= 1)  # type: ignore[union-attr]
    east.write({"east": ALL, "west": {"solo"}}, zero=RAG.deployments)
    east.gw.view.refresh(force=True)
    r = await second
    assert r.status_code == 200 and r.headers["X-Fleet-Cluster"] == "east"
    assert "west" not in east.hits


async def test_a_standby_cluster_sends_new_pipeline_requests_to_a_ready_primary(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, {"east": ALL, "west": ALL})
    east = fleet.east
    assert east.gw is not None
    east.write({"east": ALL, "west": ALL}, standby=frozenset({"east"}))
    east.gw.view.refresh(force=True)
    r = await east.post("emb", PIPE)
    assert r.status_code == 200 and r.headers[PIPELINE_REQUEST_HEADER].startswith("west.")
    assert east.hits == ["west"]
    east.write({"east": ALL, "west": {"solo"}}, standby=frozenset({"east"}))  # no primary ready
    east.gw.view.refresh(force=True)
    r = await east.post("emb", PIPE)
    assert r.status_code == 200 and r.headers[PIPELINE_REQUEST_HEADER].startswith("east.")


async def test_a_request_its_residency_keeps_out_of_here_goes_whole_to_a_permitted_peer(
    tmp_path: Path,
) -> None:
    fleet = Fleet(tmp_path, {"east": ALL, "west": ALL})  # east is "us", west "eu"
    east, west = fleet.east, fleet.west
    assert east.gw is not None
    east.write({"east": ALL, "west": ALL}, residency=["eu"])  # the deployments may run in "eu" only
    east.gw.view.refresh(force=True)
    r = await east.post("emb", PIPE)
    assert r.status_code == 200, r.text
    assert r.headers[PIPELINE_REQUEST_HEADER].startswith("west.") and r.headers["X-Fleet-Cluster"] == "west"
    assert east.hits == ["west"]
    east.write({"east": ALL, "west": {"solo"}}, residency=["eu"])  # west's steps down: nowhere permitted
    east.gw.view.refresh(force=True)
    r = await east.post("emb", PIPE)
    assert r.status_code == 503 and _error(r)["code"] == "pipeline_unavailable"
    assert "residency" in _error(r)["message"] and east.hits == ["west"]
    assert west.records and not east.records


async def test_an_id_is_honoured_only_for_the_key_its_owner_minted_it_for(tmp_path: Path) -> None:
    """An id is a cluster name and hex a client could invent: the owner treats an id it did
    not mint for the hop's key as a new request, and another gateway sends a hop to the
    cluster its id names only while the pipeline is ready there."""
    fleet = Fleet(tmp_path, {"east": ALL, "west": ALL})
    east, west = fleet.east, fleet.west
    invented = "east." + "ab" * 12
    r = await east.post("chat", {**PIPE, PIPELINE_REQUEST_HEADER: invented})
    assert r.status_code == 200 and r.headers[PIPELINE_REQUEST_HEADER] not in ("", invented)
    rid = (await east.post("emb", PIPE)).headers[PIPELINE_REQUEST_HEADER]
    stolen = await east.post("chat", {**PIPE, PIPELINE_REQUEST_HEADER: rid}, secret=OTHER_SECRET)
    assert stolen.status_code == 200 and stolen.headers[PIPELINE_REQUEST_HEADER] != rid  # a new request
    mine = await east.post("chat", {**PIPE, PIPELINE_REQUEST_HEADER: rid})
    assert mine.status_code == 200 and mine.headers[PIPELINE_REQUEST_HEADER] == rid
    # an invented id naming west: forwarded (west is ready), and west serves it as a new request
    west_made_up = "west." + "cd" * 12
    r = await east.post("emb", {**PIPE, PIPELINE_REQUEST_HEADER: west_made_up})
    assert r.status_code == 200 and r.headers["X-Fleet-Cluster"] == "west"
    assert (
        r.headers[PIPELINE_REQUEST_HEADER].startswith("west.")
        and r.headers[PIPELINE_REQUEST_HEADER] != west_made_up
    )
    # west not ready for the pipeline: a hop naming west is not sent there
    assert east.gw is not None
    east.write({"east": ALL, "west": {"emb", "solo"}})
    east.gw.view.refresh(force=True)
    hits = len(east.hits)
    r = await east.post("emb", {**PIPE, PIPELINE_REQUEST_HEADER: west_made_up})
    assert r.status_code == 503 and _error(r)["code"] == "pipeline_owner_unavailable"
    assert len(east.hits) == hits and len(west.records) == 1


def test_minted_ids_expire_and_are_bounded() -> None:
    now = [0.0]
    ids = MintedIds(ttl_s=10.0, max_ids=2, clock=lambda: now[0])
    ids.mint("east.01", "k1")
    assert ids.holds("east.01", "k1") and not ids.holds("east.01", "k2") and not ids.holds("east.02", "k1")
    now[0] = 9.0
    assert ids.holds("east.01", "k1")  # used: remembered for another ttl
    now[0] = 18.0
    assert ids.holds("east.01", "k1")
    now[0] = 28.5
    assert not ids.holds("east.01", "k1") and len(ids) == 0  # forgotten after ttl unused
    for n in range(3):
        ids.mint(f"east.1{n}", "k1")
    assert len(ids) == 2 and not ids.holds("east.10", "k1") and ids.holds("east.12", "k1")


async def test_unknown_pipeline_and_a_model_outside_it_are_400s(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, {"east": ALL, "west": ALL})
    east = fleet.east
    r = await east.post("emb", {PIPELINE_HEADER: "nope"})
    assert (
        r.status_code == 400 and _error(r)["code"] == "pipeline_not_found" and "nope" in _error(r)["message"]
    )
    assert _error(r)["type"] == "invalid_request_error"
    r = await east.post("solo", PIPE)
    assert (
        r.status_code == 400
        and _error(r)["code"] == "pipeline_step_mismatch"
        and _error(r)["param"] == "model"
    )
    assert "embed, answer" in _error(r)["message"] and "=emb" not in _error(r)["message"]  # no deployments
    r = await east.post("emb", {**PIPE, PIPELINE_STEP_HEADER: "answer"})
    assert r.status_code == 400 and _error(r)["code"] == "pipeline_step_mismatch"
    assert east.hits == [] and east.records == []
    assert (
        east.sample("fleet_pipeline_requests_total", pipeline="nope", cluster="east", outcome="refused") == 0
    )


async def test_a_span_per_hop_names_the_pipeline(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, {"east": ALL, "west": ALL})
    with tracing.capturing("fleet-gateway") as sink:
        r = await fleet.east.post(
            "emb", {**PIPE, "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
        )
    assert r.status_code == 200
    (hop,) = [s for s in sink.get_finished_spans() if s.name == "gateway.pipeline_hop"]
    a = hop.attributes
    assert (a["fleet.pipeline"], a["fleet.pipeline.step"], a["fleet.pipeline.action"]) == (
        "rag",
        "embed",
        "local",
    )
    assert a["fleet.pipeline.request"] == r.headers[PIPELINE_REQUEST_HEADER] and a[tracing.CLUSTER] == "east"
    assert a[tracing.STATUS] == 200


@pytest.fixture(autouse=True)
def _no_env_tracing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
