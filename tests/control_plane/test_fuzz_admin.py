"""Property-based fuzzing (schemathesis, driven by the admin API's own OpenAPI document)
of a real control plane process: no input gets a 5xx, and the server is healthy after.

On SQLite by default (example generation dominates the time); FLEET_FUZZ_DATABASES=all
adds PostgreSQL (the hand-written bad-input table runs on both in CI)."""

from __future__ import annotations

import os

import pytest

from tests.control_plane.cp_server import ControlPlaneServer, fresh_database
from tests.fuzzing import fuzz

pytestmark = pytest.mark.slow
KINDS = ["sqlite", "postgresql"] if os.environ.get("FLEET_FUZZ_DATABASES") == "all" else ["sqlite"]


@pytest.fixture(params=KINDS)
def cp_server(request, tmp_path):
    url, cleanup = fresh_database(request.param, tmp_path)
    server = ControlPlaneServer(tmp_path / "home", url)
    try:
        yield server.start()
    finally:
        server.stop()
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
