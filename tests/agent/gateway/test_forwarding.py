"""Geo spillover: a gateway whose cluster runs no replica of a deployment forwards to the
nearest healthy peer gateway from the deployment's route, and never forwards twice."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from fleet_base.api_keys import ApiKeyRecord
from fleet_base.openai_contract.timing import TTFT_HEADER
from fleet_base.ports import free_port
from tests.agent.gateway.conftest import EAST
from tests.agent.gateway.harness import DEPLOYMENT, GatewayProcess, peer, route, sample, scrape

WEST = (34.05, -118.24)  # Los Angeles
DENVER = (39.74, -104.99)  # nearer to LA than New York
SAN_FRANCISCO = (37.77, -122.42)  # nearest of all, but unhealthy
TOKYO = (35.68, 139.69)


@pytest.fixture(scope="module")
def west_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A second cluster's gateway, with NATS unreachable (serving must not care)."""
    gw = GatewayProcess(
        tmp_path_factory.mktemp("gw-west"),
        "west",
        nats_url=f"nats://127.0.0.1:{free_port()}",
        lat=WEST[0],
        lon=WEST[1],
        queue_timeout_s=0.5,
    )
    gw.start()
    yield gw
    gw.stop()


@pytest.fixture
def west(
    west_process: GatewayProcess, east: GatewayProcess, keys: dict[str, tuple[str, ApiKeyRecord]]
) -> GatewayProcess:
    west_process.write(
        replicas=[],
        keys=[record for _, record in keys.values()],
        routes=[route(DEPLOYMENT, [peer("west", west_process.url, *WEST), peer("east", east.url, *EAST)])],
    )
    return west_process


def forwarded(gw: GatewayProcess, to: str) -> float:
    return sample(scrape(gw.url), "fleet_gateway_forwarded_total", deployment=DEPLOYMENT, peer=to)


def test_forwards_to_the_peer_and_back(west: GatewayProcess, east: GatewayProcess, secret: str) -> None:
    before = forwarded(west, "east")
    c = openai.OpenAI(base_url=f"{west.url}/v1", api_key=secret, max_retries=0, timeout=60)
    assert [m.id for m in c.models.list().data] == [DEPLOYMENT]
    sent = time.monotonic()
    raw = c.chat.completions.with_raw_response.create(
        model=DEPLOYMENT, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    took = time.monotonic() - sent
    assert raw.headers["x-fleet-cluster"] == "east"  # served there
    assert 0 < float(raw.headers[TTFT_HEADER]) < took  # the peer's figure, and the hop before it
    assert raw.parse().usage.completion_tokens >= 1
    chunks = list(
        c.completions.create(
            model=DEPLOYMENT, prompt="hello", max_tokens=30, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert len(chunks) > 5 and "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert forwarded(west, "east") == before + 2
    health = httpx.get(f"{west.url}/health", timeout=5).json()
    assert health["nats_connected"] is False  # and it served anyway


def test_nearest_healthy_peer_first_then_the_next(
    west: GatewayProcess, east: GatewayProcess, secret: str
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    west.write(
        routes=[
            route(
                DEPLOYMENT,
                [
                    peer("west", west.url, *WEST),
                    peer("tokyo", dead, *TOKYO),
                    peer("east", east.url, *EAST),
                    peer("sf", dead, *SAN_FRANCISCO, healthy=False),
                    peer("denver", dead, *DENVER),
                ],
            )
        ]
    )
    before = {p: forwarded(west, p) for p in ("denver", "east", "tokyo", "sf")}
    r = httpx.post(
        f"{west.url}/v1/completions",
        json={"model": DEPLOYMENT, "prompt": "hi", "max_tokens": 2},
        headers={"Authorization": f"Bearer {secret}"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-fleet-cluster"] == "east"
    after = {p: forwarded(west, p) for p in before}
    assert {p: after[p] - before[p] for p in before} == {"denver": 1, "east": 1, "tokyo": 0, "sf": 0}


def test_a_forwarded_request_is_never_forwarded_again(west: GatewayProcess, secret: str) -> None:
    before = forwarded(west, "east")
    start = time.monotonic()
    r = httpx.post(
        f"{west.url}/v1/completions",
        json={"model": DEPLOYMENT, "prompt": "hi", "max_tokens": 2},
        headers={"Authorization": f"Bearer {secret}", "X-Fleet-Forwarded": "east"},
        timeout=30,
    )
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "no_replica_available"
    assert time.monotonic() - start >= 0.5  # it waited in its own queue instead
    assert forwarded(west, "east") == before


def test_refusals_happen_before_forwarding(
    west: GatewayProcess, keys: dict[str, tuple[str, ApiKeyRecord]]
) -> None:
    """The forwarding gateway checks the key and the body (the shared OpenAI contract) itself:
    an invalid request is refused here with the replica's own 400 and never reaches the peer."""
    before = forwarded(west, "east")
    r = httpx.post(
        f"{west.url}/v1/completions",
        json={"model": DEPLOYMENT, "prompt": "hi", "temperature": 9},
        headers={"Authorization": f"Bearer {keys['main'][0]}"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert r.headers["x-fleet-cluster"] == "west"
    assert forwarded(west, "east") == before
    r = httpx.post(f"{west.url}/v1/completions", json={"model": DEPLOYMENT, "prompt": "hi"}, timeout=30)
    assert r.status_code == 401 and r.headers["x-fleet-cluster"] == "west"
