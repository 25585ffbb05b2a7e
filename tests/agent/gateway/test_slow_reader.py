"""A client that opens a stream and never reads (a tiny receive window, nothing read) costs
a bounded amount: straight at a replica, the engine aborts the request once its unread
output passes --max-unread-bytes (KV freed); through the gateway, the stream is ended after
gateway.client_write_timeout_s and its slot released. Well-behaved requests are served
meanwhile."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from control_plane.local.nats_server import NatsServer
from engine.server.process import ServerProcess
from fleet_base.api_keys import ApiKeyRecord
from tests.agent.gateway.conftest import EAST
from tests.agent.gateway.harness import DEPLOYMENT, GatewayProcess, peer, replica, route, sample, scrape
from tests.polling import wait_for

pytestmark = pytest.mark.slow

WRITE_TIMEOUT_S = 2.0
# Big chunks (top-20 logprobs on two sequences) fill a tiny receive window within a few steps.
HEAVY = {"model": DEPLOYMENT, "prompt": "Once", "max_tokens": 200, "ignore_eos": True, "n": 2, "logprobs": 20}


def stalled_stream(url: str, path: str, body: dict, headers: dict[str, str] | None = None) -> socket.socket:
    """A POST whose response the client never reads, over a socket that can hold almost
    nothing (the sender's buffers fill, then its writes block)."""
    u = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_WINDOW_CLAMP, 1024)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.connect((u.hostname, u.port))
    data = json.dumps({**body, "stream": True}).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    sock.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.fixture(scope="module")
def roomy(gw_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A replica whose own unread bound (64 MiB) cannot end the stream first: behind the
    gateway, only the gateway's write deadline may (with the shared replicas' 64 KiB bound
    the two raced, and the replica often won)."""
    args = ["--served-model-name", DEPLOYMENT, "--threads", "1", "--kv-cache-memory", "2MiB"]
    args += ["--max-model-len", "256", "--max-unread-bytes", "64MiB"]
    log = tmp_path_factory.mktemp("gw-roomy") / "roomy.log"
    proc = ServerProcess(*args, model=str(gw_model), log_path=log)
    proc.start(timeout=120)
    yield proc
    proc.stop(timeout=10)


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory,
    nats: NatsServer,
    roomy: ServerProcess,
    keys: dict[str, tuple[str, ApiKeyRecord]],
) -> Iterator[GatewayProcess]:
    gw = GatewayProcess(
        tmp_path_factory.mktemp("gw-slow"), "east", nats_url=nats.url, client_write_timeout_s=WRITE_TIMEOUT_S
    )
    gw.start()
    gw.write(
        replicas=[replica("r1", roomy.url)],
        keys=[record for _, record in keys.values()],
        routes=[route(DEPLOYMENT, [peer("east", gw.url, *EAST)])],
    )
    yield gw
    gw.stop()


def _refused(url: str) -> dict[str, float]:
    """The listener's refusals so far, by reason (which deadline answered a 408)."""
    return {
        dict(labels).get("reason", ""): value
        for (name, labels), value in scrape(url).items()
        if name == "fleet_listener_refused_total"
    }


def _aborted(url: str) -> float:
    return sample(scrape(url), "fleet_engine_requests_aborted_total", model=DEPLOYMENT, reason="slow_reader")


def test_a_client_that_reads_nothing_is_cut_and_frees_what_it_held(
    gateway: GatewayProcess, replicas: list[ServerProcess], roomy: ServerProcess, secret: str, tmp_path: Path
) -> None:
    r1 = replicas[0].url
    auth = {"Authorization": f"Bearer {secret}"}

    # Straight at the replica: the engine aborts the request once its unread output passes
    # the replica's bound, and frees its KV, though the socket stays open.
    before = _aborted(r1)
    sock = stalled_stream(r1, "/v1/completions", HEAVY)
    try:
        wait_for(lambda: _aborted(r1) == before + 1, 60, "the replica to abort the stalled stream", 0.1)
        wait_for(
            lambda: (
                sample(scrape(r1), "fleet_engine_requests_running", model=DEPLOYMENT) == 0
                and sample(scrape(r1), "fleet_engine_kv_cache_usage_ratio", model=DEPLOYMENT) == 0.0
            ),
            30,
            "its sequences and KV blocks freed",
            0.1,
        )
        good = httpx.post(
            f"{r1}/v1/completions", json={**HEAVY, "stream": False, "max_tokens": 8}, timeout=60
        )
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 16
    finally:
        sock.close()

    # Through the gateway: the stream is ended after the write deadline and its slot freed.
    g = gateway.url
    sock = stalled_stream(g, "/v1/completions", HEAVY, auth)
    try:
        wait_for(
            lambda: sample(scrape(g), "fleet_gateway_in_flight", deployment=DEPLOYMENT) == 1,
            30,
            "the stalled stream to be admitted",
            0.05,
        )
        # a well-behaved client is served while it is held
        good = httpx.post(f"{g}/v1/completions", json={**HEAVY, "max_tokens": 8}, headers=auth, timeout=60)
        assert good.status_code == 200, (good.headers, good.text, _refused(g), _refused(roomy.url))
        wait_for(
            lambda: (
                sample(
                    scrape(g),
                    "fleet_gateway_streams_aborted_total",
                    deployment=DEPLOYMENT,
                    reason="slow_reader",
                )
                == 1
            ),
            WRITE_TIMEOUT_S + 30,
            "the gateway to end the stalled stream",
            0.1,
        )
        samples = scrape(g)
        assert sample(samples, "fleet_gateway_in_flight", deployment=DEPLOYMENT) == 0
        assert sample(samples, "fleet_gateway_replica_in_flight", deployment=DEPLOYMENT, replica="r1") == 0
        assert sample(samples, "fleet_gateway_requests_total", deployment=DEPLOYMENT, status="499") == 1
    finally:
        sock.close()
