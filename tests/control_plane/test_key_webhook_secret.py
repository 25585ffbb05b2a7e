"""A key's webhook signing secret through the admin API, in process: shown once on create
and on rotation, derived (never stored, never in listings or the audit trail), and the
same secret the gateways sign with (verified with the standardwebhooks library); the
master secret is created once, 0600, and handed to every cluster's bundle."""

from __future__ import annotations

import json
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from control_plane.api.app import build_app
from control_plane.api.routers.keys import make_key
from control_plane.context import ControlPlaneContext
from control_plane.db.models import ApiKey
from control_plane.fleet_model.snapshot import live_keys
from control_plane.security.pki import FleetPki, ensure_webhook_master
from control_plane.settings import Settings
from fleet_base.batch.webhook_signing import MASTER_FILE, key_secret, read_master, signed_headers


def admin_client(app, sessions) -> TestClient:
    row, secret = make_key("admin", ["admin"], None, {})
    with sessions() as s:
        s.add(row)
        s.commit()
    return TestClient(app, headers={"Authorization": f"Bearer {secret}"})


@pytest.fixture
def master_file(tmp_path: Path) -> Path:
    return ensure_webhook_master(tmp_path / "pki" / MASTER_FILE)


@pytest.fixture
def api(sessions, tmp_path: Path, master_file: Path) -> Iterator[TestClient]:
    ctx = ControlPlaneContext(
        settings=Settings(home=tmp_path, webhook_master_file=master_file), sessions=sessions
    )
    with admin_client(build_app(ctx, run_loops=False), sessions) as client:
        yield client


def gateway_signs(sessions, master: bytes, key_id: str, payload: bytes) -> dict[str, str]:
    """What a gateway does: the key as published (`fleet_keys`), the secret derived from it."""
    with sessions() as s:
        record = next(k for k in live_keys(s) if k.key_id == key_id)
    return signed_headers(
        key_secret(master, key_id, record.webhook_secret_version), "async_1", payload, time.time()
    )


def test_shown_once_and_what_gateways_sign_with(api: TestClient, sessions, master_file: Path) -> None:
    r = api.post("/v1/keys", json={"name": "app"})
    assert r.status_code == 201, r.text
    key_id, shown = r.json()["key_id"], r.json()["webhook_secret"]
    assert shown.startswith("whsec_")
    payload = json.dumps({"id": "async_1"}).encode()
    master = read_master(master_file)
    assert Webhook(shown).verify(payload, gateway_signs(sessions, master, key_id, payload)) == {
        "id": "async_1"
    }
    listed = api.get("/v1/keys").text + api.get(f"/v1/keys/{key_id}").text + api.get("/v1/audit").text
    assert shown not in listed and shown.removeprefix("whsec_") not in listed
    with sessions() as s:
        assert s.get(ApiKey, key_id).webhook_secret_version == 0

    rotated = api.post(f"/v1/keys/{key_id}/webhook-secret")
    assert rotated.status_code == 200, rotated.text
    new = rotated.json()
    assert new["key_id"] == key_id and new["webhook_secret_version"] == 1 and new["webhook_secret"] != shown
    headers = gateway_signs(sessions, master, key_id, payload)
    assert Webhook(new["webhook_secret"]).verify(payload, headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(shown).verify(payload, headers)
    trail = api.get("/v1/audit", params={"resource_type": "key", "resource_id": key_id}).json()["items"]
    assert [a["action"] for a in trail] == ["key.webhook_secret", "key.create"]
    assert new["webhook_secret"] not in str(trail)

    assert api.post("/v1/keys/nosuchkey/webhook-secret").status_code == 404
    api.delete(f"/v1/keys/{key_id}")
    assert api.post(f"/v1/keys/{key_id}/webhook-secret").status_code == 409


def test_without_a_master_nothing_is_shown(sessions, tmp_path: Path) -> None:
    ctx = ControlPlaneContext(settings=Settings(home=tmp_path, webhook_master_file=None), sessions=sessions)
    with admin_client(build_app(ctx, run_loops=False), sessions) as api:
        r = api.post("/v1/keys", json={"name": "app"})
        assert r.status_code == 201 and r.json()["webhook_secret"] is None
        rotate = api.post(f"/v1/keys/{r.json()['key_id']}/webhook-secret")
        assert rotate.status_code == 409 and "FLEET_WEBHOOK_MASTER" in rotate.text


def test_master_created_once_private_and_in_every_bundle(tmp_path: Path) -> None:
    path = ensure_webhook_master(tmp_path / "pki" / MASTER_FILE)
    first = path.read_bytes()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(read_master(path)) == 32
    assert ensure_webhook_master(path).read_bytes() == first
    pki = FleetPki(tmp_path)
    creds = pki.cluster("east", ["localhost"])
    assert creds.webhook_master_file is not None and creds.webhook_master_file.read_bytes() == first
    assert stat.S_IMODE(creds.webhook_master_file.stat().st_mode) == 0o600
    assert pki.cluster("west", ["localhost"]).webhook_master_file.read_bytes() == first


def test_a_local_fleet_hands_every_process_the_master(tmp_path: Path, monkeypatch) -> None:
    from control_plane.local.fleet import LocalFleet
    from fleet_base.batch.webhook_signing import MASTER_ENV

    monkeypatch.delenv(MASTER_ENV, raising=False)
    fleet = LocalFleet(tmp_path, secure=False)
    env = fleet.env(fleet.new_state(["east"]))
    path = Path(env[MASTER_ENV])
    assert path == tmp_path / "pki" / MASTER_FILE and len(read_master(path)) == 32
    assert fleet.env(fleet.new_state(["east"]))[MASTER_ENV] == str(path)
    assert read_master(path) == read_master(Path(fleet.env(fleet.new_state(["east"]))[MASTER_ENV]))
