"""Property-based fuzzing (schemathesis, driven by the admin API's own OpenAPI document)
of a real control plane process: no input gets a 5xx, and the server is healthy after.

On SQLite by default (example generation dominates the time); FLEET_FUZZ_DATABASES=all
adds PostgreSQL (the hand-written bad-input table runs on both in CI)."""

from __future__ import annotations

import os

import pytest

from control_plane.local.nats_server import NatsServer
from tests.control_plane.cp_server import ControlPlaneServer, fresh_database
from tests.fuzzing import fuzz
from tests.polling import wait_for

pytestmark = pytest.mark.slow
KINDS = ["sqlite", "postgresql"] if os.environ.get("FLEET_FUZZ_DATABASES") == "all" else ["sqlite"]


@pytest.fixture(params=KINDS)
def cp_server(request, tmp_path):
    """With a real nats-server: the batch routes read JetStream (without NATS they answer
    503 by design, tests/control_plane/test_batches_api.py)."""
    url, cleanup = fresh_database(request.param, tmp_path)
    nats = NatsServer(tmp_path / "nats").start()
    server = ControlPlaneServer(tmp_path / "home", url, nats.url)
    try:
        server.start()
        with server.client() as admin:
            wait_for(lambda: admin.get("/healthz").json()["nats"], 30, "the control plane's NATS link")
        yield server
    finally:
        server.kill()
        nats.stop()
        cleanup()


def test_admin_api_never_answers_5xx(cp_server) -> None:
    headers = {"Authorization": f"Bearer {cp_server.token}"}
    with cp_server.client() as admin:  # something to find, change and delete
        admin.post("/v1/deployments", json={"name": "fuzzed", "model": "m", "max_replicas": 3})
        admin.post("/v1/clusters", json={"id": "fuzz-c", "pools": [{"name": "gpus", "gpu_model": "L4"}]})
    report = fuzz(f"{cp_server.url}/openapi.json", cp_server.url, headers=headers, examples=3)
    print(f"\nadmin fuzz: {report.calls} calls in {report.call_s:.1f} s of server time ({report.table()})")
    assert report.calls > 60
    assert report.failures == []
    with cp_server.client() as admin:
        assert admin.get("/healthz").status_code == 200
        assert admin.get("/v1/deployments").status_code == 200
