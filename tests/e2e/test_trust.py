"""The fleet rows of the attack table, on a secured local fleet of real processes (TLS
nats-server with per-identity permissions, control plane, agent + gateway per region,
HTTPS sim replicas): what an outsider, or a compromised agent, tries, and what happens.
The NATS rows are in tests/control_plane/test_nats_permissions.py; the tenant cache row,
which needs the real engine, in test_trust_engine.py."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import nats
import psutil
import pytest

from agent.security.peer_token import PeerSigner
from control_plane.security.pki import FleetPki
from fleet_base import api_keys, protocol
from fleet_base.local_state import LocalState
from fleet_base.security.tls import client_context, nats_tls
from tests.e2e.sim_fleet import SimFleet, wait_for

pytestmark = pytest.mark.timeout(300)

EAST, WEST = "local-east", "local-west"
NAME = "guarded"
MAX_AGE_S = 8.0  # above the control plane's 5 s lease renewal
BODY = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    home = tmp_path_factory.mktemp("trust")
    stale = {"key_state_max_age_s": MAX_AGE_S}
    f = SimFleet(
        home,
        [EAST, WEST],
        gateway={EAST: {**stale, "stale_keys": "verified"}, WEST: {**stale, "stale_keys": "refuse"}},
    )
    try:
        f.up()
        r = f.api(
            "POST",
            "/v1/deployments",
            json={
                "name": NAME,
                "model": "sim",
                "replicas": 1,
                "regions": [WEST],
                "engine_args": {"cold_start": 0.2},
            },
        )
        assert r.status_code == 201, r.text
        wait_for(lambda: f.ready_by_version(NAME).get(1) == 1, 60, 0.2, "a ready replica in west")
        wait_for(
            lambda: NAME in httpx.get(f"{f.gateways[EAST]}/health").json()["routes"], 30, 0.2, "east's route"
        )
        yield f
    finally:
        f.down()


def chat(url: str, key: str, **kw) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/chat/completions", json=BODY, headers={"authorization": f"Bearer {key}"}, timeout=30, **kw
    )


SECRETS: list[str] = []  # every secret this module handed out: none may reach a log


def new_key(fleet: SimFleet, name: str) -> str:
    key = fleet.api("POST", "/v1/keys", json={"name": name, "scopes": ["inference"]}).json()["key"]
    SECRETS.append(key)
    return key


def cluster_config(fleet: SimFleet, region: str):
    from fleet_base.cluster_config import ClusterConfig

    return ClusterConfig.load(fleet.local.dir / "clusters" / region / "cluster.yaml")


def test_spill_goes_to_the_authenticated_peer(fleet: SimFleet):
    r = wait_for(
        lambda: (x := chat(fleet.gateways[EAST], fleet.key)).status_code == 200 and x, 30, 0.3, "a spill"
    )
    assert r.headers["x-fleet-cluster"] == WEST  # east has no replica: its peer in west answered


def test_forged_forwarding_headers_are_a_clients(fleet: SimFleet):
    """Believed, these headers would make east serve the request itself (no replica:
    queue, then 503). Treated as a client's, the request is forwarded to west. On the
    peer listener a forward whose token fails is refused."""
    forged = {"x-fleet-forwarded": WEST, "x-fleet-hops": "5"}
    r = httpx.post(
        f"{fleet.gateways[EAST]}/v1/chat/completions",
        json=BODY,
        headers={"authorization": f"Bearer {fleet.key}", **forged},
        timeout=30,
    )
    assert r.status_code == 200 and r.headers["x-fleet-cluster"] == WEST, r.text

    config = cluster_config(fleet, EAST)
    peer_url = config.gateway.peer_url
    ca = config.security.ca_file
    # the peer listener wants a fleet certificate: an outsider's TLS handshake fails
    with pytest.raises(httpx.HTTPError):
        httpx.post(f"{peer_url}/v1/chat/completions", json=BODY, verify=client_context(ca), timeout=10)
    # a fleet identity that is not a gateway (the agent's), with a token signed by a key the
    # fleet CA never certified: let in by TLS, refused by the token (never served as a
    # client's request, the user's valid key notwithstanding)
    rogue = FleetPki(fleet.home / "rogue").cluster(WEST)
    key_id = api_keys.key_id_of(fleet.key)
    assert key_id is not None
    token = PeerSigner(rogue.gateway_cert, rogue.gateway_key).sign(EAST, "req-forged", key_id=key_id, hops=1)
    agent_ctx = client_context(ca, config.security.agent_cert, config.security.agent_key)
    r = httpx.post(
        f"{peer_url}/v1/chat/completions",
        json=BODY,
        headers={
            "authorization": f"Bearer {fleet.key}",
            "x-request-id": "req-forged",
            "x-fleet-peer-token": token,
            **forged,
        },
        verify=agent_ctx,
        timeout=30,
    )
    assert r.status_code == 401 and r.json()["error"]["code"] == "peer_token_invalid", r.text
    metrics = httpx.get(f"{fleet.gateways[EAST]}/metrics", timeout=10).text
    failures = [
        line for line in metrics.splitlines() if line.startswith("fleet_gateway_peer_auth_failures_total ")
    ]
    assert failures and float(failures[0].split()[1]) >= 1


def test_forged_heartbeat_gateway_url_does_not_move_spill_traffic(fleet: SimFleet):
    """West's own (compromised) agent claims another gateway URL: the control plane keeps
    the enrolled one, and no spilled request (with the user's key and prompt) goes there."""
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(16)
    trap.settimeout(0.2)
    accepted: list[object] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = trap.accept()
                accepted.append(conn)
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    evil = f"https://127.0.0.1:{trap.getsockname()[1]}"
    west = cluster_config(fleet, WEST)
    enrolled = west.gateway.peer_url

    async def forge() -> None:
        tls = nats_tls(west.security, "agent", WEST)
        nc = await nats.connect(
            fleet.state.nats_url, tls=tls.context(), inbox_prefix=tls.inbox_prefix, allow_reconnect=False
        )
        hb = protocol.Heartbeat(cluster=WEST, region=WEST, gateway_url=evil)
        for _ in range(5):
            await nc.publish(protocol.heartbeat_subject(WEST), hb.to_bytes())
            await asyncio.sleep(0.3)
        await nc.close()

    try:
        asyncio.run(forge())
        time.sleep(1.0)
        record = {c["id"]: c for c in fleet.api("GET", "/v1/clusters").json()["items"]}[WEST]
        assert record["gateway_url"] == enrolled
        for _ in range(3):
            r = chat(fleet.gateways[EAST], fleet.key)
            assert r.status_code == 200 and r.headers["x-fleet-cluster"] == WEST
        routes = LocalState(cluster_config(fleet, EAST).state_dir).load_routes().routes
        assert {c.cluster: c.gateway_url for c in routes[NAME].clusters}[WEST] == enrolled
        assert accepted == []
    finally:
        stop.set()
        thread.join(2)
        trap.close()


def test_replica_serves_only_its_gateway(fleet: SimFleet):
    west = cluster_config(fleet, WEST)
    replicas = LocalState(west.state_dir).load_replicas().replicas
    url = next(r.url for r in replicas if r.deployment == NAME)
    assert url.startswith("https://")
    verify = client_context(west.security.ca_file)
    path = f"{url}/v1/chat/completions"
    assert httpx.post(path, json=BODY, verify=verify, timeout=10).status_code == 401
    forged = {"authorization": f"Bearer {fleet.key}"}  # a user's key is not the gateway's credential
    assert httpx.post(path, json=BODY, headers=forged, verify=verify, timeout=10).status_code == 401
    with pytest.raises(httpx.HTTPError):  # plaintext does not even get an answer
        httpx.post(path.replace("https://", "http://"), json=BODY, timeout=10)
    assert httpx.get(f"{url}/health", verify=verify, timeout=10).status_code == 200  # the agent's probe
    token = {"authorization": f"Bearer {west.security.replica_token}"}
    assert httpx.post(path, json=BODY, headers=token, verify=verify, timeout=10).status_code == 200


def test_revoked_key_stops_within_2s_on_a_connected_gateway(fleet: SimFleet):
    key = new_key(fleet, "to-revoke")
    wait_for(lambda: chat(fleet.gateways[EAST], key).status_code == 200, 10, 0.1, "the new key at east")
    key_id = api_keys.key_id_of(key)
    revoked_at = time.monotonic()
    assert fleet.api("DELETE", f"/v1/keys/{key_id}").status_code in (200, 204)
    wait_for(lambda: chat(fleet.gateways[EAST], key).status_code == 401, 5, 0.05, "the revocation at east")
    took = time.monotonic() - revoked_at
    print(f"\n[revocation] a revoked key stopped working at a connected gateway after {took:.2f}s")
    assert took <= 2.0


def test_no_secret_in_any_log(fleet: SimFleet):
    """Keys, the admin token and replica tokens never appear in any process's log (the
    gateways log at info, the agents log every replica's command line)."""
    secrets = [*SECRETS, fleet.key, fleet.token]
    secrets += [cluster_config(fleet, r).security.replica_token for r in (EAST, WEST)]
    logs = list((fleet.local.dir / "logs").glob("*.log")) + list(
        (fleet.local.dir / "clusters").rglob("*.log")
    )
    assert len(logs) >= 6
    for path in logs:
        text = path.read_text(errors="replace")
        for secret in secrets:
            assert secret and secret not in text, f"a secret in {path}"
        secret_part = [s.split("-", 2)[2] for s in [*SECRETS, fleet.key]]
        assert not any(part in text for part in secret_part), f"a key's secret part in {path}"


def test_revocation_with_a_dead_agent_follows_the_staleness_setting(fleet: SimFleet):
    """Both agents die, so no gateway hears of a revocation. Once the key set is older than
    key_state_max_age_s: east ("verified") serves only keys it verified while fresh (the
    revoked one included: the documented trade-off), west ("refuse") refuses every key."""
    used, unused = new_key(fleet, "used-before"), new_key(fleet, "never-used-here")

    def ask(region: str, key: str) -> httpx.Response:
        """A model nobody serves: 404 once the key is admitted, so each gateway answers for
        itself (a spill would bring the peer's verdict back)."""
        body = {**BODY, "model": "no-such-model"}
        headers = {"authorization": f"Bearer {key}"}
        return httpx.post(
            f"{fleet.gateways[region]}/v1/chat/completions", json=body, headers=headers, timeout=30
        )

    for region in (EAST, WEST):
        wait_for(lambda region=region: ask(region, used).status_code == 404, 10, 0.1, "the used key admitted")
    wait_for(
        lambda: (
            api_keys.key_id_of(unused) in LocalState(cluster_config(fleet, EAST).state_dir).load_keys().keys
        ),
        10,
        0.1,
        "the unused key at east",
    )
    for region in (EAST, WEST):
        psutil.Process(fleet.process("agent", region).pid).kill()
    fleet.api("DELETE", f"/v1/keys/{api_keys.key_id_of(used)}")
    died = time.monotonic()
    time.sleep(MAX_AGE_S + 1.5)

    assert ask(EAST, used).status_code == 404  # verified while fresh: still admitted
    stale = ask(EAST, unused)
    assert stale.status_code == 503 and stale.json()["error"]["code"] == "key_state_stale", stale.text
    refused = ask(WEST, used)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "key_state_stale"
    assert ask(WEST, unused).status_code == 503
    print(f"\n[staleness] {time.monotonic() - died:.1f}s after the agents died: verified mode served a "
          "verified key and refused an unseen one; refuse mode refused every key")  # fmt: skip
