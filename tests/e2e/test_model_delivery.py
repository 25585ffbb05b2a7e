"""Model delivery end to end with real processes: moto's S3 server holds SmolLM2, a
local fleet (`fleetctl up`: nats-server, control plane, agent, gateway) deploys it from
`s3://`, the agent pre-pulls it into the node cache and the replica serves through the
gateway; then, with the S3 server stopped, a new replica (a second deployment of the same
URI) on the same node starts from the cache. `fleetctl models pull|ls|rm` reach the
agent's cache. Bad URIs are refused at deploy time (422); a missing object fails its
replica with the reason, without a crash loop."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import openai
import pytest

from control_plane.client import FleetClient
from control_plane.local.fleet import LocalFleet
from tests.e2e.sim_fleet import kill_fleet, wait_for
from tests.fleet_base.models.conftest import AWS_ENV, S3Server
from tests.fleet_base.models.servers import FileServer, serve
from tests.fleetctl import fleetctl, fleetctl_json

pytestmark = pytest.mark.slow
URI = "s3://models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def s3_fleet(tmp_path_factory, smollm2_gguf: Path):
    pytest.importorskip("moto.server")
    s3 = S3Server()
    client = s3.client()
    client.create_bucket(Bucket="models")
    client.upload_file(str(smollm2_gguf), "models", URI.split("/", 3)[3])
    home = tmp_path_factory.mktemp("fleet-home")
    saved = {k: os.environ.get(k) for k in [*AWS_ENV, "AWS_ENDPOINT_URL"]}
    os.environ.update({**AWS_ENV, "AWS_ENDPOINT_URL": s3.url})  # the agent's own credentials
    try:
        up = fleetctl_json(home, "up", "--detach", "--regions", "local-east", timeout=300)
        yield home, s3, up
    finally:
        kill_fleet(LocalFleet(home))
        s3.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _api(home: Path) -> FleetClient:
    """The fleet's admin API in-process: polling through a `fleetctl` process per second
    would pay a Python start each time."""
    return FleetClient((home / "api-url").read_text().strip(), (home / "admin-token").read_text().strip())


def _ready(home: Path, name: str, n: int) -> dict:
    with _api(home) as api:
        return wait_for(
            lambda: (s := api.get(f"/v1/deployments/{name}"))["ready_replicas"] >= n and s,
            300,
            0.5,
            f"{n} ready",
        )


def _chat(up: dict, key: str, name: str) -> str:
    client = openai.OpenAI(
        base_url=f"{up['clusters'][0]['gateway']}/v1", api_key=key, max_retries=2, timeout=120
    )
    reply = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Name one colour."}], max_tokens=4, temperature=0
    )
    return reply.choices[0].message.content or ""


def test_deploy_from_s3_serve_then_start_from_the_cache_without_s3(s3_fleet) -> None:
    home, s3, up = s3_fleet
    bad = fleetctl(home, "deploy", "bad", "--model", "ftp://models/x.gguf", check=False)
    assert bad.returncode != 0 and "unknown_scheme" in bad.stdout + bad.stderr
    bad = fleetctl(home, "deploy", "bad", "--model", "https://example.com/m.gguf", check=False)
    assert bad.returncode != 0 and "sha256" in bad.stdout + bad.stderr
    _models_pull_ls_rm(home)

    fleetctl_json(home, "deploy", "smol-s3", "--model", URI, "--replicas", "1")
    status = _ready(home, "smol-s3", 1)
    first = status["placements"][0]
    key = fleetctl_json(home, "keys", "create", "e2e")["key"]
    wait_for(lambda: _try_chat(up, key, "smol-s3"), 60, 0.5, "a reply through the gateway")
    with _api(home) as api:
        cached = wait_for(
            lambda: [m for m in api.get("/v1/model-cache") if m["state"] == "ready"], 30, 0.5, "ls"
        )
    assert cached[0]["uri"] == URI and cached[0]["in_use"] and cached[0]["size_bytes"] > 90_000_000
    parts = wait_for(lambda: _startup(home, "smol-s3", first["replica_id"]), 30, 0.5, "cold-start parts")
    assert parts["pull"] > 0 and parts["load"] > 0 and parts["warmup"] is not None
    assert fleetctl_json(home, "status", "smol-s3")["placements"][0]["startup"]["pull"] > 0  # fleetctl status

    s3.stop()  # the store is gone; the node's cache is not
    fleetctl_json(home, "deploy", "smol-s3-b", "--model", URI, "--replicas", "1")
    second = _ready(home, "smol-s3-b", 1)["placements"][0]
    assert second["cluster"] == first["cluster"]
    parts = wait_for(lambda: _startup(home, "smol-s3-b", second["replica_id"]), 30, 0.5, "its parts")
    assert parts["pull"] == 0.0  # nothing to wait for: it was cached
    assert _chat(up, key, "smol-s3-b")
    fleetctl_json(home, "delete", "smol-s3-b")

    fleetctl_json(home, "deploy", "absent", "--model", "s3://models/absent.gguf", "--replicas", "1")
    with _api(home) as api:
        event = wait_for(
            lambda: [
                e for e in api.items("/v1/events", deployment="absent") if e["kind"] == "replica_failed"
            ],
            120,
            0.5,
            "the failed pull's event",
        )
    assert "model pull failed" in event[0]["message"]


def _models_pull_ls_rm(home: Path) -> None:
    """`fleetctl models pull|ls|rm` through the control plane and NATS to the agent, which
    fetches from a real local HTTP server."""
    data = os.urandom(3_000_000)
    files = FileServer({"extra.gguf": data}, delay_s=0.002)
    with serve(files.app()) as base:
        uri = f"{base}/extra.gguf#sha256={hashlib.sha256(data).hexdigest()}"
        pulled = fleetctl(home, "models", "pull", uri, "--timeout", "120")
        assert "local-east: ready" in pulled.stdout
    rows = [m for m in fleetctl_json(home, "models", "ls") if m["uri"] == uri]  # the CLI's listing
    assert (
        rows and rows[0]["state"] == "ready" and rows[0]["size_bytes"] == len(data) and not rows[0]["in_use"]
    )
    assert len(files.gets) == 1
    removed = fleetctl_json(home, "models", "rm", uri)
    assert removed[0]["ok"], removed
    with _api(home) as api:
        wait_for(lambda: not [m for m in api.get("/v1/model-cache") if m["uri"] == uri], 30, 0.5, "rm")


def _try_chat(up: dict, key: str, name: str) -> bool:
    try:
        return bool(_chat(up, key, name))
    except openai.APIError:
        return False


def _startup(home: Path, name: str, replica_id: str) -> dict | None:
    with _api(home) as api:
        placements = api.get(f"/v1/deployments/{name}")["placements"]
    for p in placements:
        if p["replica_id"] == replica_id and p["startup"].get("load") is not None:
            return p["startup"]
    return None
