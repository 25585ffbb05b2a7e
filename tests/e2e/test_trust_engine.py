"""The attack-table rows that need the real engine: on a secured `fleetctl up` fleet with
SmolLM2-135M, a tenant learns nothing about another tenant's prompts from the prefix
cache, and the engine replica itself refuses anyone but its gateway."""

from __future__ import annotations

import httpx
import pytest

from agent.gateway.tenancy import cache_salt
from fleet_base.api_keys import key_id_of
from fleet_base.cluster_config import ClusterConfig
from fleet_base.local_state import LocalState
from fleet_base.security.tls import client_context
from tests.e2e.sim_fleet import kill_fleet
from tests.e2e.test_local_fleet import Fleet
from tests.fleetctl import fleetctl_json

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REGION = "local-east"
NAME = "smol"
# Long enough for several KV blocks; the same words for both tenants.
PROMPT = "You are a careful assistant for the internal finance team. " * 12 + "Summarise the plan."


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, smollm2_gguf):
    home = tmp_path_factory.mktemp("trust-engine")
    fleet = Fleet(home)
    try:
        fleet.up = fleetctl_json(
            home,
            "up",
            "--detach",
            "--regions",
            REGION,
            "--model",
            "smollm2-135m",
            "--name",
            NAME,
            timeout=600,
        )
        fleet.key = fleet.up["key"]
        yield fleet
    finally:
        kill_fleet(fleet.local)


def cached(gateway: str, key: str, **extra) -> int:
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, **extra}
    r = httpx.post(
        f"{gateway}/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=300
    )
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_tenant_b_gets_no_cached_tokens_from_tenant_a(fleet: Fleet):
    gateway = fleet.gateway_urls()[0]
    tenant_a = fleet.key
    tenant_b = fleetctl_json(fleet.home, "keys", "create", "tenant-b")["key"]
    tenant_c = fleetctl_json(fleet.home, "keys", "create", "tenant-c")["key"]
    cached(gateway, tenant_a)
    a_again = cached(gateway, tenant_a)
    assert a_again > 0  # the cache works for the tenant that filled it
    assert cached(gateway, tenant_b) == 0
    # C cannot ask for A's salt either: the gateway replaces any cache_salt a client sends
    assert cached(gateway, tenant_c, cache_salt=cache_salt(key_id_of(tenant_a))) == 0
    b_again = cached(gateway, tenant_b)
    assert b_again > 0  # per tenant, not off: B's repeat hits B's own blocks
    print(f"\n[tenants] A's repeat: {a_again} cached tokens; B and C (forging A's salt) on A's prompt: 0; "
          f"B's repeat: {b_again}")  # fmt: skip


def test_engine_replica_refuses_requests_without_the_gateways_token(fleet: Fleet):
    config = ClusterConfig.load(fleet.local.dir / "clusters" / REGION / "cluster.yaml")
    replica = next(r for r in LocalState(config.state_dir).load_replicas().replicas if r.deployment == NAME)
    assert replica.url.startswith("https://")
    verify = client_context(config.security.ca_file)
    body = {"model": NAME, "prompt": "hi", "max_tokens": 1}
    r = httpx.post(f"{replica.url}/v1/completions", json=body, verify=verify, timeout=30)
    assert r.status_code == 401
    r = httpx.post(
        f"{replica.url}/v1/completions",
        json=body,
        headers={"authorization": f"Bearer {fleet.key}"},  # a user's key is not the gateway's credential
        verify=verify,
        timeout=30,
    )
    assert r.status_code == 401
    assert httpx.get(f"{replica.url}/health", verify=verify, timeout=30).status_code == 200
