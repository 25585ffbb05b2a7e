"""Residency with real gateway processes: "east" in `ca` with no replica of its own and
"us-1" in `us`, its only peer with replicas. A key bound to `us` is refused at east's door
(403); a `ca`-bound key gets 503 residency_unavailable instead of a move to us-1, while a
key with no policy is forwarded there; us-1 re-checks a forward of the `ca`-bound key and
refuses it too."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from fleet_base.local_state import LocalState
from fleet_base.protocol import DesiredState
from tests.agent.gateway.harness import DEPLOYMENT, GatewayProcess, make_key, peer, route, sample, scrape

KEYS = {
    name: (secret, record.model_copy(update={"residency": residency}))
    for name, residency in (("kca", ["ca"]), ("kus", ["us"]), ("kany", None))
    for secret, record in [make_key(name)]
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    root = tmp_path_factory.mktemp("residency")
    gateways = [
        GatewayProcess(root / name, name, nats_url="", lat=lat, lon=lon, queue_timeout_s=0.5)
        for name, lat, lon in (("east", 45.5, -73.6), ("us-1", 42.4, -71.1))
    ]
    try:
        for gw in gateways:
            gw.start()
        east, us1 = gateways
        table = route(
            DEPLOYMENT,
            [
                peer("east", east.url, 45.5, -73.6, replicas=0).model_copy(update={"jurisdiction": "ca"}),
                peer("us-1", us1.url, 42.4, -71.1).model_copy(update={"jurisdiction": "us"}),
            ],
        )
        for gw, jurisdiction in ((east, "ca"), (us1, "us")):
            LocalState(gw.config.state_dir).save_desired(
                DesiredState(cluster=gw.config.cluster, jurisdiction=jurisdiction)
            )
            gw.write(replicas=[], keys=[record for _, record in KEYS.values()], routes=[table])
        yield east, us1
    finally:
        for gw in gateways:
            gw.stop()


def _post(url: str, key: str, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        json={"model": DEPLOYMENT, "prompt": "hi", "max_tokens": 2},
        headers={"Authorization": f"Bearer {KEYS[key][0]}", **headers},
        timeout=30,
    )


def test_bound_keys_are_refused_or_told_and_never_moved(pair: tuple[GatewayProcess, GatewayProcess]) -> None:
    east, us1 = pair
    r = _post(east.url, "kus")
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == "residency_violation" and "residency" in r.json()["error"]["message"]

    r = _post(east.url, "kca")  # only us-1 has replicas: told, not moved
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "residency_unavailable" and r.headers["retry-after"]
    assert "residency" in r.json()["error"]["message"] and r.headers["x-fleet-cluster"] == "east"

    r = _post(east.url, "kany")  # no policy: forwarded to us-1 as before
    assert r.headers["x-fleet-cluster"] == "us-1", r.text

    r = _post(us1.url, "kca", **{"X-Fleet-Forwarded": "east"})  # a forward us-1 must not process
    assert r.status_code == 403 and r.json()["error"]["code"] == "residency_violation"

    metrics = scrape(east.url)
    for reason, count in (("key_outside", 1), ("unavailable", 1), ("forward_outside", 0), ("guard", 0)):
        assert sample(metrics, "fleet_gateway_residency_refused_total", reason=reason) == count, reason
    assert sample(scrape(us1.url), "fleet_gateway_residency_refused_total", reason="key_outside") == 1


def test_the_gateway_learns_its_jurisdiction_from_the_desired_state(
    pair: tuple[GatewayProcess, GatewayProcess],
) -> None:
    east, _ = pair
    local = LocalState(east.config.state_dir)
    local.save_desired(DesiredState(cluster="east", jurisdiction="us"))
    try:
        r = _post(east.url, "kus")  # east is in `us` now: the key is served there (forwarded to us-1)
        assert r.status_code != 403 and r.headers["x-fleet-cluster"] == "us-1", r.text
        assert _post(east.url, "kca").status_code == 403
    finally:
        local.save_desired(DesiredState(cluster="east", jurisdiction="ca"))
