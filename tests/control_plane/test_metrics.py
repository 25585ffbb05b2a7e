"""GET /metrics on a real control plane (SQLite, loops on, no NATS): stable names, no
auth, and values that follow clusters and deployments created through the API."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import polling
from tests.control_plane.cp_server import ControlPlaneServer, fresh_database

P = "fleet_control_plane_"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp-metrics")
    url, cleanup = fresh_database("sqlite", tmp)
    cp = ControlPlaneServer(tmp / "home", url, loops=True)
    try:
        yield cp.start()
    finally:
        cp.kill()
        cleanup()


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value}, fetched without any token."""
    resp = httpx.get(f"{url}/metrics", timeout=10)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples, name: str, **labels) -> float | None:
    return samples.get((P + name, tuple(sorted(labels.items()))))


def wait_for(url: str, check, timeout: float = 20.0):
    """The first scrape of `url` whose samples pass `check`."""

    def passing():
        samples = scrape(url)
        return samples if check(samples) else None

    return polling.wait_for(passing, timeout, "the metrics")


def test_names_present_without_auth(server):
    samples = scrape(server.url)
    names = {name for name, _ in samples}
    for name in ("clusters", "deployments", "reconcile_failures_total", "reconcile_duration_seconds_count"):
        assert P + name in names, sorted(names)
    assert value(samples, "clusters", status="healthy") == 0
    assert value(samples, "deployments") == 0
    assert value(samples, "rollouts", phase="deploying") == 0
    assert not any(n.startswith(("python_", "process_")) for n in names)  # dedicated registry
    assert not any(n.startswith("fleet_") and not n.startswith((P, "fleet_scheduled_job_")) for n in names)
    # the leader's scheduled jobs, each counted by outcome from its start
    assert samples[("fleet_scheduled_job_runs_total", (("job", "retention"), ("outcome", "error")))] == 0


def test_values_follow_the_api(server):
    with server.client() as api:
        r = api.post(
            "/v1/clusters",
            json={
                "id": "m-east",
                "region": "us-east",
                "pools": [
                    {"name": "a100", "gpu_model": "A100", "gpus_per_node": 4, "nodes": 2, "tier": "spot"}
                ],
            },
        )
        assert r.status_code == 201, r.text
        r = api.post("/v1/clusters", json={"id": "m-west", "region": "us-west", "status": "draining"})
        assert r.status_code == 201, r.text
        r = api.post(
            "/v1/deployments", json={"name": "m-chat", "model": "m/chat", "replicas": 3, "gpu_count": 2}
        )
        assert r.status_code == 201, r.text

        def placed(s):
            return value(s, "replicas", cluster="m-east", region="us-east", state="pending") == 3

        s = wait_for(server.url, placed)
        assert placed(s), {k: v for k, v in s.items() if k[0] == P + "replicas"}
        assert value(s, "clusters", status="healthy") == 1
        assert value(s, "clusters", status="draining") == 1
        assert value(s, "clusters", status="unhealthy") == 0
        assert value(s, "deployments") == 1
        assert value(s, "desired_replicas", deployment="m-chat") == 3
        assert value(s, "variant_replicas", deployment="m-chat", gpu_model="any") == 3  # no GPU mix
        assert value(s, "ready_replicas", deployment="m-chat") == 0  # no agent runs them
        assert value(s, "assigned_replicas", deployment="m-chat") == 3
        assert value(s, "replicas", cluster="m-west", region="us-west", state="pending") == 0
        pool = dict(cluster="m-east", pool="a100", tier="spot", gpu_model="A100")
        assert value(s, "pool_gpus", **pool) == 8
        assert value(s, "pool_gpus_used", **pool) == 6
        assert value(s, "reconcile_duration_seconds_count") >= 1
        assert value(s, "reconcile_duration_seconds_bucket", le="+Inf") == value(
            s, "reconcile_duration_seconds_count"
        )
        assert value(s, "reconcile_failures_total") == 0
        assert value(s, "last_reconcile_timestamp_seconds") > time.time() - 120

        r = api.patch("/v1/deployments/m-chat", json={"replicas": 1, "min_replicas": 1, "max_replicas": 1})
        assert r.status_code == 200, r.text
        s = wait_for(server.url, lambda s: value(s, "pool_gpus_used", **pool) == 2)
        assert value(s, "desired_replicas", deployment="m-chat") == 1
        assert value(s, "pool_gpus_used", **pool) == 2

        assert api.delete("/v1/deployments/m-chat").status_code == 200
        s = scrape(server.url)
        assert value(s, "deployments") == 0
        assert value(s, "desired_replicas", deployment="m-chat") is None
