"""`fleetctl batches` as a user runs it, against a real control plane on SQLite and a real
nats-server holding the batch store: ls (table, JSON, --status, --key), get, cancel and
its refusals as one line, and the reason when the control plane cannot reach NATS."""

from __future__ import annotations

import pytest

from control_plane.local.nats_server import NatsServer
from tests.control_plane.batch_seed import batch_record, ensure_resources, seed_batches, store_batch
from tests.control_plane.cp_server import ControlPlaneServer
from tests.fleetctl import fleetctl, fleetctl_json

WIDE = {"COLUMNS": "250"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batches-cli")
    nats = NatsServer(tmp / "nats").start()
    server = None
    try:
        ensure_resources(nats.url)
        server = ControlPlaneServer(tmp / "home", f"sqlite:///{tmp / 'fleet.db'}", nats.url).start()
        yield server, nats
    finally:
        if server is not None:
            server.kill()
        nats.stop()


def test_fleetctl_batches(fleet) -> None:
    server, nats = fleet
    home = server.home
    with server.client() as admin:
        key = admin.post("/v1/keys", json={"name": "evals", "scopes": ["inference"]}).json()["key_id"]
    older = batch_record(key, created_at=1_700_000_000, status="completed", counts=(10, 0, 10))
    older = older.model_copy(update={"output_file_id": "file-out1", "error_file_id": "file-err1"})
    newer = batch_record(key, created_at=1_700_000_100, status="in_progress", counts=(3, 1, 20))
    other = batch_record("otherkey", created_at=1_700_000_050, status="in_progress", counts=(0, 0, 5))
    seed_batches(nats.url, [older, newer, other])

    listed = fleetctl_json(home, "batches", "ls", "-o", "json")
    assert [b["id"] for b in listed] == [newer.id, other.id, older.id]  # newest first
    assert listed[0]["key_name"] == "evals" and listed[0]["request_counts"] == {
        "total": 20,
        "completed": 3,
        "failed": 1,
    }
    assert [b["id"] for b in fleetctl_json(home, "batches", "ls", "--status", "completed", "-o", "json")] == [
        older.id
    ]
    assert [b["id"] for b in fleetctl_json(home, "batches", "ls", "--key", key, "-o", "json")] == [
        newer.id,
        older.id,
    ]

    table = fleetctl(home, "batches", "ls", env=WIDE).stdout
    row = next(line for line in table.splitlines() if older.id in line)
    for cell in (
        f"evals ({key})",
        "/v1/chat/completions",
        "completed",
        "10/0/10",
        "2023-11-14 22:13:20",
        "file-out1",
        "file-err1",
    ):
        assert cell in row, cell
    assert "3/1/20" in table

    shown = fleetctl(home, "batches", "get", newer.id, env=WIDE).stdout
    assert "in_progress" in shown and "3/1/20" in shown and "evals" in shown

    cancelled = fleetctl_json(home, "batches", "cancel", newer.id, "-o", "json")
    assert cancelled["status"] == "cancelling" and cancelled["cancelling_at"] is not None
    assert store_batch(nats.url, newer.id).status == "cancelling"
    again = fleetctl(home, "batches", "cancel", newer.id, check=False)
    assert again.returncode == 1 and f"batch {newer.id} is cancelling" in again.stderr
    refused = fleetctl(home, "batches", "cancel", older.id, check=False)
    assert refused.returncode == 1
    assert (
        "is completed: only a validating or in_progress batch can be cancelled (HTTP 409)" in refused.stderr
    )
    said = fleetctl(home, "batches", "cancel", other.id, env=WIDE).stdout
    assert f"batch {other.id} is cancelling (0/0/5 done/failed/total)" in said
    missing = fleetctl(home, "batches", "get", "batch_nope", check=False)
    assert missing.returncode == 1 and "batch 'batch_nope' not found (HTTP 404)" in missing.stderr
    odd = fleetctl(home, "batches", "get", "../keys", check=False)
    assert odd.returncode == 1 and "expected letters, digits" in odd.stderr


def test_fleetctl_batches_without_nats_says_why(sqlite_server: ControlPlaneServer) -> None:
    """The control plane of `sqlite_server` has no NATS listening: a 503 with its reason."""
    result = fleetctl(sqlite_server.home, "batches", "ls", check=False)
    assert result.returncode == 1
    assert "NATS is unreachable" in result.stderr and "(HTTP 503)" in result.stderr
