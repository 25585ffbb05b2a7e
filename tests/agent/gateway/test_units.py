"""The gateway's pure parts in-process: routing policy, canary split, peer order, request
parsing, SSE observation, auth cache, state reloads, load tracking; and no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.gateway.auth import Authenticator
from agent.gateway.errors import GatewayError
from agent.gateway.inputs import DEFAULT_CHAT_MAX_TOKENS, parse_request, upstream_body
from agent.gateway.load import LoadTracker
from agent.gateway.plan import ClusterFacts, CostModel, ReplicaFacts, RequestFacts, rank_replicas
from agent.gateway.routing import great_circle_km, peer_order, pick_version
from agent.gateway.sse import EventSplitter, StreamObserver
from agent.gateway.state import ClusterView
from fleet_base.domain import Coordinates
from fleet_base.protocol import VersionWeight
from tests.agent.gateway.harness import ClusterFiles, make_key, peer, replica, route

ROOT = Path(__file__).resolve().parents[3]
REQ = RequestFacts("d", prompt_tokens=10, cost_tokens=100)
LEAST_LOAD = CostModel(routing="least-load")


def choose(candidates: list[ReplicaFacts]) -> ReplicaFacts:
    """The replica the least-load plan tries first."""
    first = rank_replicas(REQ, ClusterFacts("c", tuple(candidates)), None, LEAST_LOAD)[0]
    return next(c for c in candidates if c.replica_id == first.name)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


# ---------------------------------------------------------------- routing


def test_least_outstanding_tokens_prefers_less_work_then_fewer_requests() -> None:
    a = ReplicaFacts("a", "http://a", 1, outstanding_tokens=500, in_flight=1)
    b = ReplicaFacts("b", "http://b", 1, outstanding_tokens=200, in_flight=3)
    c = ReplicaFacts("c", "http://c", 1, outstanding_tokens=200, in_flight=2)
    assert choose([a, b, c]) is c
    failed = ReplicaFacts("c", "http://c", 1, outstanding_tokens=0, recently_failed=True)
    assert choose([a, failed]) is a  # a replica that just failed comes last
    assert choose([failed]) is failed  # but is still used when it is the only one
    with pytest.raises(ValueError):
        CostModel(routing="random")


def test_policy_with_tracker_spreads_concurrent_requests() -> None:
    tracker = LoadTracker()
    picks = []
    for _ in range(6):  # six requests in flight at once
        cands = [
            ReplicaFacts(r, "", 1, tracker.outstanding(r), tracker.in_flight(r)) for r in ("r1", "r2", "r3")
        ]
        chosen = choose(cands)
        tracker.start(chosen.replica_id, REQ.cost_tokens)
        picks.append(chosen.replica_id)
    assert sorted(picks) == ["r1", "r1", "r2", "r2", "r3", "r3"]
    tracker.finish("r1", 100)
    assert tracker.outstanding("r1") == 100 and tracker.in_flight("r1") == 1
    for rid in ("r1", "r2", "r2", "r3", "r3"):
        tracker.finish(rid, 100)
    assert tracker.snapshot() == {}


def test_failure_marks_expire() -> None:
    clock = Clock()
    tracker = LoadTracker(failure_window_s=5, clock=clock)
    tracker.mark_failed("r1")
    clock.t = 4.9
    assert tracker.recently_failed("r1")
    clock.t = 5.1
    assert not tracker.recently_failed("r1")


def test_pick_version_by_weight_among_ready_versions() -> None:
    weights = [VersionWeight(version=1, weight=9), VersionWeight(version=2, weight=1)]
    draws = [i / 1000 for i in range(1000)]
    picked = [pick_version({1, 2}, weights, d) for d in draws]
    assert picked.count(2) == 100 and picked.count(1) == 900
    assert pick_version({1}, weights, 0.95) == 1  # v2 not ready here: v1 takes it all
    assert pick_version({3}, weights, 0.5) is None  # no weighted version ready: any replica
    assert pick_version({1, 2}, [], 0.5) is None
    assert (
        pick_version({1, 2}, [VersionWeight(version=2, weight=0), VersionWeight(version=1, weight=1)], 0.99)
        == 1
    )


def test_great_circle_distance() -> None:
    ny, london = Coordinates(lat=40.71, lon=-74.01), Coordinates(lat=51.51, lon=-0.13)
    assert great_circle_km(ny, london) == pytest.approx(5570, rel=0.01)
    assert great_circle_km(ny, ny) == 0


def test_peer_order_nearest_healthy_with_replicas_first() -> None:
    table = route(
        "d",
        [
            peer("here", "http://here", 40, -74),
            peer("paris", "http://paris", 48.9, 2.35),
            peer("boston", "http://boston", 42.4, -71.1, healthy=False),
            peer("chicago", "http://chicago", 41.9, -87.6),
            peer("toronto", "http://toronto", 43.7, -79.4, replicas=0),
            peer("nourl", "", 40.1, -74),
        ],
    )
    order = [c.cluster for c in peer_order(table, "here", Coordinates(lat=40, lon=-74))]
    assert order == ["chicago", "paris", "toronto"]
    assert peer_order(None, "here", Coordinates()) == []


# ---------------------------------------------------------------- request parsing


def test_parse_estimates_cost_from_prompt_and_max_tokens() -> None:
    chat = parse_request(
        json.dumps(
            {
                "model": "d",
                "messages": [
                    {"role": "system", "content": "x" * 40},
                    {"role": "user", "content": [{"type": "text", "text": "y" * 80}]},
                ],
                "max_completion_tokens": 50,
                "n": 2,
            }
        ).encode(),
        "chat",
    )
    assert (chat.deployment, chat.prompt_tokens, chat.max_tokens, chat.sequences) == ("d", 8 + 10 + 20, 50, 2)
    assert chat.cost_tokens == 38 + 100
    assert parse_request(
        b'{"model": "d", "messages": [{"role": "user", "content": "hi"}]}', "chat"
    ).max_tokens == (DEFAULT_CHAT_MAX_TOKENS)
    batch = parse_request(b'{"model": "d", "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 4}', "completions")
    assert (batch.prompt_tokens, batch.sequences, batch.cost_tokens) == (5, 2, 13)
    assert parse_request(b'{"model": "d", "prompt": "abcd"}', "completions").max_tokens == 16


@pytest.mark.parametrize(
    "body, endpoint, param",
    [
        (b"\xff\xfe", "chat", None),
        (b'"just a string"', "chat", None),
        (b'{"messages": []}', "chat", "model"),
        (b'{"model": "", "messages": []}', "chat", "model"),
        (b'{"model": "d", "messages": {"role": "user"}}', "chat", "messages"),
        (b'{"model": "d", "messages": [{"role": "user", "content": "x"}], "stream": 1}', "chat", "stream"),
        (b'{"model": "d", "messages": [{"role": "user", "content": "x"}], "n": 0}', "chat", "n"),
        (b'{"model": "d", "prompt": [1, true]}', "completions", "prompt"),
        (b'{"model": "d", "prompt": []}', "completions", "prompt"),
        (b'{"model": "d", "prompt": "x", "max_tokens": 1.5}', "completions", "max_tokens"),
        (b'{"model": "d", "prompt": "x", "stream": true, "stream_options": {"include_usage": "y"}}', "completions", "stream_options"),
    ],
)  # fmt: skip
def test_parse_refuses_what_the_gateway_needs_with_400(body: bytes, endpoint: str, param: str | None) -> None:
    with pytest.raises(GatewayError) as err:
        parse_request(body, endpoint)  # type: ignore[arg-type]
    assert err.value.status == 400 and err.value.param == param


def test_upstream_body_asks_for_usage_only_on_streams() -> None:
    raw = b'{"model": "d", "prompt": "x", "stream": true, "stream_options": {"foo": 1}}'
    info = parse_request(raw, "completions")
    assert not info.client_wants_usage
    assert json.loads(upstream_body(info, raw))["stream_options"] == {"foo": 1, "include_usage": True}
    plain = b'{"model": "d", "prompt": "x"}'
    assert upstream_body(parse_request(plain, "completions"), plain) is plain
    asked = b'{"model": "d", "prompt": "x", "stream": true, "stream_options": {"include_usage": true}}'
    info = parse_request(asked, "completions")
    assert info.client_wants_usage and upstream_body(info, asked) is asked


# ---------------------------------------------------------------- SSE


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def test_splitter_yields_whole_events_across_reads() -> None:
    s = EventSplitter()
    stream = _event({"a": 1}) + b"data: [DONE]\r\n\r\n"
    events = []
    for i in range(0, len(stream), 3):
        events += s.feed(stream[i : i + 3])
    assert events == [_event({"a": 1}), b"data: [DONE]\r\n\r\n"] and s.rest() == b""


def test_observer_strips_requested_usage_and_finds_first_token() -> None:
    obs = StreamObserver(strip_usage=True)
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], "usage": None}
    token = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}], "usage": None}
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    out = obs.observe(_event(role))
    assert out is not None and b"usage" not in out and not obs.first_token
    assert obs.observe(_event(token)) is not None and obs.first_token
    assert obs.observe(_event(usage)) is None and obs.usage == usage["usage"]
    assert obs.observe(b"data: [DONE]\n\n") == b"data: [DONE]\n\n" and obs.done
    keep = StreamObserver(strip_usage=False)
    assert keep.observe(_event(usage)) == _event(usage) and keep.usage == usage["usage"]
    err = StreamObserver(strip_usage=True)
    err.observe(_event({"error": {"message": "boom"}}))
    assert err.error == {"message": "boom"}


# ---------------------------------------------------------------- auth and state


def test_auth_cache_still_sees_revocation_and_rotation() -> None:
    secret, record = make_key("k1")
    keys = {"k1": record}
    clock = Clock()
    auth = Authenticator(lambda: keys, cache_ttl_s=30, clock=clock)
    assert auth.authenticate(f"Bearer {secret}") is record
    assert auth.authenticate(f"bearer {secret}") is record  # cached
    keys["k1"] = record.model_copy(update={"revoked": True})
    with pytest.raises(GatewayError) as err:
        auth.authenticate(f"Bearer {secret}")
    assert err.value.status == 401
    _, rotated = make_key("k1")  # same id, new secret
    keys["k1"] = rotated
    with pytest.raises(GatewayError):
        auth.authenticate(f"Bearer {secret}")
    for header in (None, "", "Basic abc", "Bearer fleet-k1", "Bearer fleet--x"):
        with pytest.raises(GatewayError):
            auth.authenticate(header)


def test_view_reloads_on_change_keeps_last_good_and_throttles(tmp_path: Path) -> None:
    files = ClusterFiles(tmp_path, "c")
    clock = Clock()
    view = ClusterView(tmp_path, min_interval_s=0.2, clock=clock)
    assert view.replicas == [] and view.keys == {} and not view.known("d")
    files.write(replicas=[replica("r1", "http://r1", deployment="d")])
    assert view.refresh() == set()  # throttled: checked at t=0 already
    clock.t = 0.3
    assert view.refresh() == {"replicas"} and [r.replica_id for r in view.ready("d")] == ["r1"]
    files.write(replicas=[replica("r2", "http://r2", deployment="d")])  # same size, maybe same mtime
    assert view.refresh(force=True) == {"replicas"} and view.ready("d")[0].replica_id == "r2"
    files.local.replicas_path.write_text("{broken")
    assert view.refresh(force=True) == set() and view.ready("d")[0].replica_id == "r2"
    os.unlink(files.local.replicas_path)
    assert view.refresh(force=True) == {"replicas"} and view.ready("d") == []
    files.write(routes=[route("e", [])])
    view.refresh(force=True)
    assert view.known("e") and view.deployments() == ["e"]


def test_gateway_never_imports_torch() -> None:
    code = (
        "import sys, agent.gateway.app, agent.gateway.__main__; "
        "bad = [m for m in ('torch', 'transformers', 'engine.server') if m in sys.modules]; "
        "assert not bad, bad"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


def test_replica_choice_follows_canary_weights_and_avoids_the_failed_one(tmp_path: Path) -> None:
    from agent.gateway.exchange import Call
    from agent.gateway.gateway import Gateway
    from fleet_base.cluster_config import ClusterConfig

    config = ClusterConfig(cluster="c", state_dir=tmp_path)
    ClusterFiles(tmp_path, "c").write(
        replicas=[
            replica("old-1", "http://o1", deployment="d", version=1),
            replica("old-2", "http://o2", deployment="d", version=1),
            replica("new-1", "http://n1", deployment="d", version=2),
        ],
        routes=[
            route("d", [], versions=[VersionWeight(version=1, weight=3), VersionWeight(version=2, weight=1)])
        ],
    )
    gw = Gateway(config, nats=False)
    gw.router.rng.seed(7)
    info = parse_request(b'{"model": "d", "prompt": "hi"}', "completions")
    versions = []
    for _ in range(400):
        first = gw.router.plan(Call("id", "k", info, 0.0)).stage("local")[0]
        versions.append(first.version)
    assert 0.18 < versions.count(2) / 400 < 0.32
    # A retry goes to another replica, staying in the request's version while it can.
    local = gw.router.plan(Call("id", "k", info, 0.0)).stage("local")
    first, second = local[0], local[1]
    assert second.name != first.name
    if first.version == 1:
        assert second.version == 1


def test_a_replica_that_left_loses_its_series_and_its_failure_mark(tmp_path: Path) -> None:
    """Rollouts and autoscaling replace replicas for as long as a gateway runs: what it keeps
    per replica must go with the replica, or its memory and its scrape grow without bound."""
    from agent.gateway.gateway import Gateway
    from fleet_base.cluster_config import ClusterConfig

    config = ClusterConfig(cluster="c", state_dir=tmp_path)
    files = ClusterFiles(tmp_path, "c")
    files.write(
        replicas=[replica(r, f"http://{r}", deployment="d") for r in ("r1", "r2")], routes=[route("d", [])]
    )
    gw = Gateway(config, nats=False)
    gw.refresh()
    for r in ("r1", "r2"):
        gw.metrics.replica_choice.labels("d", r, "1").inc()
        gw.prefix.prompt_tokens.labels("d", r).inc(10)
        gw.tracker.mark_failed(r)
    files.write(
        replicas=[replica(r, f"http://{r}", deployment="d") for r in ("r2", "r3")], routes=[route("d", [])]
    )
    gw.view.refresh(force=True)
    gw.refresh()
    text = gw.metrics.render().decode()
    assert 'replica="r2"' in text and 'replica="r1"' not in text
    assert gw.tracker.recently_failed("r2") and "r1" not in gw.tracker._failed_at
