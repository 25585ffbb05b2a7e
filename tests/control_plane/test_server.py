"""The control plane process: first start creates the admin token (0600) and writes its
URL; a restart keeps both and the data; a lost token file gets a new admin key; SIGTERM
exits cleanly; it connects to a real nats-server when there is one and serves without."""

from __future__ import annotations

import stat

import httpx

from control_plane.local.nats_server import NatsServer
from tests.control_plane.cp_server import ControlPlaneServer
from tests.polling import wait_for


def _nats_connected(url: str, timeout: float = 15.0) -> bool:
    return wait_for(
        lambda: httpx.get(f"{url}/healthz").json()["nats"], timeout, "the control plane's NATS link"
    )


def test_first_start_restart_and_sigterm(tmp_path):
    home = tmp_path / "home"
    db = f"sqlite:///{tmp_path / 'fleet.db'}"
    nats = NatsServer(tmp_path / "nats").start()
    first = ControlPlaneServer(home, db, nats_url=nats.url, loops=True)
    try:
        first.start()
        token_file = home / "admin-token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert (home / "api-url").read_text().strip() == first.url
        assert first.token.startswith("fleet-")
        assert _nats_connected(first.url), first.log_tail()
        with first.client() as admin:
            assert admin.post("/v1/deployments", json={"name": "kept", "model": "m"}).status_code == 201
            assert admin.get("/v1/keys").json()["total"] == 1
    finally:
        try:
            assert first.stop() == 0  # SIGTERM: clean exit
        finally:
            nats.stop()

    second = ControlPlaneServer(home, db).start()  # no NATS now: serves all the same
    try:
        assert second.token == first.token  # the same admin key, not a new one
        assert httpx.get(f"{second.url}/healthz").json() == {"status": "ok", "nats": False}
        with second.client() as admin:
            assert admin.get("/v1/deployments/kept").status_code == 200
            assert admin.get("/v1/keys").json()["total"] == 1
    finally:
        assert second.stop() == 0

    (home / "admin-token").unlink()
    third = ControlPlaneServer(home, db).start()
    try:
        assert third.token != first.token
        with third.client() as admin:
            keys = admin.get("/v1/keys").json()["items"]
            assert len(keys) == 2 and all(k["scopes"] == ["admin"] for k in keys)
    finally:
        third.stop()
