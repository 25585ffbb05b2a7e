"""Peers on secured real gateways (mutual TLS, peer tokens) whose trust file holds two CAs,
as during a CA rotation: east's certificates come from the old CA, west's from the new
one. What a peer receives of a user's request, which vouches it accepts, and what stops a
forward that fails verification (it is refused, so two gateways cannot bounce it)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import jwt
import pytest

from agent.security.peer_token import PeerSigner
from control_plane.security.pki import FleetPki
from engine.server.process import ServerProcess
from fleet_base.api_keys import ApiKeyRecord
from fleet_base.ports import free_port
from fleet_base.security.tls import Credentials, client_context, server_context
from tests.agent.gateway.harness import DEPLOYMENT, GatewayProcess, peer, replica, route, sample, scrape

pytestmark = pytest.mark.timeout(180)

TRAPPED, LOOP = "trapped", "loop"  # deployments routed to the capturing peer / in a circle


@dataclass
class Capture:
    """A peer gateway's listener that records what it is sent and answers a completion."""

    url: str = ""
    received: list[tuple[dict[str, str], bytes]] = field(default_factory=list)


def capture_peer(creds: Credentials) -> tuple[ThreadingHTTPServer, Capture]:
    capture = Capture()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            capture.received.append(({k.lower(): v for k, v in self.headers.items()}, body))
            answer = {
                "id": "chatcmpl-trap",
                "object": "chat.completion",
                "created": 0,
                "model": TRAPPED,
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
            data = json.dumps(answer).encode()
            self.send_response(200)
            for name, value in (("content-type", "application/json"), ("content-length", str(len(data)))):
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    assert creds.gateway_cert and creds.gateway_key and creds.ca_file
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    ctx = server_context(creds.gateway_cert, creds.gateway_key, creds.ca_file)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    capture.url = f"https://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, capture


@dataclass
class Pair:
    east: GatewayProcess
    west: GatewayProcess
    west_creds: Credentials
    capture: Capture


def secured(pki: FleetPki, cluster: str, bundle: Path) -> Credentials:
    return pki.cluster(cluster).model_copy(update={"ca_file": bundle})


@pytest.fixture(scope="module")
def pair(
    tmp_path_factory: pytest.TempPathFactory,
    replicas: list[ServerProcess],
    keys: dict[str, tuple[str, ApiKeyRecord]],
) -> Iterator[Pair]:
    root = tmp_path_factory.mktemp("peer-trust")
    old, new = FleetPki(root / "old"), FleetPki(root / "new")
    bundle = root / "ca-bundle.pem"  # the rotation's trust file: the old CA first, then the new
    bundle.write_bytes(old.ca_file.read_bytes() + new.ca_file.read_bytes())
    east_creds, west_creds = secured(old, "east", bundle), secured(new, "west", bundle)
    server, capture = capture_peer(secured(old, "trap", bundle))
    nowhere = f"nats://127.0.0.1:{free_port()}"  # serving must not need NATS
    east = GatewayProcess(root / "east", "east", nats_url=nowhere, peer_port=free_port(), security=east_creds)
    west = GatewayProcess(root / "west", "west", nats_url=nowhere, peer_port=free_port(), security=west_creds)
    east.start()
    try:
        west.start()
    except BaseException:
        east.stop()
        raise
    try:
        east_peer, west_peer = east.config.gateway.peer_url, west.config.gateway.peer_url
        records = [record for _, record in keys.values()]
        east.write(
            replicas=[replica("r1", replicas[0].url), replica("r2", replicas[1].url)],
            keys=records,
            routes=[
                route(DEPLOYMENT, [peer("east", east_peer, 0, 0)]),
                # the route calls west by another name: every token east signs for it is
                # for another audience, so west cannot verify it
                route(LOOP, [peer("east", east_peer, 0, 0), peer("west-alias", west_peer, 0, 1)]),
            ],
        )
        west.write(
            replicas=[],
            keys=records,
            routes=[
                route(DEPLOYMENT, [peer("west", west_peer, 0, 1), peer("east", east_peer, 0, 0)]),
                route(TRAPPED, [peer("west", west_peer, 0, 1), peer("trap", capture.url, 0, 2)]),
                route(LOOP, [peer("west", west_peer, 0, 1), peer("east-alias", east_peer, 0, 0)]),
            ],
        )
        yield Pair(east, west, west_creds, capture)
    finally:
        west.stop()
        east.stop()
        server.shutdown()


def chat(url: str, key: str, model: str = DEPLOYMENT, timeout: float = 30) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return httpx.post(
        f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=timeout
    )


def as_west(pair: Pair, token: str | None, request_id: str, key: str | None = None) -> httpx.Response:
    """A request on east's peer listener over west's mutual TLS."""
    creds = pair.west_creds
    assert creds.ca_file is not None
    headers = {"x-request-id": request_id}
    if token is not None:
        headers["x-fleet-peer-token"] = token
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    body = {"model": DEPLOYMENT, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    verify = client_context(creds.ca_file, creds.gateway_cert, creds.gateway_key)
    return httpx.post(
        f"{pair.east.config.gateway.peer_url}/v1/chat/completions",
        json=body,
        headers=headers,
        verify=verify,
        timeout=30,
    )


def metric(gw: GatewayProcess, name: str, **labels: str) -> float:
    return sample(scrape(gw.url), name, **labels)


def test_a_peer_never_receives_the_users_key(pair: Pair, secret: str) -> None:
    """West forwards to a peer that records everything: the user's key is nowhere in it;
    west vouches for the key's id inside its signed token."""
    r = chat(pair.west.url, secret, model=TRAPPED)
    assert r.status_code == 200, r.text
    assert pair.capture.received, "west did not forward"
    headers, body = pair.capture.received[-1]
    secret_part = secret.split("-", 2)[2]
    for name, value in headers.items():
        assert secret_part not in value, f"the user's key reached the peer in {name}"
    assert secret_part.encode() not in body
    assert "authorization" not in headers
    claims = jwt.decode(headers["x-fleet-peer-token"], options={"verify_signature": False})
    assert claims["key"] == "main" and claims["aud"] == "trap" and claims["hops"] == 1


def test_a_forward_signed_under_the_second_ca_of_the_bundle_is_a_peers(pair: Pair, secret: str) -> None:
    """Mid-rotation: west's certificate comes from the bundle's second CA. East verifies its
    token (it used to trust only the first CA and fall back to the raw key)."""
    r = chat(pair.west.url, secret)
    assert r.status_code == 200, r.text
    assert r.headers["x-fleet-cluster"] == "east"
    assert metric(pair.east, "fleet_gateway_peer_auth_failures_total") == 0
    assert metric(pair.east, "fleet_gateway_peer_forwards_received_total", peer="west") >= 1


def test_the_peer_trusts_a_vouch_only_for_keys_it_knows_within_the_hop_limit(pair: Pair) -> None:
    signer = PeerSigner(pair.west_creds.gateway_cert, pair.west_creds.gateway_key)  # type: ignore[arg-type]
    ok = as_west(pair, signer.sign("east", "rid-ok", key_id="main", hops=1), "rid-ok")
    assert ok.status_code == 200 and ok.headers["x-fleet-cluster"] == "east", ok.text
    for key_id, rid in (("ghost", "rid-ghost"), ("revoked", "rid-revoked")):
        r = as_west(pair, signer.sign("east", rid, key_id=key_id, hops=1), rid)
        assert r.status_code == 401 and r.json()["error"]["code"] == "vouched_key_unknown", r.text
    r = as_west(pair, signer.sign("east", "rid-far", key_id="main", hops=2), "rid-far")
    assert r.status_code == 403 and r.json()["error"]["code"] == "peer_hop_limit", r.text
    r = as_west(pair, signer.sign("east", "rid-scope", key_id="admin", hops=1), "rid-scope")
    assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope", r.text


def test_a_forward_whose_token_fails_is_refused_not_served(pair: Pair, secret: str) -> None:
    """With the user's own valid key attached: a failed peer token is no client request."""
    before = metric(pair.east, "fleet_gateway_peer_auth_failures_total")
    signer = PeerSigner(pair.west_creds.gateway_cert, pair.west_creds.gateway_key)  # type: ignore[arg-type]
    wrong = signer.sign("north", "rid-bad", key_id="main", hops=1)  # for another cluster
    r = as_west(pair, wrong, "rid-bad", key=secret)
    assert r.status_code == 401 and r.json()["error"]["code"] == "peer_token_invalid", r.text
    assert "audience" in r.json()["error"]["message"].lower()
    r = as_west(pair, None, "rid-none", key=secret)  # no token at all on the peer listener
    assert r.status_code == 401 and r.json()["error"]["code"] == "peer_token_missing", r.text
    assert metric(pair.east, "fleet_gateway_peer_auth_failures_total") == before + 1
    assert metric(pair.east, "fleet_gateway_peer_refusals_total", reason="token_invalid") >= 1


def test_a_forward_loop_stops_at_the_first_refusal(pair: Pair, secret: str) -> None:
    """Neither gateway runs the deployment and each names the other wrongly, so no token
    verifies: the first refusal ends the request instead of a ping-pong."""
    before = {gw: metric(gw, "fleet_gateway_forwarded_total", deployment=LOOP, peer=to)
              for gw, to in ((pair.west, "east-alias"), (pair.east, "west-alias"))}  # fmt: skip
    started = time.monotonic()
    try:
        r = chat(pair.west.url, secret, model=LOOP, timeout=15)
        status = r.status_code
    except httpx.TimeoutException:
        status = None
    took = time.monotonic() - started
    after = {gw: metric(gw, "fleet_gateway_forwarded_total", deployment=LOOP, peer=to)
             for gw, to in ((pair.west, "east-alias"), (pair.east, "west-alias"))}  # fmt: skip
    hops = {gw.config.cluster: after[gw] - before[gw] for gw in after}
    assert hops == {"west": 1, "east": 0}, f"the request bounced: {hops} in {took:.1f}s"
    assert status == 401 and r.json()["error"]["code"] == "peer_token_invalid"
