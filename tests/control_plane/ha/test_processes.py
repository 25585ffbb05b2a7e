"""Real control-plane processes on one SQLite database (no NATS): one leads; after a
SIGKILL a follower takes over within the lease and a retry; after a SIGTERM (the lease
released) at its next read."""

from __future__ import annotations

import os
import signal
import time

from tests.control_plane.cp_server import ControlPlaneServer

LEASE, DEADLINE, RETRY = 3.0, 2.0, 0.5


def _view(server: ControlPlaneServer) -> dict:
    with server.client() as client:
        r = client.get("/v1/control-plane")
        assert r.status_code == 200, r.text
        return r.json()


def _until_leader(server: ControlPlaneServer, timeout: float) -> float:
    began = time.monotonic()
    while not _view(server)["is_leader"]:
        assert time.monotonic() - began < timeout, f"no takeover within {timeout}s"
        time.sleep(0.1)
    return time.monotonic() - began


def test_takeover_after_sigkill_and_sigterm(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEET_LEADER_LEASE_S", str(LEASE))
    monkeypatch.setenv("FLEET_LEADER_RENEW_DEADLINE_S", str(DEADLINE))
    monkeypatch.setenv("FLEET_LEADER_RETRY_S", str(RETRY))
    db = f"sqlite:///{tmp_path / 'fleet.db'}"
    servers = [ControlPlaneServer(tmp_path / name, db, loops=True) for name in ("a", "b", "c")]
    a, b, c = servers
    try:
        a.start()
        b.start()
        first, second = _view(a), _view(b)
        assert first["is_leader"] and not second["is_leader"]
        assert first["epoch"] == second["epoch"] == 1 and second["leader"] == first["leader"]
        assert {m["url"] for m in second["members"]} == {a.url, b.url}

        os.killpg(a.proc.pid, signal.SIGKILL)
        a.proc.wait(10)
        a.proc = None
        killed = _until_leader(b, LEASE + RETRY + 3)
        assert _view(b)["epoch"] == 2

        c.start()
        assert not _view(c)["is_leader"]
        began = time.monotonic()
        assert b.stop() == 0  # SIGTERM: loops stopped, lease released, a clean exit
        stopped = time.monotonic() - began
        released = _until_leader(c, RETRY + 3)
        assert _view(c)["epoch"] == 3
        print(
            f"\ntakeover after SIGKILL {killed:.1f}s (lease {LEASE}s + retry {RETRY}s); "
            f"after SIGTERM {released:.1f}s from the leader's exit ({stopped:.1f}s to exit)"
        )
    finally:
        for server in servers:
            server.stop()
