"""Team budgets through the admin API and fleetctl: set (evaluated at once), list with the
month's figures, delete; admin only, audited, and bad input is a 422 naming the field."""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.control_plane.cp_server import ControlPlaneServer
from tests.fleetctl import fleetctl


@pytest.fixture(scope="module")
def server(sqlite_server: ControlPlaneServer) -> ControlPlaneServer:
    return sqlite_server


def test_put_get_list_delete_and_audit(server: ControlPlaneServer) -> None:
    with server.client() as api:
        r = api.put("/v1/budgets/ml", json={"monthly_dollars": 500})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["team"] == "ml" and out["monthly_dollars"] == 500.0
        assert out["thresholds"] == [0.5, 0.8, 1.0] and out["hard"] is False
        assert out["spent_dollars"] == 0.0 and out["used_ratio"] == 0.0 and out["exhausted"] is False
        assert len(out["month"]) == 7 and out["alerted"] == []

        r = api.put(
            "/v1/budgets/ml", json={"monthly_dollars": 750.5, "thresholds": [1.0, 0.9, 0.9], "hard": True}
        )
        assert r.status_code == 200, r.text
        assert r.json()["thresholds"] == [0.9, 1.0] and r.json()["hard"] is True

        listed = api.get("/v1/budgets").json()
        assert [b["team"] for b in listed["items"]] == ["ml"] and listed["total"] == 1
        assert api.get("/v1/budgets/ml").json()["monthly_dollars"] == 750.5

        audit = api.get("/v1/audit", params={"resource_type": "budget", "resource_id": "ml"}).json()["items"]
        assert [a["action"] for a in audit] == ["budget.set", "budget.set"]
        assert audit[0]["before"]["monthly_dollars"] == 500.0 and audit[0]["after"]["hard"] is True

        assert api.delete("/v1/budgets/ml").json()["team"] == "ml"
        assert api.delete("/v1/budgets/ml").status_code == 404
        assert api.get("/v1/budgets/ml").status_code == 404
        assert api.get("/v1/budgets").json()["items"] == []


BAD = [
    ("team", "bad team!", {"monthly_dollars": 1}),
    ("monthly_dollars", "t", {"monthly_dollars": 0}),
    ("monthly_dollars", "t", {"monthly_dollars": -5}),
    ("monthly_dollars", "t", {"monthly_dollars": 1e-300}),
    ("monthly_dollars", "t", {"monthly_dollars": "500"}),
    ("monthly_dollars", "t", {}),
    ("thresholds.0", "t", {"monthly_dollars": 1, "thresholds": [80]}),
    ("thresholds.0", "t", {"monthly_dollars": 1, "thresholds": [0]}),
    ("thresholds", "t", {"monthly_dollars": 1, "thresholds": []}),
    ("hard", "t", {"monthly_dollars": 1, "hard": "yes"}),
    ("soft", "t", {"monthly_dollars": 1, "soft": True}),
]


def test_bad_input_is_a_422_naming_the_field_and_writes_need_admin(server: ControlPlaneServer) -> None:
    with server.client() as api:
        for field, team, body in BAD:
            r = api.put(f"/v1/budgets/{team}", json=body)
            assert r.status_code == 422, (body, r.text)
            assert r.json()["error"]["field"] == field, (body, r.text)
        assert api.get("/v1/budgets").json()["items"] == []
        reader = api.post("/v1/keys", json={"name": "reader", "scopes": ["read"]}).json()["key"]
    with server.client(reader) as api:
        assert api.put("/v1/budgets/t", json={"monthly_dollars": 1}).status_code == 403
        assert api.get("/v1/budgets").status_code == 200


def test_fleetctl_budgets_set_list_delete(server: ControlPlaneServer) -> None:
    home = server.home

    def run(*args: str) -> subprocess.CompletedProcess:
        return fleetctl(home, *args, env={"COLUMNS": "200"}, check=False)

    set_ = run(
        "budgets", "set", "web", "--monthly", "500", "--hard", "--thresholds", "50,80,100", "-o", "json"
    )
    out = json.loads(set_.stdout)
    assert out["thresholds"] == [0.5, 0.8, 1.0] and out["hard"] is True and out["monthly_dollars"] == 500.0
    with ThreadPoolExecutor(3) as pool:  # independent commands at once: each is mostly start-up
        table, listed, bad = pool.map(
            lambda args: run(*args),
            [
                ("budgets", "list"),
                ("budgets", "list", "-o", "json"),
                ("budgets", "set", "web", "--monthly", "5", "--thresholds", "50,150"),
            ],
        )
    assert "web" in table.stdout and "500.00" in table.stdout and "50%, 80%, 100%" in table.stdout
    assert [b["team"] for b in json.loads(listed.stdout)] == ["web"]
    assert bad.returncode == 1 and "at most 100" in bad.stderr
    assert "deleted the budget of team web" in run("budgets", "delete", "web").stdout
