"""Model URIs at deploy time: refused with a 422 naming the reason (against a real control
plane process), stored canonical, and an hf:// revision pinned to its commit (the real
huggingface_hub client against the local hub endpoint of tests/fleet_base/models/servers.py)."""

from __future__ import annotations

import pytest

from control_plane.api.errors import ApiError
from control_plane.api.model_refs import model_ref
from tests.fleet_base.models.servers import HubServer, serve


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        ("ftp://host/m.gguf", "unknown_scheme"),
        ("https://example.com/m.gguf", "sha256"),
        ("s3://UPPER/m.gguf", "bad_uri"),
        ("hf://no-org", "bad_uri"),
        ("oci://registry.example.com/Bad:tag", "bad_uri"),
    ],
)
def test_bad_model_uris_are_422(admin, model: str, reason: str) -> None:
    r = admin.post("/v1/deployments", json={"name": "bad-uri", "model": model})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["field"] == "model" and reason in error["message"]


def test_uris_are_stored_canonical_and_the_cache_api_answers(admin) -> None:
    r = admin.post(
        "/v1/deployments", json={"name": "s3-model", "model": " s3://models/smol/m.gguf", "replicas": 0}
    )
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["model"] == "s3://models/smol/m.gguf"
    assert admin.get("/v1/model-cache").status_code == 200
    r = admin.post("/v1/model-cache/pull", json={"model": "/local/path.gguf"})
    assert r.status_code == 422 and "model URIs" in r.json()["error"]["message"]


def test_hf_revision_is_pinned_to_its_commit(monkeypatch) -> None:
    hub = HubServer({"acme/tiny": {"config.json": b"{}", "model.safetensors": b"x" * 2048}})
    with serve(hub.app()) as base:
        monkeypatch.setenv("HF_ENDPOINT", base)
        commit = hub.commit("acme/tiny")
        assert model_ref("hf://acme/tiny") == f"hf://acme/tiny@{commit}"
        assert model_ref("hf://acme/tiny@main/config.json") == f"hf://acme/tiny@{commit}/config.json"
        with pytest.raises(ApiError, match="cannot pin"):
            model_ref("hf://acme/absent")
    pinned = f"hf://acme/tiny@{commit}"
    assert model_ref(pinned) == pinned  # a commit needs no hub
    assert model_ref("smollm2-135m") == "smollm2-135m"
