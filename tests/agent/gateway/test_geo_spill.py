"""Geo-aware spillover: the gateway follows the control plane's latency
ranking for its region (RoutingTable.by_region), spills to a peer when its own queue
is beyond a threshold, and counts hops so a request is never bounced on."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from agent.gateway.routing import MAX_HOPS, forwarded_from, hops_of, peer_order, should_spill
from fleet_base.api_keys import ApiKeyRecord
from fleet_base.domain import Coordinates
from fleet_base.ports import free_port
from fleet_base.protocol import ClusterRoute, RoutingTable
from tests.agent.gateway.conftest import EAST
from tests.agent.gateway.harness import DEPLOYMENT, GatewayProcess, peer, replica, route, sample, scrape
from tests.polling import wait_for

WEST = (34.05, -118.24)
DENVER = (39.74, -104.99)


def test_peer_order_follows_by_region_else_great_circle():
    peers = [
        peer("west", "http://w", *WEST),
        peer("denver", "http://d", *DENVER),
        peer("east", "http://e", *EAST),
    ]
    table = RoutingTable(deployment="d", clusters=peers)
    here = Coordinates(lat=WEST[0], lon=WEST[1])
    assert [p.cluster for p in peer_order(table, "west", here, region="west")] == ["denver", "east"]
    ranked = RoutingTable(deployment="d", clusters=peers, by_region={"west": [peers[0], peers[2], peers[1]]})
    assert [p.cluster for p in peer_order(ranked, "west", here, region="west")] == ["east", "denver"]
    # another region's ranking is not ours
    assert [p.cluster for p in peer_order(ranked, "west", here, region="elsewhere")] == ["denver", "east"]
    sick = ranked.model_copy(
        update={"by_region": {"west": [peers[2].model_copy(update={"healthy": False}), peers[1]]}}
    )
    assert [p.cluster for p in peer_order(sick, "west", here, region="west")] == ["denver"]


def test_spill_threshold_and_hops():
    assert not should_spill(10, 2, None)  # off unless configured
    assert not should_spill(1, 2, 1.0) and should_spill(2, 2, 1.0)
    assert not should_spill(5, 0, 1.0)  # no replica here: the no-replica path forwards
    assert hops_of(None) == 0 and hops_of("2") == 2 and hops_of("x") == MAX_HOPS
    assert forwarded_from({}, "X-Fleet-Forwarded") is None
    assert forwarded_from({"X-Fleet-Forwarded": "east"}, "X-Fleet-Forwarded") == "east"
    assert forwarded_from({"X-Fleet-Hops": "1"}, "X-Fleet-Forwarded") is not None


_RECEIVED_LOCK = threading.Lock()


class _Slow(BaseHTTPRequestHandler):
    """A 'replica' that takes its time and then answers like an engine."""

    delay_s = 2.0
    received = 0  # requests that reached it: the tests' sync point

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        with _RECEIVED_LOCK:
            type(self).received += 1
        time.sleep(self.delay_s)
        body = (
            b'{"id":"x","object":"text_completion","created":0,"model":"m","choices":[{"index":0,'
            b'"text":"slow","finish_reason":"length"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
        )
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def slow_replica() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), _Slow)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def busy_west(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    gw = GatewayProcess(
        tmp_path_factory.mktemp("gw-busy-west"),
        "west",
        nats_url=f"nats://127.0.0.1:{free_port()}",
        lat=WEST[0],
        lon=WEST[1],
    )
    gw.config.gateway.concurrency_target = 1
    gw.config.gateway.spill_queue_per_replica = 1.0
    gw.start()
    yield gw
    gw.stop()


def _forwarded(gw: GatewayProcess, to: str) -> float:
    return sample(scrape(gw.url), "fleet_gateway_forwarded_total", deployment=DEPLOYMENT, peer=to)


@pytest.mark.slow
def test_queue_beyond_threshold_spills_to_the_nearest_peer_by_region(
    busy_west: GatewayProcess,
    east: GatewayProcess,
    slow_replica: str,
    keys: dict[str, tuple[str, ApiKeyRecord]],
    secret: str,
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    peers: list[ClusterRoute] = [
        peer("west", busy_west.url, *WEST),
        peer("denver", dead, *DENVER),
        peer("east", east.url, *EAST),
    ]
    table = route(DEPLOYMENT, peers).model_copy(
        update={"by_region": {"west": [peers[0], peers[2], peers[1]]}}
    )
    busy_west.write(
        replicas=[replica("slow", slow_replica)], keys=[r for _, r in keys.values()], routes=[table]
    )
    busy_west.sync()

    def call(hops: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {secret}"} | ({"X-Fleet-Hops": hops} if hops else {})
        body = {"model": DEPLOYMENT, "prompt": "hi", "max_tokens": 2}
        return httpx.post(f"{busy_west.url}/v1/completions", json=body, headers=headers, timeout=30)

    def queued() -> float:
        return sample(scrape(busy_west.url), "fleet_gateway_queue_depth")

    before = {p: _forwarded(busy_west, p) for p in ("east", "denver")}
    with ThreadPoolExecutor(3) as pool:
        reached = _Slow.received
        first = pool.submit(call)  # takes the one slot of the slow replica
        wait_for(lambda: _Slow.received > reached, 30, "the first request at the slow replica")
        second = pool.submit(call)  # waits in the queue (nothing waited before it)
        wait_for(lambda: queued() >= 1, 30, "the second request in the queue")
        third = pool.submit(call)  # one waits per ready replica: spill to east (by_region), not denver
        spilled = third.result()
        assert spilled.status_code == 200, spilled.text
        assert spilled.headers["x-fleet-cluster"] == "east"
        assert first.result().headers["x-fleet-cluster"] == "west"
        assert second.result().headers["x-fleet-cluster"] == "west"
    after = {p: _forwarded(busy_west, p) for p in before}
    assert {p: after[p] - before[p] for p in before} == {"east": 1, "denver": 0}

    # a request that already made a hop is served here, queue or not
    with ThreadPoolExecutor(2) as pool:
        reached = _Slow.received
        hold = pool.submit(call)
        wait_for(lambda: _Slow.received > reached, 30, "the held request at the slow replica")
        hopped = call(hops="1")
        assert hopped.headers["x-fleet-cluster"] == "west" and hold.result().status_code == 200
    assert _forwarded(busy_west, "east") == after["east"]
